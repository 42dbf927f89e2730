"""What every benchmark shares: calibrated timing, the machine and commit, the result row, the table, the JSON.

A result row is one measurement of one op at one shape, dtype and pass, every implementation timed one after the
other in this process::

    {"op", "family", "dtype", "shape", "pass", "variant", "size", "size_label", "unit" ("GB/s" | "TFLOP/s"),
     "work" (bytes or FLOPs that must move, counted in the op's module), "times_ms" {impl: ms},
     "rates" {impl: GB/s or TFLOP/s}, "ceiling", "ceiling_name", "fraction_of_ceiling" (ours),
     "speedups" {baseline: its time / ours}, ...family-specific fields}

``"megakernels"`` is always our implementation; the baselines are PyTorch's (``eager``, ``compile``, ...) and the
optional peers (``apex``, ``liger_kernel``, ``flash_attn``). Rates use the same counted work for every
implementation, so a rate ratio is the inverse time ratio.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from megakernels import precisions

OURS = "megakernels"
# The dtypes benchmarks run in, by torch's names (``--dtype`` also takes the precision names: fp32, bf16, fp16).
DTYPES = {name: precisions.dtype_of(name) for name in precisions.DTYPE_NAMES}
DTYPE_ALIASES = {p: name for name, p in precisions.DTYPE_NAMES.items()}


@dataclasses.dataclass(frozen=True)
class Request:
    """What ``megakernels bench`` asks of one op family: every family module's ``run(request) -> rows``.

    ``ops``: the family's ops to measure; ``dtypes``, ``shapes`` (``--shapes``), ``head_dims`` and ``seqlens``
    (attention): None for the family's defaults; ``min_run_time``: seconds of calibrated repeats per measurement;
    ``with_compile``: the torch.compile baselines; ``ceilings``: the device's measured ceilings (``ceilings``);
    ``peers``: the installed peers (``peers.Peers``) whose notes collect what was skipped; ``log``: where the
    table's lines go."""

    ops: tuple[str, ...]
    dtypes: tuple[str, ...] | None = None
    shapes: tuple[tuple[int, ...], ...] | None = None
    head_dims: tuple[int, ...] | None = None
    seqlens: tuple[int, ...] | None = None
    device: str = "cpu"
    quick: bool = False
    min_run_time: float = 0.5
    with_compile: bool = True
    ceilings: dict | None = None
    peers: object = None
    log: Callable = print

    @property
    def notes(self) -> list[str]:
        """The run's notes (the peers'), or a throwaway list without peers."""
        return self.peers.notes if self.peers is not None else []

    def dtypes_or(self, default) -> tuple[str, ...]:
        return tuple(self.dtypes) if self.dtypes else tuple(default)

    def shapes_or(self, default_shapes: Callable[[str, bool], list]) -> list:
        return list(self.shapes) if self.shapes else default_shapes(self.device, self.quick)


def run_measure(measure: Callable, request: Request, default_dtypes, default_shapes, **extra) -> list[dict]:
    """``measure(ops, dtypes, shapes, device=, with_compile=, min_run_time=, ceilings=, peers=, log=)``, the loop of
    the families that time a fused op against its eager and compiled compositions, on ``request`` (the family's
    defaults where it gives none)."""
    return measure(
        list(request.ops),
        request.dtypes_or(default_dtypes),
        request.shapes_or(default_shapes),
        device=request.device,
        with_compile=request.with_compile,
        min_run_time=request.min_run_time,
        ceilings=request.ceilings,
        peers=request.peers,
        log=request.log,
        **extra,
    )


def _torch_benchmark():
    """``torch.utils.benchmark``, imported on first use: it imports ``torch.utils.cpp_extension``, which warns about
    a missing CUDA runtime on machines without a GPU (irrelevant to timing), so that logger is quietened first."""
    import logging

    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    import torch.utils.benchmark as tb

    return tb


def median_seconds(fn: Callable[[], None], min_run_time: float) -> float:
    """Median seconds per call of ``fn`` over calibrated blocks of calls (CUDA work is synchronised)."""
    fn()  # warm-up (and compile, for torch.compile variants)
    tb = _torch_benchmark()
    return (
        tb.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
        .blocked_autorange(min_run_time=min_run_time)
        .median
    )


def time_impls(steps: dict[str, Callable[[], None]], min_run_time: float) -> dict[str, float]:
    """Seconds per call of each zero-argument step, measured one after the other in this process."""
    return {name: median_seconds(fn, min_run_time) for name, fn in steps.items()}


