"""The device's ceilings, measured on the spot so that "% of ceiling" is honest on any machine (a CPU included).

- Copy bandwidth: ``dst.copy_(src)`` on fp32 tensors far larger than the last-level cache (256 MiB each on the
  CPU, 1 GiB on a GPU; 64 MiB in quick mode, still twice this VM's L3), counted as bytes read + bytes written per
  second: the ceiling of the streaming kernels (norms, softmax, AdamW, cross-entropy). On a CPU with
  write-allocate caches a copy really moves 3 bytes per 2 counted (the destination line is read before it is
  written), so kernels that update in place (AdamW, ``add_``) can show more than 100% of it there.
- GEMM FLOP/s per dtype: ``a @ b`` on square ``n x n`` matrices (2048 on the CPU, 8192 on a GPU, 512 quick),
  ``2 n^3`` FLOPs per product. fp32 on a GPU is measured as torch is configured (TF32 off by default, so plain
  fp32). On the CPU the faster of ``torch.mm`` and ``megakernels.ops.gemm.mm`` where the package's fp32 layers
  take oneDNN (``gemm.route()``: measured on this machine). FlashAttention's ceiling is the GEMM rate in its dtype.

Both are medians of calibrated repeats (``common.median_seconds``), so a busy machine lowers them as it lowers the
kernels measured beside them.
"""

from __future__ import annotations

import math
import time

import torch

from megakernels.bench.common import DTYPES, median_seconds
from megakernels.ops import gemm


def copy_bandwidth(device: str = "cpu", numel: int | None = None, min_run_time: float = 0.5) -> float:
    """GB/s read + written by ``dst.copy_(src)`` on fp32 tensors of ``numel`` elements (default: past the caches)."""
    if numel is None:
        numel = 1 << 28 if device == "cuda" else 1 << 26
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), min_run_time)
    return 2 * numel * src.element_size() / seconds / 1e9


def gemm_tflops(
    device: str = "cpu",
    dtype: str = "float32",
    n: int | None = None,
    min_run_time: float = 0.5,
    best_of: int | None = None,
) -> float:
    """TFLOP/s of an ``n x n`` by ``n x n`` matmul in ``dtype`` (a name of ``common.DTYPES``): the median of
    calibrated blocks of calls, or with ``best_of`` the fastest of that many single calls after a warm-up (a
    peak: a busy machine can only slow a call down). The one measurement of a GEMM ceiling; the trainer's CPU peak
    (``megakernels_models.training.mfu``) is this with ``best_of``.

    Raises:
        ValueError: an unknown ``dtype`` name, or ``best_of`` below 1.
    """
    if dtype not in DTYPES:
        raise ValueError(f"gemm_tflops: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if best_of is not None and best_of < 1:
        raise ValueError(f"gemm_tflops: best_of must be at least 1, got {best_of}")
    if n is None:
        n = 8192 if device == "cuda" else 2048
    g = torch.Generator(device=device).manual_seed(0)  # never the default generator: callers' streams stay as they are
    a = torch.randn(n, n, generator=g, device=device).to(DTYPES[dtype])
    b = torch.randn(n, n, generator=g, device=device).to(DTYPES[dtype])
    out = torch.empty(n, n, device=device, dtype=DTYPES[dtype])
    products = [lambda: torch.mm(a, b, out=out)]
    if gemm.routed(a, b, n, n, n):  # the faster of PyTorch's BLAS and the oneDNN GEMM our layers use
        products.append(lambda: gemm.mm(a, b))
    seconds = min(median_seconds(p, min_run_time) if best_of is None else _best_seconds(p, best_of) for p in products)
    return 2.0 * n**3 / seconds / 1e12


def _best_seconds(fn, calls: int) -> float:
    fn()  # warm-up (thread pool, packing buffers)
    best = math.inf
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(device: str = "cpu", dtypes=("float32",), quick: bool = False, log=print) -> dict:
    """Copy bandwidth and the GEMM rate of each dtype in ``dtypes`` on ``device``.

    Returns:
        ``{"device", "copy_GBps", "copy_bytes" (of one tensor), "gemm_TFLOPs": {dtype: rate}, "gemm_n"}``.
    """
    numel = (1 << 24) if quick else (1 << 28 if device == "cuda" else 1 << 26)
    n = 512 if quick else (8192 if device == "cuda" else 2048)
    t = 0.1 if quick else 0.5
    out = {
        "device": device,
        "copy_GBps": copy_bandwidth(device, numel, t),
        "copy_bytes": numel * 4,
        "gemm_TFLOPs": {d: gemm_tflops(device, d, n, t) for d in dtypes},
        "gemm_n": n,
    }
    log(
        f"# ceilings on {device}: copy {out['copy_GBps']:.1f} GB/s ({numel * 4 >> 20} MiB tensors); GEMM n={n}: "
        + ", ".join(f"{d} {v:.3g} TFLOP/s" for d, v in out["gemm_TFLOPs"].items())
    )
    return out


def for_unit(ceilings: dict | None, unit: str, dtype: str) -> tuple[float | None, str]:
    """(value, name) of the ceiling a row in ``unit`` is held against: copy bandwidth for GB/s, the GEMM rate of
    ``dtype`` for TFLOP/s; (None, "") when it was not measured."""
    if not ceilings:
        return None, ""
    if unit == "GB/s":
        return ceilings.get("copy_GBps"), "copy bandwidth"
    rate = ceilings.get("gemm_TFLOPs", {}).get(dtype)
    return rate, f"{dtype} GEMM rate"
