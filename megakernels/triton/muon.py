"""Muon's Newton-Schulz iteration on the GPU: per iteration two launches of a symmetric-product kernel and one of a
GEMM, batched over same-shaped matrices (grid axis 1 or 2: the matrix).

For a batch of X ``[m, n]`` (m <= n; the caller transposes tall matrices)::

    A = X Xᵀ             _sym_kernel(Y=X):           only the tiles (i, j) with j <= i; each also stored transposed
    B = c A A + b A      _sym_kernel(Y=A, Z=A):      A A = A Aᵀ (A is symmetric): the same kernel, b A its epilogue
    X = B X + a X        _update_kernel:             a GEMM with a X as its epilogue, into the other X buffer

A symmetric product runs one program per tile of the lower triangle, ``T (T + 1) / 2`` for T tiles a side instead
of ``T²``: about half the FLOPs of the full product. Accumulation is fp32 (bf16/fp16 operands on the tensor cores;
fp32 operands as IEEE fp32 products, not TF32: the fp32 option is for accuracy); results are stored in X's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megakernels.triton._common import arch_of
from megakernels.triton.launch import Launch


@triton.jit
def _sym_kernel(
    Y,
    Z,
    OUT,
    m,
    k_dim,
    stride_yb,
    stride_ym,
    stride_zb,
    stride_zm,
    stride_ob,
    stride_om,
    alpha,
    beta,
    HAS_Z: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    # the lower-triangle tile (ti, tj), tj <= ti, of program t: t = ti (ti + 1) / 2 + tj
    ti = ((tl.sqrt(8.0 * t.to(tl.float32) + 1.0) - 1.0) * 0.5).to(tl.int32)
    ti = tl.where((ti + 1) * (ti + 2) // 2 <= t, ti + 1, ti)
    ti = tl.where(ti * (ti + 1) // 2 > t, ti - 1, ti)
    tj = t - ti * (ti + 1) // 2
    rows_i = ti * BLOCK + tl.arange(0, BLOCK)
    rows_j = tj * BLOCK + tl.arange(0, BLOCK)
    ks = tl.arange(0, BLOCK_K)
    Y += b * stride_yb
    acc = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
    for k0 in tl.range(0, k_dim, BLOCK_K, num_stages=STAGES):
        kmask = (k0 + ks)[None, :] < k_dim
        a = tl.load(Y + rows_i[:, None] * stride_ym + (k0 + ks)[None, :], mask=(rows_i[:, None] < m) & kmask, other=0.0)
        c = tl.load(Y + rows_j[:, None] * stride_ym + (k0 + ks)[None, :], mask=(rows_j[:, None] < m) & kmask, other=0.0)
        if IEEE:
            acc = tl.dot(a, tl.trans(c), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(c), acc)
    out = acc * alpha
    inside = (rows_i[:, None] < m) & (rows_j[None, :] < m)
    if HAS_Z:
        z = tl.load(Z + b * stride_zb + rows_i[:, None] * stride_zm + rows_j[None, :], mask=inside, other=0.0)
        out += beta * z.to(tl.float32)
    out = out.to(OUT.dtype.element_ty)
    OUT += b * stride_ob
    tl.store(OUT + rows_i[:, None] * stride_om + rows_j[None, :], out, mask=inside)
    if ti != tj:  # the mirror tile (Z symmetric too: its (j, i) tile is this one's transpose)
        inside_t = (rows_j[:, None] < m) & (rows_i[None, :] < m)
        tl.store(OUT + rows_j[:, None] * stride_om + rows_i[None, :], tl.trans(out), mask=inside_t)


@triton.jit
def _update_kernel(
    B,
    X,
    OUT,
    m,
    n,
    stride_bb,
    stride_bm,
    stride_xb,
    stride_xm,
    stride_ob,
    stride_om,
    a_coef,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    B += b * stride_bb
    X += b * stride_xb
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, m, BLOCK_K, num_stages=STAGES):
        k = k0 + ks
        p = tl.load(B + rows[:, None] * stride_bm + k[None, :], mask=(rows[:, None] < m) & (k[None, :] < m), other=0.0)
        q = tl.load(X + k[:, None] * stride_xm + cols[None, :], mask=(k[:, None] < m) & (cols[None, :] < n), other=0.0)
        if IEEE:
            acc = tl.dot(p, q, acc, input_precision="ieee")
        else:
            acc = tl.dot(p, q, acc)
    inside = (rows[:, None] < m) & (cols[None, :] < n)
    x = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=inside, other=0.0)
    out = acc + a_coef * x.to(tl.float32)
    tl.store(OUT + b * stride_ob + rows[:, None] * stride_om + cols[None, :], out.to(OUT.dtype.element_ty), mask=inside)


# (BLOCK, BLOCK_K, warps, stages) of the symmetric kernel and (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the
# GEMM, per operand width: for the 16-bit tensor cores (wgmma) 128 x 128 symmetric tiles (square: each is stored
# twice) and 128 x 256 GEMM tiles (the static model on sm_90: 62 % of the peak against 51 % at 128 x 128, whose
# loads bound it by L2; no spills at 246 registers); 64-wide IEEE fp32 tiles (CUDA cores: a smaller accumulator per
# thread); 16 under the interpreter (so small test shapes take several tiles).
CONFIGS = {
    "16bit": ((128, 64, 8, 3), (128, 256, 64, 8, 3)),
    "fp32": ((64, 32, 4, 2), (64, 64, 32, 4, 2)),
    "interpreter": ((16, 16, 4, 1), (16, 16, 16, 4, 1)),
}


def _configs(dtype: torch.dtype, arch: int):
    if arch == 0:
        return CONFIGS["interpreter"]
    return CONFIGS["fp32" if dtype == torch.float32 else "16bit"]


def sym_launch(y, z, out, alpha: float, beta: float, arch: int) -> Launch:
    """``out = alpha * y yᵀ (+ beta * z)`` for a batch ``y`` ``[batch, m, k]`` (``z``, ``out`` ``[batch, m, m]``,
    ``z`` symmetric), the lower-triangle tiles only."""
    batch, m, k = y.shape
    block, block_k, warps, stages = _configs(y.dtype, arch)[0]
    tiles = triton.cdiv(m, block)
    zz = z if z is not None else out
    return Launch(
        _sym_kernel,
        (tiles * (tiles + 1) // 2, batch),
        (y, zz, out, m, k, y.stride(0), y.stride(1), zz.stride(0), zz.stride(1), out.stride(0), out.stride(1))
        + (float(alpha), float(beta)),
        dict(
            HAS_Z=z is not None,
            IEEE=y.dtype == torch.float32,
            BLOCK=block,
            BLOCK_K=block_k,
            STAGES=stages,
            num_warps=warps,
            num_stages=stages,
        ),
    )


def update_launch(b, x, out, a_coef: float, arch: int) -> Launch:
    """``out = b x + a_coef * x`` for batches ``b`` ``[batch, m, m]``, ``x`` and ``out`` ``[batch, m, n]``."""
    batch, m, n = x.shape
    bm, bn, bk, warps, stages = _configs(x.dtype, arch)[1]
    return Launch(
        _update_kernel,
        (triton.cdiv(m, bm), triton.cdiv(n, bn), batch),
        (b, x, out, m, n, b.stride(0), b.stride(1), x.stride(0), x.stride(1), out.stride(0), out.stride(1))
        + (float(a_coef),),
        dict(
            IEEE=x.dtype == torch.float32,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            STAGES=stages,
            num_warps=warps,
            num_stages=stages,
        ),
    )


def iteration_launches(x, x_next, gram, poly, coefficients, arch: int) -> list[Launch]:
    """The three launches of one iteration from ``x`` into ``x_next`` (``gram``, ``poly``: ``[batch, m, m]``)."""
    a, b, c = coefficients
    return [
        sym_launch(x, None, gram, 1.0, 0.0, arch),
        sym_launch(gram, gram, poly, c, b, arch),
        update_launch(poly, x, x_next, a, arch),
    ]


def newton_schulz(x: torch.Tensor, steps: int, coefficients, eps: float) -> torch.Tensor:
    """The iteration (module docstring; ``megakernels.ops.muon``) on ``x`` ``[batch, rows, cols]`` in x's dtype
    (float32, float16 or bfloat16) on CUDA, or on the CPU under Triton's interpreter."""
    tall = x.shape[-2] > x.shape[-1]
    g = x.mT if tall else x
    norm = torch.linalg.vector_norm(g.float(), dim=(-2, -1), keepdim=True).clamp(min=eps)
    cur = (g.float() / norm).to(x.dtype).contiguous()
    batch, m, _ = cur.shape
    nxt = torch.empty_like(cur)
    gram = torch.empty((batch, m, m), dtype=x.dtype, device=x.device)
    poly = torch.empty_like(gram)
    arch = arch_of(x.device)
    for _ in range(steps):
        for launch in iteration_launches(cur, nxt, gram, poly, coefficients, arch):
            launch()
        cur, nxt = nxt, cur
    return (cur.mT if tall else cur).contiguous()
