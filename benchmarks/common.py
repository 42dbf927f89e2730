"""Helpers shared by the benchmark scripts: calibrated timing and a description of the machine and commit."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from collections.abc import Callable

import torch
import torch.utils.benchmark as tb


def median_seconds(fn: Callable[[], None], min_run_time: float) -> float:
    """Median seconds per call of ``fn`` over calibrated blocks of calls (CUDA work is synchronised)."""
    fn()  # warm-up (and compile, for torch.compile variants)
    return tb.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()).blocked_autorange(
        min_run_time=min_run_time).median


def machine(device: str = "cpu") -> dict:
    """CPU name, torch threads and version, git commit, date, device (and GPU name) for a results file."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        commit = ""
    info = {"cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__, "commit": commit,
            "date": time.strftime("%Y-%m-%d"), "device": device}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


# ---- fused vs eager vs torch.compile comparisons (norms, softmax) ----------------------------------------------

def time_fused_eager_compile(make_step: Callable[[Callable], Callable[[], None]], fused: Callable, eager: Callable,
                             with_compile: bool, min_run_time: float) -> dict:
    """Seconds per call of the fused op, the eager composition and (optionally) torch.compile of it, measured one
    after the other in this process. ``make_step(fn)`` turns an implementation into a zero-argument step."""
    t = {"fused": median_seconds(make_step(fused), min_run_time),
         "eager": median_seconds(make_step(eager), min_run_time)}
    if with_compile:
        torch._dynamo.reset()
        t["compile"] = median_seconds(make_step(torch.compile(eager, dynamic=False)), min_run_time)
    return t


def comparison_fields(t: dict, nbytes: int) -> dict:
    """Result columns from ``time_fused_eager_compile``: times in ms, the fused op's GB/s, speed-ups."""
    return {
        "fused_ms": t["fused"] * 1e3, "eager_ms": t["eager"] * 1e3,
        "compile_ms": t["compile"] * 1e3 if "compile" in t else None,
        "fused_GBps": nbytes / t["fused"] / 1e9,
        "speedup_vs_eager": t["eager"] / t["fused"],
        "speedup_vs_compile": t["compile"] / t["fused"] if "compile" in t else None,
    }


def comparison_header(op_width: int, shape_width: int) -> str:
    return (f"{'op':<{op_width}}{'dtype':<10}{'shape':<{shape_width}}{'pass':<9}{'fused ms':>10}{'eager ms':>10}"
            f"{'compile ms':>11}{'GB/s':>8}{'vs eager':>10}{'vs compile':>11}")


def format_comparison(r: dict, shape: str, op_width: int, shape_width: int) -> str:
    comp = f"{r['compile_ms']:>11.3f}" if r["compile_ms"] is not None else f"{'-':>11}"
    vs_c = f"{r['speedup_vs_compile']:>10.2f}x" if r["speedup_vs_compile"] is not None else f"{'-':>11}"
    return (f"{r['op']:<{op_width}}{r['dtype']:<10}{shape:<{shape_width}}{r['pass']:<9}"
            f"{r['fused_ms']:>10.3f}{r['eager_ms']:>10.3f}{comp}{r['fused_GBps']:>8.1f}"
            f"{r['speedup_vs_eager']:>9.2f}x{vs_c}")


# ---- command lines ---------------------------------------------------------------------------------------------

def parse_choices(parser, flag: str, value: str, choices) -> list[str]:
    """A comma list from ``flag``; an unknown item is a usage error naming the flag and the valid choices."""
    items = [v for v in value.split(",") if v]
    for v in items:
        if v not in choices:
            parser.error(f"{flag}: unknown value {v!r}; choose from {', '.join(choices)}")
    return items


def start(parser, device: str) -> dict:
    """Refuses ``--device cuda`` without a GPU, prints the machine line, returns the machine info."""
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device available")
    info = machine(device)
    where = info.get("gpu", f"{info['cpu']}, {info['threads']} threads")
    print(f"# {where}, torch {info['torch']}, commit {info['commit']}")
    return info


def write_results(out_dir: str | None, name: str, info: dict, rows: list) -> None:
    """``out_dir/name`` as JSON ({machine, results}) when an output directory was given."""
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump({"machine": info, "results": rows}, f, indent=1)


# ---- pytest-benchmark suites -----------------------------------------------------------------------------------

IMPLS = ["fused", "eager", "compile"]
_compiled: dict = {}


def implementation(comp, impl: str) -> Callable:
    """The callable for ``impl`` of a composition with ``fused``/``eager`` members (``compile``: torch.compile of
    the eager one, compiled once per composition)."""
    if impl == "compile":
        if comp.eager not in _compiled:
            _compiled[comp.eager] = torch.compile(comp.eager, dynamic=False)
        return _compiled[comp.eager]
    return getattr(comp, impl)
