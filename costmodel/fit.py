"""The static model's global constants fitted on a development CSV of a peer's published timings.

``python -m costmodel.fit --peer-csv benchmarks/peer/liger_dev.csv [--peer-path DIR]`` prices every
modelled row of the CSV (``command.predict_row``) for constants drawn from one coarse grid (``GRID``), the same values
for every kernel and GPU, and prints the point that minimises median + 90th percentile of |rel_error| together with
the current constants' errors. The search is coordinate descent over the grid from the current constants (each
constant in turn set to the grid value that lowers the objective most, until none does): 7 constants, a few
hundred evaluations of the whole set, each a re-pricing of recorded launches (nothing is recompiled).

The constants are global on purpose: a per-kernel factor would fit the development set and predict nothing.
costmodel/README.md records the fitted values and the residuals they leave.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from costmodel import model
from costmodel.peers import command, pricing, table

# (owner, field) -> candidate values; owner "machine" applies to every GPU of model.MACHINES, "host" to pricing.HOST
GRID: dict[tuple[str, str], tuple] = {
    ("machine", "launch_s"): (2e-6, 4e-6, 6e-6, 8e-6, 10e-6, 12e-6),
    ("machine", "issue_efficiency"): (0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
    ("machine", "overlap_p"): (1.0, 1.5, 2.0, 3.0, 4.0, math.inf),
    ("host", "triton_launch_s"): (20e-6, 30e-6, 40e-6, 50e-6, 60e-6),
    ("host", "torch_op_s"): (3e-6, 5e-6, 8e-6, 12e-6),
    ("host", "function_s"): (10e-6, 20e-6, 30e-6, 45e-6, 60e-6),
    ("host", "backward_s"): (60e-6, 100e-6, 130e-6, 160e-6, 200e-6),
}


def current() -> dict:
    """The constants as the model ships them (the H200's machine fields; every GPU shares them)."""
    return {(owner, f): getattr(model.H200 if owner == "machine" else pricing.HOST, f) for owner, f in GRID}


def evaluate(rows: list[dict], point: dict, peer_path: str | None, cache: dict) -> dict:
    """``table.summarise`` of the modelled rows priced with the constants of ``point``."""
    mach = {k: v for (o, k), v in point.items() if o == "machine"}
    host = dataclasses.replace(pricing.HOST, **{k: v for (o, k), v in point.items() if o == "host"})
    machines = {m.name: dataclasses.replace(m, **mach) for m in model.MACHINES.values()}
    out = [command.predict_row(r, peer_path, cache, machines, host) for r in rows]
    return table.summarise([p for p in out if p.get("rel_error") is not None])


def objective(summary: dict) -> float:
    """Median + 90th percentile of |rel_error|, averaged over the GPUs (each GPU weighs the same however many
    rows it has: a set dominated by one GPU's rows would otherwise fit that GPU alone)."""
    per = summary["per_gpu"].values()
    return sum(s["median_abs_rel_error"] + s["p90_abs_rel_error"] for s in per) / max(1, len(per))


def fit(rows: list[dict], peer_path: str | None = None, log=print) -> tuple[dict, dict]:
    """Coordinate descent over ``GRID`` from the shipped constants: (best point, its summary)."""
    cache: dict = {}
    point = current()
    best = evaluate(rows, point, peer_path, cache)
    if log:
        log(f"shipped constants: {_fmt(best)}")
    improved = True
    while improved:
        improved = False
        for key, values in GRID.items():
            for v in values:
                if v == point[key]:
                    continue
                trial = {**point, key: v}
                s = evaluate(rows, trial, peer_path, cache)
                if objective(s) < objective(best) - 1e-9:
                    point, best, improved = trial, s, True
                    if log:
                        log(f"  {key[1]} = {v:g}: {_fmt(s)}")
    return point, best


def _errors(s: dict) -> str:
    return f"median {100 * s['median_abs_rel_error']:.1f} %, p90 {100 * s['p90_abs_rel_error']:.1f} %"


def _fmt(summary: dict) -> str:
    s = summary["overall"]
    per = "; ".join(f"{g.removeprefix('NVIDIA ')} {_errors(v)}" for g, v in summary["per_gpu"].items())
    return f"{s['rows']} rows, {_errors(s)} ({per})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer-csv", required=True, help="a CSV in Liger-Kernel's benchmark format")
    ap.add_argument(
        "--peer-path", default=None, help="where the peer's versions are installed (install.default_peer_root)"
    )
    args = ap.parse_args(argv)
    rows = table.select(table.read_csv(args.peer_csv))
    point, best = fit(rows, args.peer_path)
    print("fitted constants:")
    for (owner, f), v in point.items():
        print(f"  {owner}.{f} = {v:g}")
    print(f"fitted: {_fmt(best)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
