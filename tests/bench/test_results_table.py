"""benchmarks/results/: every report is one run, its figures are in the append-only table all.jsonl, and the table
command only ever appends (never rewrites a row, never takes a report that changed after its rows were written);
no shipped code reads a results file."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest

from benchmarks import results_table

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
TABLE = RESULTS / "all.jsonl"


def rows_of(table: Path) -> list[dict]:
    return [json.loads(line) for line in table.read_text(encoding="utf-8").splitlines()]


def reports(results: Path) -> list[Path]:
    return sorted(results.glob("*.json"))


def copy_reports(tmp_path: Path, names: list[str] | None = None) -> Path:
    """The repository's reports (all, or the named ones) in a fresh directory, without the table."""
    out = tmp_path / "results"
    out.mkdir()
    for path in reports(RESULTS):
        if names is None or path.stem in names:
            shutil.copy(path, out / path.name)
    return out


# a few reports of each layout keep the tmp_path tests quick; the committed table covers every report
SAMPLE = [
    "2026-11-30-cpu-epyc-adamw",
    "2026-11-30-cpu-epyc-bench-e2e-pp2",
    "2026-12-01-cpu-xeon-plan-check-loaded",
    "2026-12-01-cpu-xeon-hf-train",
    "2026-12-01-static-sm90-swiglu-rope",
]


def test_the_table_has_every_report_run_with_its_current_hash():
    rows = rows_of(TABLE)
    by_run = {}
    for row in rows:
        by_run.setdefault(row["run"], set()).add(row["report_sha256"])
    for path in reports(RESULTS):
        assert path.stem in by_run, f"{path.name} has no rows in all.jsonl: python -m benchmarks.results_table"
        assert by_run[path.stem] == {results_table.sha256(str(path))}, f"{path.name} changed after it was recorded"
    assert results_table.main(["--check"]) == 0


def test_rows_are_figures_with_a_run_and_a_unit():
    keys = set()
    for row in rows_of(TABLE):
        assert tuple(row) == results_table.FIELDS
        assert row["kind"] in ("measured", "predicted")
        assert isinstance(row["value"], (int, float)) and not isinstance(row["value"], bool)
        assert row["unit"] and row["metric"] and row["what"] and row["machine"]
        assert row["run"].startswith(row["date"][:4]) and len(row["date"]) == 10
        key = (row["run"], row["kind"], row["what"], json.dumps(row["config"], sort_keys=True), row["metric"])
        assert key not in keys, key  # one figure, one row
        keys.add(key)


def test_reports_are_one_run_each_named_by_date():
    for path in reports(RESULTS):
        report = json.loads(path.read_text(encoding="utf-8"))
        assert "runs" not in report, f"{path.name} holds several runs"
        assert results_table.DATE.match(path.stem), path.name


def test_a_second_invocation_appends_nothing_and_a_new_run_only_appends(tmp_path):
    results = copy_reports(tmp_path, SAMPLE)
    table = results / "all.jsonl"
    runs, n, gone = results_table.append(str(results))
    assert runs == len(SAMPLE) and n > 0 and not gone
    first = table.read_bytes()
    assert results_table.append(str(results)) == (0, 0, [])
    assert table.read_bytes() == first

    # a new run appends its rows after the existing bytes, which stay as they were
    shutil.copy(results / "2026-12-01-cpu-xeon-hf-train.json", results / "2026-12-02-cpu-xeon-hf-train.json")
    assert results_table.append(str(results))[0] == 1
    after = table.read_bytes()
    assert after.startswith(first) and len(after) > len(first)
    added = [json.loads(line) for line in after[len(first) :].decode().splitlines()]
    assert {r["run"] for r in added} == {"2026-12-02-cpu-xeon-hf-train"}

    # the committed table, given some of its reports, gains nothing (the others are only named as gone)
    shutil.copy(TABLE, table)
    for extra in results.glob("2026-12-02-*"):
        extra.unlink()
    before = table.read_bytes()
    assert results_table.append(str(results))[:2] == (0, 0)
    assert table.read_bytes() == before


def test_a_report_changed_after_its_rows_were_written_is_refused(tmp_path, capsys):
    results = copy_reports(tmp_path, SAMPLE)
    results_table.append(str(results))
    table = results / "all.jsonl"
    first = table.read_bytes()

    report = results / "2026-12-01-cpu-xeon-hf-train.json"
    data = json.loads(report.read_text())
    data["rows"][0]["times_ms"]["megakernels"] *= 0.5
    report.write_text(json.dumps(data, indent=1) + "\n")
    # a new report beside it is not appended either: the command stops before writing anything
    shutil.copy(results / "2026-11-30-cpu-epyc-adamw.json", results / "2026-12-02-cpu-epyc-adamw.json")

    with pytest.raises(results_table.ReportError, match="2026-12-01-cpu-xeon-hf-train.json.*immutable"):
        results_table.append(str(results))
    assert results_table.main(["--results", str(results)]) == 2
    err = capsys.readouterr().err
    assert "2026-12-01-cpu-xeon-hf-train.json" in err and "record new figures as a new run" in err
    assert results_table.main(["--results", str(results), "--check"]) == 2
    assert table.read_bytes() == first


def test_a_file_of_several_runs_and_a_figure_without_a_unit_are_refused(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    machine = {"cpu": "test", "threads": 1, "commit": "abc1234", "date": "2026-12-02"}
    (results / "2026-12-02-cpu-test-two.json").write_text(json.dumps({"runs": [{"machine": machine}] * 2}))
    with pytest.raises(results_table.ReportError, match="several runs"):
        results_table.append(str(results))
    (results / "2026-12-02-cpu-test-two.json").unlink()
    (results / "2026-12-02-cpu-test-odd.json").write_text(
        json.dumps({"machine": machine, "results": [{"op": "x", "furlongs": 1.5}]})
    )
    with pytest.raises(results_table.ReportError, match="no unit for the figure 'furlongs'"):
        results_table.append(str(results))
    assert not (results / "all.jsonl").exists()


def _strings_outside_docstrings(tree: ast.AST):
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node


def test_no_shipped_code_reads_a_results_file():
    """Constants are plain data in the code; comments and docstrings may tell where a figure was measured."""
    offenders = []
    for package in ("megakernels", "megakernels_models", "scripts"):
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            offenders += [
                f"{path.relative_to(ROOT)}:{node.lineno}"
                for node in _strings_outside_docstrings(tree)
                if "benchmarks/results" in node.value or "static-sm90" in node.value
            ]
        for path in sorted((ROOT / package).rglob("*.sh")):
            offenders += [
                f"{path.relative_to(ROOT)}:{n}"
                for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                if "benchmarks/results" in line and not line.lstrip().startswith("#")
            ]
    assert not offenders, offenders
