"""benchmarks/results/: small (5 MB in all, each JSON of figures 200 KB at most), no derived table under git, every
report one run named by its date, nothing committed rewritten by a later commit, the table made on demand from the
reports, and no shipped code reading a results file."""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path

import pytest

from benchmarks import results_table

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
MAX_TOTAL, MAX_JSON = 5 << 20, 200 << 10


def reports(results: Path) -> list[Path]:
    return sorted(results.glob("*.json"))


def test_results_stay_small_and_hold_no_derived_table():
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= MAX_TOTAL
    assert [p.name for p in files if p.suffix == ".json" and p.stat().st_size > MAX_JSON] == []
    assert [p.name for p in files if p.suffix == ".jsonl" or p.name == "all.jsonl"] == []


def test_reports_are_one_run_each_named_by_date():
    for path in reports(RESULTS):
        report = json.loads(path.read_text(encoding="utf-8"))
        assert "runs" not in report, f"{path.name} holds several runs"
        assert results_table.DATE.match(path.stem), path.name


def _git(*args) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


# Results were made immutable at this commit; the reports rewritten before it are history.
IMMUTABLE_SINCE = "556abcd"


def test_no_committed_result_is_rewritten():
    """A new run is a new file: since results became immutable, no commit modified one (deleting a derived dump is
    not rewriting a result)."""
    assert (ROOT / ".git").exists(), "the results check reads the repository's history (a clone)"
    changed = _git(
        "log", "--diff-filter=M", "--name-only", "--format=", f"{IMMUTABLE_SINCE}..HEAD", "--", "benchmarks/results"
    )
    assert changed.split() == []


def test_the_table_is_made_from_every_report(tmp_path):
    out = tmp_path / "all.jsonl"
    assert results_table.main(["--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert {r["run"] for r in rows} == {p.stem for p in reports(RESULTS)}
    keys = set()
    for row in rows:
        assert tuple(row) == results_table.FIELDS
        assert row["kind"] in ("measured", "predicted")
        assert isinstance(row["value"], (int, float)) and not isinstance(row["value"], bool)
        assert row["unit"] and row["metric"] and row["what"] and row["machine"]
        assert row["run"].startswith(row["date"][:4]) and len(row["date"]) == 10
        key = (row["run"], row["kind"], row["what"], json.dumps(row["config"], sort_keys=True), row["metric"])
        assert key not in keys, key  # one figure, one row
        keys.add(key)


def test_a_file_of_several_runs_and_a_figure_without_a_unit_are_refused(tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    machine = {"cpu": "test", "threads": 1, "commit": "abc1234", "date": "2026-12-02"}
    (results / "2026-12-02-cpu-test-two.json").write_text(json.dumps({"runs": [{"machine": machine}] * 2}))
    with pytest.raises(results_table.ReportError, match="several runs"):
        results_table.table_rows(str(results))
    (results / "2026-12-02-cpu-test-two.json").unlink()
    (results / "2026-12-02-cpu-test-odd.json").write_text(
        json.dumps({"machine": machine, "results": [{"op": "x", "furlongs": 1.5}]})
    )
    out = tmp_path / "all.jsonl"
    assert results_table.main(["--results", str(results), "--out", str(out)]) == 2
    assert "no unit for the figure 'furlongs'" in capsys.readouterr().err
    assert not out.exists()


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