def timed_in_turns(fns: dict[str, Callable[[], None]], reps: int, over_ranks: bool = False) -> dict[str, float]:
    """Median over ``reps`` steps of the seconds per step of each of ``fns``; the callables take turns step by step,
    so drift of the machine (other jobs, a long step's thermal or memory state) affects them alike (a warm-up step of
    each first). ``over_ranks``: inside a process group, every rank runs the same fixed number of steps (a
    calibrated repeat count could differ between ranks and deadlock the collectives), each step starts at a
    barrier and counts the slowest rank's time."""
    import statistics

    import torch.distributed as dist

    for fn in fns.values():
        fn()
    times = torch.zeros(len(fns), reps, dtype=torch.float64)
    for i in range(reps):
        for j, fn in enumerate(fns.values()):
            if over_ranks:
                dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[j, i] = time.perf_counter() - t0
    if over_ranks:
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {name: statistics.median(times[j].tolist()) for j, name in enumerate(fns)}


def timed_over_ranks(fns: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    """:func:`timed_in_turns` inside a process group (the slowest rank's seconds per step)."""
    return timed_in_turns(fns, reps, over_ranks=True)


def git_commit() -> str:
    """The short commit of the checkout this package runs from ("" when installed outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def machine(device: str = "cpu") -> dict:
    """The machine of a results file: the CPU's model and instruction-set flags (``megakernels.host.cpu``), the
    instruction set the CPU kernels run (``megakernels.cpu_isa``), torch threads and version, git commit, date,
    device (and GPU name), and the fp32 CPU GEMM route the package's layers take with the measurement that chose it
    (``megakernels.ops.gemm.describe``)."""
    from megakernels import cpu_isa
    from megakernels import host as this
    from megakernels.ops import gemm

    cpu = this.cpu()
    info = {
        "cpu": cpu["model"],
        "cpu_flags": cpu["flags"],
        "cpu_isa": cpu_isa(),
        "cpu_gemm": gemm.describe(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d"),
        "device": device,
        "python": platform.python_version(),
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def machine_line(info: dict) -> str:
    where = info.get("gpu", f"{info['cpu']}, {info['threads']} threads")
    line = f"# {where}, torch {info['torch']}, commit {info['commit'] or 'unknown'}"
    if "gpu" not in info and info.get("cpu_isa"):
        line += f"; CPU kernels {info['cpu_isa']}"
    route = info.get("cpu_gemm")
    if route and "gpu" not in info:
        line += f"; fp32 GEMM route {route['route']} ({route['source']})"
    return line


# ---- arguments -------------------------------------------------------------------------------------------------


def split_list(flag: str, value: str, choices, aliases: dict | None = None) -> list[str]:
    """A comma list from ``flag``, aliases resolved, duplicates dropped.

    Raises:
        ValueError: an unknown item (the message names the flag and the valid choices) or an empty list.
    """
    aliases = aliases or {}
    items = []
    for v in (v.strip() for v in value.split(",")):
        if not v:
            continue
        v = aliases.get(v, v)
        if v not in choices:
            raise ValueError(f"{flag}: unknown value {v!r}; choose from {', '.join(choices)}")
        if v not in items:
            items.append(v)
    if not items:
        raise ValueError(f"{flag}: expected a comma list of {', '.join(choices)}, got {value!r}")
    return items


def parse_choices(parser, flag: str, value: str, choices) -> list[str]:
    """``split_list`` for an argparse parser: an unknown item is a usage error (exit status 2)."""
    try:
        return split_list(flag, value, choices, DTYPE_ALIASES if flag == "--dtype" else None)
    except ValueError as e:
        parser.error(str(e))


def parse_shapes(parser, value: str, dims: str) -> list[tuple[int, ...]]:
    """``--shapes`` as ``a,b;a,b...`` with one positive int per name in ``dims`` (e.g. ``"rows,hidden"``); any
    other value is a usage error naming the flag and the expected form."""
    n = len(dims.split(","))
    try:
        shapes = [tuple(int(v) for v in s.split(",")) for s in value.split(";") if s]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != n or min(s) < 1 for s in shapes):
        parser.error(f"--shapes: expected {dims}[;{dims}...] with positive sizes, got {value!r}")
    return shapes


def start(parser, device: str) -> dict:
    """Refuses ``--device cuda`` without a GPU, prints the machine line, returns the machine info."""
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device available")
    info = machine(device)
    print(machine_line(info))
    return info


# ---- rows and tables -------------------------------------------------------------------------------------------


def result_row(
    op: str,
    family: str,
    *,
    dtype: str,
    shape: str,
    pass_: str,
    size: float,
    size_label: str,
    unit: str,
    work: float,
    times: dict[str, float],
    ceiling: float | None,
    ceiling_name: str,
    variant: str = "",
    **extra,
) -> dict:
    """One result row (see the module docstring) from seconds per call of each implementation."""
    scale = 1e9 if unit == "GB/s" else 1e12
    ours = times[OURS]
    rate = work / ours / scale
    return {
        "op": op,
        "family": family,
        "dtype": dtype,
        "shape": shape,
        "pass": pass_,
        "variant": variant,
        "size": size,
        "size_label": size_label,
        "unit": unit,
        "work": work,
        "times_ms": {k: v * 1e3 for k, v in times.items()},
        "rates": {k: work / v / scale for k, v in times.items()},
        "ceiling": ceiling,
        "ceiling_name": ceiling_name,
        "fraction_of_ceiling": rate / ceiling if ceiling else None,
        "speedups": {k: v / ours for k, v in times.items() if k != OURS},
        **extra,
    }


class TablePrinter:
    """Prints rows as they are measured: a header whenever a new op starts (its columns from that op's first
    row: the baselines it was compared with and any ``extra_columns``), then one line per row."""

    def __init__(self, log: Callable[[str], None] = print):
        self.log, self.op, self.baselines, self.extras, self.variant = log, None, [], [], False

    def __call__(self, row: dict) -> None:
        if row["op"] != self.op:
            self.op = row["op"]
            self.baselines = list(row["speedups"])
            self.extras = list(row.get("extra_columns", {}))
            self.variant = bool(row.get("variant"))
            ceil = f"{row['ceiling_name']}" if row.get("ceiling_name") else "no ceiling"
            self.log(f"\n## {row['op']} ({row['unit']}; % of the measured {ceil})")
            self.log(
                self._line(
                    "dtype",
                    "shape",
                    "pass",
                    "variant",
                    "ms",
                    row["unit"],
                    "% ceil",
                    [f"vs {b}" for b in self.baselines],
                    self.extras,
                )
            )
        pct = row.get("fraction_of_ceiling")
        self.log(
            self._line(
                row["dtype"],
                row["shape"],
                row["pass"],
                row.get("variant", ""),
                f"{row['times_ms'][OURS]:.3f}",
                f"{row['rates'][OURS]:.3g}",
                f"{100 * pct:.0f}%" if pct is not None else "-",
                [f"{row['speedups'][b]:.2f}x" if b in row["speedups"] else "-" for b in self.baselines],
                [_fmt(row.get("extra_columns", {}).get(e)) for e in self.extras],
            )
        )

    def _line(self, dtype, shape, pass_, variant, ms, rate, pct, vs, extras) -> str:
        variant = f"{variant:<14}" if self.variant else ""
        vs_w = [max(12, len(b) + 5) for b in self.baselines]  # "vs " + name + a space
        ex_w = [max(10, len(e) + 2) for e in self.extras]
        return (
            f"{dtype:<10}{shape:<20}{pass_:<9}{variant}{ms:>10}{rate:>10}{pct:>8}"
            + "".join(f"{v:>{w}}" for v, w in zip(vs, vs_w))
            + "".join(f"{v:>{w}}" for v, w in zip(extras, ex_w))
        )


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def write_json(out_dir: str | None, name: str, payload: dict) -> str | None:
    """``out_dir/name`` as indented JSON when an output directory was given; returns the path."""
    if not out_dir:
        return None
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    return path


# ---- peak resident memory of one step, each in a fresh process (the CPU benchmarks' method) ---------------------


def proc_status_bytes(key: str) -> int:
    """A size field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...) in bytes.

    Raises:
        RuntimeError: no such field.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def reset_peak_rss() -> int:
    """Reset this process's peak resident memory (``VmHWM``) to the current one; returns that (bytes)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return proc_status_bytes("VmRSS")


def run_point(module: str, spec: dict, cwd: str) -> dict:
    """``python -m module --point JSON(spec)`` in a fresh process (from ``cwd``): the JSON object its last line
    prints, or ``{"error": the end of its stderr}`` when it fails."""
    r = subprocess.run(
        [sys.executable, "-m", module, "--point", json.dumps(spec)], cwd=cwd, capture_output=True, text=True
    )
    if r.returncode != 0:
        return {"error": r.stderr[-800:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---- pytest-benchmark suites -----------------------------------------------------------------------------------

IMPLS = ["fused", "eager", "compile"]
_compiled: dict = {}


def parametrize_shapes(metafunc, quick: list, full: list) -> None:
    """A suite's ``pytest_generate_tests``: its ``shape`` argument over ``quick`` under --benchmark-disable (the CI
    check that everything runs), else over ``full``; ids like 4096x1024."""
    if "shape" in metafunc.fixturenames:
        shapes = quick if metafunc.config.getoption("benchmark_disable") else full
        metafunc.parametrize("shape", shapes, ids=lambda s: "x".join(map(str, s)))


def implementation(comp, impl: str) -> Callable:
    """The callable for ``impl`` of a composition with ``fused``/``eager`` members (``compile``: torch.compile of
    the eager one, compiled once per composition)."""
    if impl == "compile":
        if comp.eager not in _compiled:
            _compiled[comp.eager] = torch.compile(comp.eager, dynamic=False)
        return _compiled[comp.eager]
    return getattr(comp, impl)
