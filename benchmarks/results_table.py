"""The figures of every report in benchmarks/results/ as one table, made on demand (never committed).

    python -m benchmarks.results_table            # write build/results/all.jsonl
    python -m benchmarks.results_table --check    # write nothing; fail if a report cannot be read

Every JSON file in the results directory is one run's compact figures, named ``<date>-<machine>-<what>.json``
beside its Markdown report, and never rewritten once committed (tests/bench/test_results.py). The table has one
JSON object a line, one figure each::

    {"run" (the report's file stem), "date", "commit", "machine", "kind" ("measured" | "predicted"),
     "what" (kernel, op or benchmark), "config" (shape, dtype, ...: a mapping), "metric", "value", "unit",
     "report_sha256" (of the report file the row was read from)}

Figures are read by the report's layout (the static cost report, ``megakernels bench``, the older benchmark
scripts' ``results`` lists, ``bench --plan-check``). A number whose unit cannot be told from its name stops the
command: a table row without a unit would be a guess. Traces (per-step losses, per-rank splits and memory) stay
in the report.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
OUT = os.path.join(os.path.dirname(RESULTS), "..", "build", "results", "all.jsonl")
FIELDS = ("run", "date", "commit", "machine", "kind", "what", "config", "metric", "value", "unit", "report_sha256")
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}-")

# The static report's figures and their units: everything it writes is a prediction of the model (or, for
# registers and spills, read from the SASS it compiled), none of it measured on the GPU it models.
STATIC_METRICS = {
    "predicted_fraction": "fraction of ceiling",
    "predicted_time_us": "us",
    "predicted_tflops": "TFLOP/s",
    "registers": "registers/thread",
    "spill_bytes": "B",
    "shared_bytes": "B",
    "instructions_per_element": "instructions/element",
    "instructions_per_iteration": "instructions/iteration",
}


class ReportError(Exception):
    """A report the table cannot take as it is (changed since recorded, several runs in one file, a figure
    without a unit)."""


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def unit_of(path: tuple[str, ...]) -> str:
    """The unit of a figure from its key (and its parent's: ``time_split_s.forward`` is in seconds)."""
    for key in (path[-1].lower(), path[-2].lower() if len(path) > 1 else ""):
        if key.endswith("_ms") or key == "ms":
            return "ms"
        if key.endswith("tokens_per_s"):  # tokens_per_s, real_tokens_per_s
            return "tokens/s"
        if key.endswith("tokens_per_sample"):
            return "tokens"
        if key.endswith("_s"):
            return "s"
        if "gbps" in key:
            return "GB/s"
        if "tflops" in key:
            return "TFLOP/s"
        if key.endswith("_mib"):
            return "MiB"
        if key.endswith("bytes_per_param"):
            return "B/parameter"
        if key.startswith("speedup") or key == "ratio" or key.endswith("_ratio"):
            return "x"
        if (
            key.startswith("fraction")
            or key.endswith("fraction")
            or key.endswith("efficiency")
            or key == "mfu"
            or "accuracy" in key
            or key == "exact_match"
        ):
            return "fraction"
        if "loss" in key:
            return "nats/token"
        if key == "kendall_tau":
            return "tau"
    raise ReportError(f"no unit for the figure {'.'.join(path)!r}: name it by its unit or teach unit_of")


def _leaves(value, path=()):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, path + (str(k),))
    else:
        yield path, value


def _figure(value) -> bool:
    # ints in these reports are sizes and counts that say what was run (batch, heads, tp), so config; a float is a
    # figure. bool is an int in Python, hence the explicit test.
    return isinstance(value, float)


def _machine(report: dict) -> str:
    m = report.get("machine")
    if isinstance(m, dict):
        if "name" in m:  # the static model's constants
            return f"{m['name']}, static model"
        if m.get("gpu"):
            return str(m["gpu"])
        if "cpu" in m:
            return f"{m['cpu']}, {m['threads']} threads" if "threads" in m else str(m["cpu"])
    device = report.get("device")
    if isinstance(device, dict) and "name" in device:
        return str(device["name"])
    if isinstance(report.get("shapes"), list):  # published measurements beside our predictions (by GPU)
        return "published measurements on " + ", ".join(sorted({str(o.get("gpu")) for o in report["shapes"]}))
    raise ReportError("the report names no machine")


def _static_rows(report):
    for k in report["kernels"]:
        config = {"shape": k.get("shape"), "dtype": k.get("dtype"), "config": k.get("config"), "arch": k.get("arch")}
        for metric, unit in STATIC_METRICS.items():
            if isinstance(k.get(metric), (int, float)) and not isinstance(k.get(metric), bool):
                yield "predicted", k["name"], config, metric, k[metric], unit


