"""``megakernels bench --static``: the static cost report (costmodel/README.md).

Compiles every registered kernel config for sm_90 as a real launch gets it (no GPU: nvcc, the Triton compiler,
ptxas, cuobjdump), prints one table per family — registers, spills, shared memory, resident blocks per SM, MMA
kind, TMA, SASS instructions and MUFU operations per element (streaming kernels) or per tile iteration
(attention, the grouped GEMM), bytes through L2 per element against the minimum, what bounds it, and the predicted
fraction of the
H200 ceiling — and with ``--out DIR`` writes ``DIR/static.json``::

    {"machine": {model constants}, "tools": {...}, "commit", "date",
     "kernels": [{name, family, config, shape, dtype, arch, registers, spill_bytes, shared_bytes, blocks_per_sm,
                  mma, tma, instructions_per_element | instructions_per_iteration, mufu_per_..., bound,
                  predicted_time_us, predicted_fraction, launches: [...]} | {..., "error"}]}

Predictions are reported, never asserted: the first GPU run calibrates them (scripts/gpu_check.sh).
"""

from __future__ import annotations

import dataclasses
import os
import time

from costmodel import model, registry


def tools() -> dict:
    """Versions of the compilers the report used."""
    import subprocess

    from costmodel import compiled

    out = {}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    tool = compiled.nvcc()
    if tool:
        v = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
        out["nvcc"] = v[-1] if v else ""
    return out


def _pct(v) -> str:
    return f"{100 * v:.0f}%" if isinstance(v, (int, float)) else "-"


def format_row(r: dict) -> str:
    if "error" in r:
        return f"  {r['name']:<34}{r['shape']:<28}{r['dtype']:<6}{r['config']:<16}  error: {r['error']}"
    per = r.get("instructions_per_element")
    unit = "/el"
    if per is None:
        per, unit = r.get("instructions_per_iteration"), "/it"
    mufu = r.get("mufu_per_element", r.get("mufu_per_iteration"))
    bytes_ = f"{r['bytes_per_element']:.1f}/{r['min_bytes_per_element']:.1f}" if "bytes_per_element" in r else "-"
    return (
        f"  {r['name']:<34}{r['shape']:<28}{r['dtype']:<6}{r['config']:<16}{r['registers']:>5}{r['spill_bytes']:>6}"
        f"{r['shared_bytes'] / 1024:>8.1f}{r.get('blocks_per_sm', 0):>5}  {r['mma']:<9}{'yes' if r['tma'] else 'no':<4}"
        f"{per:>8.1f}{unit}{mufu:>7.2f}{bytes_:>12}  {r.get('bound', '-'):<8}{_pct(r['predicted_fraction']):>6}"
    )


HEADER = (
    f"  {'kernel':<34}{'shape':<28}{'dtype':<6}{'config':<16}{'regs':>5}{'spill':>6}{'smemKiB':>8}{'blk':>5}  "
    f"{'mma':<9}{'tma':<4}{'instr':>11}{'mufu':>7}{'B/el(min)':>12}  {'bound':<8}{'pred':>6}"
)


def select(families: list[str] | None = None, ops: list[str] | None = None, key_only: bool = False) -> list[int]:
    """Indices into ``registry.entries()`` of the entries of ``families`` / ops in ``ops`` (the part of an entry's
    name before the dot), only the test suite's key configs with ``key_only``."""
    return [
        i
        for i, e in enumerate(registry.entries())
        if (families is None or e.family in families)
        and (ops is None or e.name.split(".")[0] in ops)
        and (e.key or not key_only)
    ]


def _evaluate(index: int) -> dict:
    e = registry.entries()[index]
    return {**e.row(), "key": e.key, "needs_wgmma": e.needs_wgmma}


def run(indices: list[int], jobs: int = 1, log=print) -> list[dict]:
    """Evaluate the entries at ``indices`` (``select``) with ``jobs`` compiler processes; returns their rows,
    printed through ``log`` (one table per family) in order as they complete."""
    entries = registry.entries()
    if jobs > 1 and len(indices) > 1:
        import multiprocessing

        env_interp = os.environ.pop("TRITON_INTERPRET", None)  # the workers compile; they must not interpret
        try:
            with multiprocessing.get_context("spawn").Pool(min(jobs, len(indices))) as pool:
                results = pool.imap(_evaluate, indices)
                rows = _print(entries, indices, results, log)
        finally:
            if env_interp is not None:
                os.environ["TRITON_INTERPRET"] = env_interp
        return rows
    return _print(entries, indices, (_evaluate(i) for i in indices), log)


MMA_FAMILIES = ("attention", "moe", "muon")  # held against the dense bf16 MMA peak, the rest against copy bandwidth
FP8_FAMILIES = ("fp8",)  # the FP8 GEMMs: against the dense FP8 MMA peak


def _ceiling(family: str) -> str:
    if family in FP8_FAMILIES:
        return "dense FP8 peak"
    return "dense bf16 peak" if family in MMA_FAMILIES else "copy bandwidth"


def _print(entries, indices, results, log) -> list[dict]:
    rows, family = [], None
    for i, r in zip(indices, results):
        e = entries[i]
        if e.family != family:
            family = e.family
            log(f"\n## {family} (sm_{e.arch}; predicted fraction of {_ceiling(family)})")
            log(HEADER)
        rows.append(r)
        log(format_row(r))
    return rows


def payload(rows: list[dict]) -> dict:
    from megakernels.bench.common import git_commit

    return {
        "machine": dataclasses.asdict(model.H200),
        "tools": tools(),
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d"),
        "kernels": rows,
    }
