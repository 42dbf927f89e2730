"""The rows of a Liger-Kernel benchmark CSV: reading, selecting, and the error summary of predictions."""

from __future__ import annotations

import csv
import math
import statistics

FIELDS = (
    "kernel_name",
    "kernel_provider",
    "kernel_operation_mode",
    "metric_name",
    "x_value",
    "y_value_50",
    "extra_benchmark_config_str",
    "gpu_name",
    "liger_version",
)


# ---- the CSV ---------------------------------------------------------------------------------------------------


def read_csv(path: str) -> list[dict]:
    """The rows of a CSV in Liger-Kernel's format (the ``FIELDS`` columns; others kept as they are).

    Raises:
        ValueError: a column of ``FIELDS`` is missing."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in FIELDS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: not a Liger-Kernel benchmark CSV (no column {', '.join(missing)})")
        return [dict(r) for r in reader]


def select(rows: list[dict], kernels=None, gpus=None, providers=None, metric: str = "speed") -> list[dict]:
    """The rows of ``metric`` (in ms) whose kernel, GPU name (substring) and provider are among those given."""
    out = []
    for r in rows:
        if r["metric_name"] != metric or r.get("metric_unit", "ms") not in ("ms", ""):
            continue
        if kernels is not None and r["kernel_name"] not in kernels:
            continue
        if gpus is not None and not any(g in r["gpu_name"] for g in gpus):
            continue
        if providers is not None and r["kernel_provider"] not in providers:
            continue
        out.append(r)
    return out


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values`` by linear interpolation between order statistics (numpy's default)."""
    v = sorted(values)
    if not v:
        return math.nan
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarise(rows: list[dict]) -> dict:
    """Row count, median and 90th percentile of |rel_error| over the rows that have one: overall and per GPU."""

    def stats(rs):
        e = [abs(r["rel_error"]) for r in rs]
        return {
            "rows": len(e),
            "median_abs_rel_error": statistics.median(e) if e else None,
            "p90_abs_rel_error": percentile(e, 0.9) if e else None,
        }

    done = [r for r in rows if r.get("rel_error") is not None]
    out = {"overall": stats(done), "per_gpu": {}}
    for g in sorted({r["gpu_name"] for r in done}):
        out["per_gpu"][g] = stats([r for r in done if r["gpu_name"] == g])
    out["not_modelled"] = sum(1 for r in rows if r.get("rel_error") is None)
    return out