def _bench_rows(report):
    ceilings = report.get("ceilings") or {}
    for path, value in _leaves({k: v for k, v in ceilings.items() if k not in ("device", "copy_bytes", "gemm_n")}):
        if _figure(value):
            yield "measured", "ceiling", {"device": ceilings.get("device")}, ".".join(path), value, unit_of(path)
    for row in report.get("rows", []):
        config = {k: row.get(k) for k in ("dtype", "shape", "pass", "variant")}
        sections = {
            "times_ms": lambda _: "ms",
            "rates": lambda _: row["unit"],
            "speedups": lambda _: "x",
            "extra_columns": lambda name: name,
        }
        for section, unit in sections.items():
            for impl, value in (row.get(section) or {}).items():
                if value is not None:
                    yield "measured", row["op"], config, f"{section}.{impl}", value, unit(impl)
        if row.get("fraction_of_ceiling") is not None:
            yield (
                "measured",
                row["op"],
                config,
                "fraction_of_ceiling",
                row["fraction_of_ceiling"],
                f"fraction of {row['ceiling_name']}",
            )
    for entry in report.get("e2e", []):
        config = {
            "precision": entry.get("precision"),
            "micro_batch_size": entry.get("micro_batch_size"),
            "shape": entry.get("shape"),
            "layout": (entry.get("trainer") or {}).get("layout"),
        }
        for part in ("trainer", "baseline"):
            for path, value in _leaves(entry.get(part) or {}):
                if not _figure(value):
                    continue
                # the schedule's bubble is the 1F1B formula's, not a timing
                kind = "predicted" if path[-1] == "schedule_bubble_fraction" else "measured"
                yield kind, entry["name"], config, ".".join((part,) + path), value, unit_of(path)


def _results_rows(report, default_what):
    # a row may say its figures are "predicted" (computed, e.g. simulated, rather than timed); "measured" otherwise
    for r in report["results"]:
        what = r.get("op") or r.get("name") or default_what
        kind = r.get("kind", "measured")
        if kind not in ("measured", "predicted"):
            raise ReportError(f"a results row's kind must be 'measured' or 'predicted', got {kind!r}")
        leaves = list(_leaves({k: v for k, v in r.items() if k not in ("op", "name", "kind")}))
        config = {".".join(path): value for path, value in leaves if not _figure(value)}
        for path, value in leaves:
            if not _figure(value):
                continue
            yield kind, what, config, ".".join(path), value, unit_of(path)


def _plan_check_rows(report):
    for path, value in _leaves(report.get("device") or {}):
        # efficiency and memory are the profile's assumptions, not what the run measured
        if _figure(value) and path[-1] not in ("efficiency", "memory_gb"):
            yield "measured", "plan_check device profile", {}, ".".join(path), value, unit_of(path)
    for kind in ("predicted", "measured"):
        for layout, seconds in report[kind].items():
            yield kind, "plan_check step", {"layout": layout}, "step_s", seconds, "s"
    if isinstance(report.get("kendall_tau"), (int, float)):
        yield "measured", "plan_check order", {}, "kendall_tau", float(report["kendall_tau"]), "tau"


def _calibration_rows(report):
    # ``bench --static --peer-csv``: a peer's published timings (measured, by the peer) beside the model's
    for r in report["rows"]:
        config = {
            k: r.get(k)
            for k in (
                "kernel_provider",
                "kernel_operation_mode",
                "gpu_name",
                "x_value",
                "extra_benchmark_config_str",
                "liger_version",
            )
        }
        if isinstance(r.get("published_ms"), float):
            yield "measured", r["kernel_name"], config, "published_ms", r["published_ms"], "ms"
        if isinstance(r.get("predicted_ms"), float):
            yield "predicted", r["kernel_name"], config, "predicted_ms", r["predicted_ms"], "ms"
        # the side-by-side: our kernels at the peer's shape, through the same model
        if isinstance(r.get("ours_predicted_ms"), float):
            yield "predicted", r["kernel_name"], config, "ours_predicted_ms", r["ours_predicted_ms"], "ms"
            yield "predicted", r["kernel_name"], config, "ours_over_peer", r["ours_over_peer"], "x"


