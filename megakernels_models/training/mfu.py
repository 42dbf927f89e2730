"""Model FLOPs utilisation: the device's peak dense TFLOP/s that MFU divides by.

- ``--peak-tflops`` when given;
- a GPU: the vendor's dense peak for the training precision (a table; unknown GPUs give NaN, MFU is then not
  reported);
- the CPU: measured, because a CPU's peak depends on its cores, vector units and the threads a rank gets. A square
  GEMM of 1024-2048 (large enough that packing and threading overheads are small against the arithmetic) is timed
  on this process's threads, best of several trials (a busy machine can only lower a trial), and the result is
  cached per machine, thread count and dtype in the cache folder, so every run on this machine divides by the same
  number. The model FLOPs of a step cannot exceed what the machine executes (they count causal attention as the
  full square, a slight overcount at most), so MFU stays below 100 %: should a step ever run faster than the
  cached peak (the peak was measured on a loaded machine), the peak is raised to that rate and the cache updated.
"""

from __future__ import annotations

import json
import math
import os

import torch

from megakernels import machines, precisions


def _cache_path() -> str:
    from megakernels.host import cache_dir

    return os.path.join(cache_dir(), "cpu_peak_tflops.json")


def _load_cache() -> dict:
    try:
        with open(_cache_path()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _store(key: str, value: float) -> None:
    path = _cache_path()
    cache = _load_cache()
    cache[key] = value
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(cache, f, indent=1)
    os.replace(tmp, path)  # concurrent writers: the last complete file wins, never a torn one


def _key(dtype: torch.dtype, threads: int) -> str:
    # "gemm=best": measured as the faster of PyTorch's BLAS and megakernels.ops.gemm; the CPU with its flags'
    # digest (megakernels.host.cpu_key): keys of another form are stale
    from megakernels.host import cpu_key

    return f"{cpu_key()}|threads={threads}|gemm=best|{str(dtype).replace('torch.', '')}"


def measure_cpu_tflops(dtype: torch.dtype = torch.float32, n: int | None = None, trials: int = 5) -> float:
    """Best-of-``trials`` TFLOP/s of an ``n × n`` matmul on this process's threads (not cached): PyTorch's ``@``
    or ``megakernels.ops.gemm.mm`` (oneDNN for fp32, which the package's layers use), whichever is faster
    (``megakernels.bench.ceilings.gemm_tflops``, the one GEMM ceiling measurement)."""
    from megakernels.bench import ceilings

    if n is None:
        n = 2048 if dtype == torch.float32 else 1024  # 16-bit CPU GEMMs are slower: keep the timing short
    return ceilings.gemm_tflops("cpu", str(dtype).removeprefix("torch."), n, best_of=trials)


def cpu_peak_tflops(dtype: torch.dtype = torch.float32) -> float:
    """The cached CPU peak for ``dtype`` on this process's thread count (measured on first use)."""
    key = _key(dtype, torch.get_num_threads())
    cached = _load_cache().get(key)
    if isinstance(cached, (int, float)) and cached > 0:
        return float(cached)
    peak = measure_cpu_tflops(dtype)
    _store(key, peak)
    return peak


def raise_cpu_peak(dtype: torch.dtype, achieved: float) -> None:
    """Record that this machine reached ``achieved`` TFLOP/s (the cached peak was too low)."""
    key = _key(dtype, torch.get_num_threads())
    if achieved > float(_load_cache().get(key, 0.0)):
        _store(key, achieved)


def device_peak_tflops(precision: str, device: torch.device, given: float | None = None) -> tuple[float, str]:
    """``(peak TFLOP/s, where it comes from: "given" | "table" | "measured")`` of one device in ``precision``
    (``"fp32"``, ``"bf16"``, ``"fp16"``, or ``"fp8"``: MFU of FP8 training is counted against the 16-bit peak, as
    published FP8 results count it)."""
    precision = "bf16" if precision == "fp8" else precision
    if given:
        return float(given), "given"
    half = precision != "fp32"
    if device.type == "cuda":
        gpu = machines.gpu_named(torch.cuda.get_device_name(device), exact=False)
        return (gpu.peak_flops("bf16" if half else "fp32") / 1e12 if gpu else math.nan), "table"
    dtype = precisions.dtype_of(precision)
    return cpu_peak_tflops(dtype), "measured"


class MFUMeter:
    """Per-step throughput of the logging rank: tokens/s, model TFLOP/s per device and MFU (see the module
    docstring; MFU never exceeds 1 against a measured CPU peak)."""

    def __init__(
        self,
        flops_per_token: float,
        tokens_per_step: int,
        world: int,
        precision: str,
        device: torch.device,
        given: float | None = None,
    ):
        self.flops_per_token, self.tokens_per_step, self.world = flops_per_token, tokens_per_step, world
        self.peak, self.source = device_peak_tflops(precision, device, given)
        precision = "bf16" if precision == "fp8" else precision
        self._dtype = precisions.dtype_of(precision)

    def measure(self, seconds: float) -> dict:
        tps = self.tokens_per_step / seconds
        tflops = self.flops_per_token * tps / self.world / 1e12
        if self.source == "measured" and tflops > self.peak:
            self.peak = tflops
            raise_cpu_peak(self._dtype, tflops)
        return {"tokens_per_s": tps, "tflops_per_device": tflops, "mfu": tflops / self.peak}
