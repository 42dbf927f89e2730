"""Helpers shared by the benchmark scripts: calibrated timing and a description of the machine and commit."""

from __future__ import annotations

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
