"""The tensor-core time of an extern GEMM (a PyTorch ``mm``/``addmm``/``bmm``/``matmul`` that cuBLAS runs) on a
``model.Machine``: its output cut into tiles, the tiles (times a split of K) run in waves over the SMs, each tile
at ``mma_sustained`` of the dtype's per-SM peak.

- Tiles: cuBLAS's tensor-core kernels compute 256x128, 128x256 or 128x128 output tiles (its most efficient; it
  also has 256x64, 64x256, 128x64, 64x128 and 64x64 ones, less efficient) and pick one by heuristic: NVIDIA,
  "Matrix Multiplication Background User's Guide" (docs.nvidia.com/deeplearning/performance/
  dl-performance-matrix-multiplication), sections "Tile quantization" and "Wave quantization". The model takes
  the fastest of the three large tiles, each at the same per-SM rate (no per-tile efficiency is published).
- Tile quantization: a tile computes all of its ``tm x tn`` outputs, those past M or N included (same guide).
- Wave quantization: one tile per SM at a time (a 128x256 Hopper tile uses the SM's whole tensor-core rate), so
  ``units`` work units take ``ceil(units / sms)`` waves (same guide; its example: 108 SMs on an A100).
- Split-K: when the tiles leave SMs idle, K is split (cuBLAS's split-K, CUTLASS's split-K/stream-K schedulers:
  github.com/NVIDIA/cutlass, media/docs/efficient_gemm.md, "Parallelized Reductions"); each split writes fp32
  partial tiles that a reduction reads back: ``2 x splits x M x N x 4`` bytes, from L2 when they fit in it, else
  DRAM. Splits are powers of two while each keeps at least ``MIN_SPLIT_K`` of K.
- ``mma_sustained`` is the fraction of peak the best large square bf16 GEMM reaches (the MAMF table,
  ``model._HOPPER_SRC``): the per-tile rate; the shape's losses are the quantizations above, on top of it. A
  published sm_90 cuBLAS shape sweep agrees on the large shapes: XLA's ``matmul_interpolator_data.h``
  (github.com/openxla/xla, xla/service/gpu/model/, "sm_90", bf16xbf16->bf16) measures 4096^3 at 783 TFLOP/s,
  1024x4096x4096 at 738 and 4096x2048x4096 at 758 (0.75-0.80 of 989, kernel overhead included); over 47 of its
  entries of 0.5-275 GFLOP this rule's time is 0.93 of the measured at the median (the flat rule 0.90), the gap
  on the smallest being the kernel's fixed cost, which the peer model adds as ``launch_s``
  (costmodel/README.md).
- FP32 operands run on the CUDA cores, not TF32 tensor cores: PyTorch's default ``float32_matmul_precision`` is
  "highest" (``torch.backends.cuda.matmul.allow_tf32`` False since 1.12; docs.pytorch.org, notes/cuda.html,
  "TensorFloat-32 (TF32) on Ampere (and later) devices"), so an fp32 GEMM is priced at ``Machine.fp32_simt`` (the
  datasheet's FP32 rate) x ``mma_sustained``. The PyTorch note's own A100 example: 10240^3 in fp32 takes 0.11 s,
  19.5 TFLOP/s, the A100's FP32 peak.
"""

from __future__ import annotations

import math

# cuBLAS's most efficient tensor-core output tiles (the NVIDIA guide above)
TILES = ((128, 256), (256, 128), (128, 128))
MIN_SPLIT_K = 256  # each K split keeps at least this much of K (assumption: four 64-deep k-steps of a Hopper tile)
ACC_BYTES = 4  # fp32 partial outputs of a split-K


def peak(m, dtype) -> float:
    """The dense FLOP/s a GEMM with operands of ``dtype`` runs at on ``m`` (before ``mma_sustained``)."""
    import torch

    if dtype == torch.float32:
        return m.fp32_simt  # PyTorch's default: no TF32 (module docstring)
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and m.mma_dense_fp8:
        return m.mma_dense_fp8
    return m.mma_dense_bf16


def dims(a: tuple, b: tuple) -> tuple[int, int, int, int]:
    """(batch, M, N, K) of a matmul of operands shaped ``a`` [..., M, K] and ``b`` [..., K, N] (``b`` 2-D: the
    leading dimensions of ``a`` fold into M, as ATen's matmul does)."""
    k, n = a[-1], b[-1]
    if len(b) == 2:
        return 1, math.prod(a[:-1]), n, k
    return math.prod(a[:-2]), a[-2], n, k


def gemm_time(m, batch: int, rows: int, cols: int, depth: int, dtype) -> dict:
    """Seconds the tensor cores (CUDA cores for fp32) take for ``batch`` GEMMs of [rows, depth] x [depth, cols]
    on ``m``, and the schedule that gives it: tile, K splits, waves, the split-K reduction's bytes."""
    rate = peak(m, dtype) * m.mma_sustained / m.sms  # FLOP/s per SM
    best = None
    for tm, tn in TILES:
        tiles = batch * math.ceil(rows / tm) * math.ceil(cols / tn)
        splits = 1
        while True:
            waves = math.ceil(tiles * splits / m.sms)
            t = waves * 2.0 * tm * tn * math.ceil(depth / splits) / rate
            red = 2.0 * splits * batch * rows * cols * ACC_BYTES if splits > 1 else 0.0
            t += red / (m.l2_bw if red <= m.l2_bytes else m.dram_copy)
            if best is None or t < best["time_s"]:
                best = {"time_s": t, "tile": f"{tm}x{tn}", "splits": splits, "waves": waves, "split_bytes": red}
            if tiles * splits >= m.sms or depth / (2 * splits) < MIN_SPLIT_K:
                break
            splits *= 2
    flops = 2.0 * batch * rows * cols * depth
    best["efficiency"] = flops / (best["time_s"] * peak(m, dtype))  # of the dtype's peak
    return best