def _published_attention_rows(report):
    # ``python -m costmodel.published``: published attention throughputs beside our predictions
    for o in report["shapes"]:
        config = {k: o[k] for k in ("gpu", "pass", "head_dim", "seqlen", "causal")}
        for impl, tflops in o["published_tflops"].items():
            yield "measured", f"flash_attention {impl}", config, "tflops", float(tflops), "TFLOP/s"
        yield "predicted", "flash_attention megakernels", config, "tflops", o["ours"]["predicted_tflops"], "TFLOP/s"


REPRODUCE_UNITS = {
    "tflops_per_gpu": "TFLOP/s",
    "mfu": "fraction",
    "tokens_per_s_per_gpu": "tokens/s",
    "iteration_s": "s",
}


def _reproduce_rows(report):
    # ``megakernels plan --reproduce``: a publication's figure (measured, by its authors) beside the step-time model's
    for r in report["rows"]:
        config = {
            k: r.get(k)
            for k in ("csv", "source", "model", "num_layers", "hidden", "gpu", "num_gpus", "tp", "pp", "global_batch")
        }
        config["layout"] = r.get("layout")
        unit = REPRODUCE_UNITS[r["published_metric"]]
        what = f"{r['model']} l{r['num_layers']} h{r['hidden']} on {r['num_gpus']} {r['gpu']}"
        yield "measured", what, config, r["published_metric"], float(r["published_value"]), unit
        yield "predicted", what, config, r["published_metric"], float(r["predicted"]), unit


def figures(report: dict, stem: str):
    """(kind, what, config, metric, value, unit) for every figure of one report, by its layout."""
    if "runs" in report:
        raise ReportError("the file holds several runs: split it into one report per run")
    if "kernels" in report:
        return list(_static_rows(report))
    if report.get("kind") == "plan --reproduce":
        return list(_reproduce_rows(report))
    if {"shapes", "csv"} <= set(report):  # static vs published attention (the first run's JSON has no "kind")
        return list(_published_attention_rows(report))
    if "rows" in report and "summary" in report and "host" in report:
        return list(_calibration_rows(report))
    if "rows" in report or "e2e" in report:
        return list(_bench_rows(report))
    if "results" in report:
        return list(_results_rows(report, DATE.sub("", stem)))
    if "predicted" in report and "measured" in report:
        return list(_plan_check_rows(report))
    raise ReportError("unknown report layout: teach benchmarks/results_table.py to read it")


def report_rows(path: str) -> list[dict]:
    """The table rows of one report file."""
    stem = os.path.splitext(os.path.basename(path))[0]
    if not DATE.match(stem):
        raise ReportError(f"{path}: a report is named <date>-<machine>-<what>.json")
    with open(path, encoding="utf-8") as f:
        report = json.load(f)
    machine = report.get("machine") if isinstance(report.get("machine"), dict) else {}
    date = report.get("date") or machine.get("date") or stem[:10]
    commit = report.get("commit") or machine.get("commit") or None
    digest = sha256(path)
    try:
        found = figures(report, stem)
        where = _machine(report)
    except ReportError as e:
        raise ReportError(f"{path}: {e}") from None
    if not found:
        raise ReportError(f"{path}: no figures found (an empty report would be read again on every run)")
    return [
        dict(zip(FIELDS, (stem, date, commit, where, kind, what, config, metric, value, unit, digest)))
        for kind, what, config, metric, value, unit in found
    ]


def table_rows(results: str = RESULTS) -> list[dict]:
    """The rows of every report in ``results``, in file order.

    Raises:
        ReportError: a report the table cannot read (named, with why).
    """
    return [
        row
        for name in sorted(os.listdir(results))
        if name.endswith(".json")
        for row in report_rows(os.path.join(results, name))
    ]


def write(results: str = RESULTS, out: str = OUT) -> tuple[int, int]:
    """Write the table of ``results`` to ``out`` (made whole, then moved into place); (runs, rows)."""
    rows = table_rows(results)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    os.replace(tmp, out)
    return len({r["run"] for r in rows}), len(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.results_table", description=__doc__.split("\n")[0])
    parser.add_argument("--results", default=RESULTS, help="the reports' directory (default: %(default)s)")
    parser.add_argument("--out", default=OUT, help="the table written (default: %(default)s; not under git)")
    parser.add_argument("--check", action="store_true", help="write nothing; fail if a report cannot be read")
    args = parser.parse_args(argv)
    try:
        if args.check:
            rows = table_rows(args.results)
            print(f"{args.results}: {len({r['run'] for r in rows})} reports, {len(rows)} figures, all readable")
            return 0
        runs, n = write(args.results, args.out)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {n} rows of {runs} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
