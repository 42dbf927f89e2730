"""Cross-entropy kernels over (a vocab shard of) the logits, one program per token row.

``stats`` streams the row once in BLOCK_V chunks: per row it writes ``(max, sum exp(x - max), x[target] or 0 if
the target is not in this shard, sum x)`` over the real columns only (global column index < vocab_size: padding
columns are excluded). The Python side combines the rows' statistics (across the tensor-parallel group when the
vocab is sharded) into the loss and the log-sum-exp.

``grad`` writes ``dloss * (softmax - (1 - eps) onehot(target) - eps / V)`` (0 on padding columns and ignored
rows), either into a new tensor or in place of the logits.

With ``softcap`` = c > 0 (Gemma's final-logit soft cap) both kernels read each logit as ``c tanh(x / c)`` and the
gradient carries the cap's derivative ``1 - tanh(x / c)^2``; without it (``CAP`` compiled out) the kernels are
unchanged.

Design (the static cost model beside the package has the budgets): one exponential per element — each chunk's maximum is
reduced first, the running sum rescaled once per chunk, and ``exp(x - m)`` taken as ``exp2(x * log2e - m *
log2e)`` (one FFMA and one MUFU); the target logit is one load per row, not a compare per element; full chunks
run without masks, only the tail is masked; the label-smoothing terms of the gradient are compiled out when eps
is 0; the chunk loop keeps STAGES chunks of loads in flight (Triton's pipeliner), 24+ KB per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megakernels.triton._common import arch_of
from megakernels.triton.launch import Launch


@triton.jit
def _cap_tanh(z):
    """tanh(z) as 1 - 2 / (exp(2z) + 1) (one ex2 and one approximate reciprocal: absolute error ~1e-7, exactly +-1
    where the exponential saturates)."""
    return 1.0 - tl.fdiv(2.0, tl.math.exp2(z * 2.8853900817779268) + 1.0, ieee_rounding=False)


@triton.jit
def _stats_chunk(X, cols, mask, m, s, total, n_valid, softcap, inv_cap, MASKED: tl.constexpr, CAP: tl.constexpr):
    if MASKED:
        x = tl.load(X + cols, mask=mask, other=float("-inf")).to(tl.float32)
    else:
        x = tl.load(X + cols).to(tl.float32)
    if CAP:
        x = softcap * _cap_tanh(x * inv_cap)
        if MASKED:  # the masked columns' -inf would cap to -softcap
            x = tl.where(mask, x, float("-inf"))
    m_new = tl.maximum(m, tl.max(x, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing but -inf so far
    s = s * tl.math.exp2((m - m_safe) * 1.4426950408889634) + tl.sum(
        tl.math.exp2(x * 1.4426950408889634 - m_safe * 1.4426950408889634), 0
    )
    if MASKED:
        total += tl.where(mask, x, 0.0)
    else:
        total += x
    return m_new, s, total


@triton.jit
def _stats_kernel(
    X,
    TARGET,
    STATS,
    stride_x,
    n_cols,
    n_valid,
    vocab_start,
    softcap,
    inv_cap,
    BLOCK_V: tl.constexpr,
    STAGES: tl.constexpr,
    CAP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    X += row * stride_x
    target = tl.load(TARGET + row).to(tl.int64) - vocab_start
    in_shard = (target >= 0) & (target < n_valid)
    picked = tl.load(X + tl.where(in_shard, target, 0), mask=in_shard, other=0.0).to(tl.float32)
    if CAP:
        picked = softcap * _cap_tanh(picked * inv_cap)
    offs = tl.arange(0, BLOCK_V)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    total = tl.zeros([BLOCK_V], tl.float32)
    full = n_valid // BLOCK_V * BLOCK_V
    for start in tl.range(0, full, BLOCK_V, num_stages=STAGES):
        m, s, total = _stats_chunk(X, start + offs, offs < BLOCK_V, m, s, total, n_valid, softcap, inv_cap, False, CAP)
    if full < n_valid:
        tail = full + offs < n_valid
        m, s, total = _stats_chunk(X, full + offs, tail, m, s, total, n_valid, softcap, inv_cap, True, CAP)
    tl.store(STATS + row * 4 + 0, m)
    tl.store(STATS + row * 4 + 1, s)
    tl.store(STATS + row * 4 + 2, picked)
    tl.store(STATS + row * 4 + 3, tl.sum(total, 0))


@triton.jit
def _grad_of(x, lse2, softcap, inv_cap, sub, SUB: tl.constexpr, CAP: tl.constexpr):
    """``(softmax(y) - sub) * dy/dx`` of the logits ``x``: ``y = x`` and the derivative 1 without a cap (compiled
    out), ``y = softcap * tanh(x / softcap)`` and ``1 - tanh^2`` with it."""
    if CAP:
        th = _cap_tanh(x * inv_cap)
        g = tl.math.exp2(softcap * th * 1.4426950408889634 - lse2)
    else:
        g = tl.math.exp2(x * 1.4426950408889634 - lse2)
    if SUB:
        g -= sub
    if CAP:
        g = g * (1.0 - th * th)
    return g


@triton.jit
def _grad_kernel(
    X,
    TARGET,
    LSE,
    DLOSS,
    GRAD,
    stride_x,
    stride_g,
    n_cols,
    n_valid,
    vocab_start,
    ignore_index,
    smooth_target,
    smooth_other,
    softcap,
    inv_cap,
    BLOCK_V: tl.constexpr,
    SMOOTH: tl.constexpr,
    STAGES: tl.constexpr,
    CAP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    X += row * stride_x
    GRAD += row * stride_g
    target_global = tl.load(TARGET + row).to(tl.int64)
    target = target_global - vocab_start
    in_shard = (target >= 0) & (target < n_valid)
    dloss = tl.load(DLOSS + row).to(tl.float32)
    dloss = tl.where(target_global == ignore_index, 0.0, dloss)
    lse2 = tl.load(LSE + row) * 1.4426950408889634
    # The target's logit, read before the loop overwrites it (in-place backward); its gradient is written last.
    x_t = tl.load(X + tl.where(in_shard, target, 0), mask=in_shard, other=0.0).to(tl.float32)
    offs = tl.arange(0, BLOCK_V)
    full = n_valid // BLOCK_V * BLOCK_V
    for start in tl.range(0, full, BLOCK_V, num_stages=STAGES):
        x = tl.load(X + start + offs).to(tl.float32)
        g = _grad_of(x, lse2, softcap, inv_cap, smooth_other, SMOOTH, CAP)
        tl.store(GRAD + start + offs, (g * dloss).to(GRAD.dtype.element_ty))
    for start in range(full, n_cols, BLOCK_V):  # the tail of the real columns, then padding (gradient 0)
        cols = start + offs
        valid = cols < n_valid
        x = tl.load(X + cols, mask=valid, other=0.0).to(tl.float32)
        g = _grad_of(x, lse2, softcap, inv_cap, smooth_other, SMOOTH, CAP)
        tl.store(GRAD + cols, tl.where(valid, g * dloss, 0.0).to(GRAD.dtype.element_ty), mask=cols < n_cols)
    tl.debug_barrier()  # the loop's store of the target column is done before it is overwritten
    g_t = _grad_of(x_t, lse2, softcap, inv_cap, smooth_target + smooth_other, True, CAP)
    tl.store(GRAD + tl.where(in_shard, target, 0), (g_t * dloss).to(GRAD.dtype.element_ty), mask=in_shard)


def _block_v(n_cols: int, arch: int) -> tuple[int, int, int]:
    """(BLOCK_V, num_warps, loop stages): 4096-column chunks (16 per thread of 8 warps: the per-chunk max and sum
    reductions spread over 16 elements) with 3 chunks in flight."""
    if arch == 0:  # interpreter: small chunks, so the tests take the full-chunk, tail and padding paths
        return 32, 4, 1
    return min(4096, max(256, triton.next_power_of_2(n_cols))), 8, 3


def _cap_args(softcap: float) -> tuple[float, float]:
    """(c, 1 / c) of the soft cap; (1, 1) when there is none (the kernels compile the cap out then)."""
    c = float(softcap) if softcap else 1.0
    return c, 1.0 / c


def stats_launch(logits, target, out, vocab_start: int, n_valid: int, arch: int, softcap: float = 0.0) -> Launch:
    n, v = logits.shape
    block, warps, stages = _block_v(v, arch)
    return Launch(
        _stats_kernel,
        (n,),
        (logits, target, out, logits.stride(0), v, n_valid, vocab_start, *_cap_args(softcap)),
        dict(BLOCK_V=block, STAGES=stages, CAP=bool(softcap), num_warps=warps),
    )


def grad_launch(
    logits,
    target,
    lse,
    dloss,
    vocab_start: int,
    n_valid: int,
    ignore_index: int,
    smooth_target: float,
    smooth_other: float,
    out,
    arch: int,
    softcap: float = 0.0,
) -> Launch:
    n, v = logits.shape
    block, warps, stages = _block_v(v, arch)
    return Launch(
        _grad_kernel,
        (n,),
        (
            logits,
            target,
            lse,
            dloss,
            out,
            logits.stride(0),
            out.stride(0),
            v,
            n_valid,
            vocab_start,
            ignore_index,
            smooth_target,
            smooth_other,
            *_cap_args(softcap),
        ),
        dict(BLOCK_V=block, SMOOTH=smooth_other != 0.0, STAGES=stages, CAP=bool(softcap), num_warps=warps),
    )


def stats(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int, n_valid: int, softcap: float = 0.0
) -> torch.Tensor:
    """``[N, 4]`` fp32: row max, sum of exp(x - max), target logit (0 off-shard), sum of logits — of the capped
    logits ``softcap * tanh(x / softcap)`` when ``softcap`` > 0."""
    out = torch.empty((logits.shape[0], 4), dtype=torch.float32, device=logits.device)
    stats_launch(logits, target, out, vocab_start, n_valid, arch_of(logits.device), softcap)()
    return out


def grad(
    logits,
    target,
    lse,
    dloss,
    vocab_start: int,
    n_valid: int,
    ignore_index: int,
    smooth_target: float,
    smooth_other: float,
    out: torch.Tensor,
    softcap: float = 0.0,
) -> torch.Tensor:
    grad_launch(
        logits,
        target,
        lse,
        dloss,
        vocab_start,
        n_valid,
        ignore_index,
        smooth_target,
        smooth_other,
        out,
        arch_of(logits.device),
        softcap,
    )()
    return out
