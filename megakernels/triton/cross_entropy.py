"""Cross-entropy kernels over (a vocab shard of) the logits, one program per token row.

``stats`` streams the row once in BLOCK_V chunks with an online max: per row it writes
``(max, sum exp(x - max), x[target] or 0 if the target is not in this shard, sum x)`` over the real columns only
(global column index < vocab_size: padding columns are excluded). The Python side combines the rows' statistics
(across the tensor-parallel group when the vocab is sharded) into the loss and the log-sum-exp.

``grad`` writes ``dloss * (softmax - (1 - eps) onehot(target) - eps / V)`` (0 on padding columns and ignored
rows), either into a new tensor or in place of the logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megakernels.triton._common import arch_of
from megakernels.triton.launch import Launch


@triton.jit
def _stats_kernel(X, TARGET, STATS, stride_x, n_cols, n_valid, vocab_start, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    X += row * stride_x
    target = tl.load(TARGET + row).to(tl.int64) - vocab_start
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    total = tl.zeros([BLOCK_V], tl.float32)
    picked = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        valid = cols < n_valid
        x = tl.load(X + cols, mask=valid, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.math.exp2((m - m_safe) * 1.4426950408889634) + tl.math.exp2((x - m_safe) * 1.4426950408889634)
        m = m_new
        total += tl.where(valid, x, 0.0)
        picked += tl.where(cols == target, x, 0.0)
    # Lane-wise (max, sum) pairs -> one per row.
    row_max = tl.max(m, 0)
    row_max_safe = tl.where(row_max == float("-inf"), 0.0, row_max)
    row_sum = tl.sum(s * tl.math.exp2((m - row_max_safe) * 1.4426950408889634), 0)
    tl.store(STATS + row * 4 + 0, row_max)
    tl.store(STATS + row * 4 + 1, row_sum)
    tl.store(STATS + row * 4 + 2, tl.sum(picked, 0))
    tl.store(STATS + row * 4 + 3, tl.sum(total, 0))


@triton.jit
def _grad_kernel(X, TARGET, LSE, DLOSS, GRAD, stride_x, stride_g, n_cols, n_valid, vocab_start, ignore_index,
                 smooth_target, smooth_other, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    X += row * stride_x
    GRAD += row * stride_g
    target_global = tl.load(TARGET + row).to(tl.int64)
    target = target_global - vocab_start
    dloss = tl.load(DLOSS + row).to(tl.float32)
    dloss = tl.where(target_global == ignore_index, 0.0, dloss)
    lse = tl.load(LSE + row)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        in_row = cols < n_cols
        valid = cols < n_valid
        x = tl.load(X + cols, mask=valid, other=0.0).to(tl.float32)
        g = tl.math.exp2((x - lse) * 1.4426950408889634) - smooth_other - tl.where(cols == target, smooth_target, 0.0)
        g = tl.where(valid, g * dloss, 0.0)
        tl.store(GRAD + cols, g.to(GRAD.dtype.element_ty), mask=in_row)


def _block_v(n_cols: int, arch: int) -> tuple[int, int]:
    if arch == 0:  # interpreter: the whole (small) row at once
        return max(16, triton.next_power_of_2(n_cols)), 4
    return min(max(1024, triton.next_power_of_2(n_cols) // 16), 8192), 8


def stats_launch(logits, target, out, vocab_start: int, n_valid: int, arch: int) -> Launch:
    n, v = logits.shape
    block, warps = _block_v(v, arch)
    return Launch(_stats_kernel, (n,), (logits, target, out, logits.stride(0), v, n_valid, vocab_start),
                  dict(BLOCK_V=block, num_warps=warps))


def grad_launch(logits, target, lse, dloss, vocab_start: int, n_valid: int, ignore_index: int, smooth_target: float,
                smooth_other: float, out, arch: int) -> Launch:
    n, v = logits.shape
    block, warps = _block_v(v, arch)
    return Launch(_grad_kernel, (n,), (logits, target, lse, dloss, out, logits.stride(0), out.stride(0), v, n_valid,
                                       vocab_start, ignore_index, smooth_target, smooth_other),
                  dict(BLOCK_V=block, num_warps=warps))


def stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, n_valid: int) -> torch.Tensor:
    """``[N, 4]`` fp32: row max, sum of exp(x - max), target logit (0 off-shard), sum of logits."""
    out = torch.empty((logits.shape[0], 4), dtype=torch.float32, device=logits.device)
    stats_launch(logits, target, out, vocab_start, n_valid, arch_of(logits.device))()
    return out


def grad(logits, target, lse, dloss, vocab_start: int, n_valid: int, ignore_index: int, smooth_target: float,
         smooth_other: float, out: torch.Tensor) -> torch.Tensor:
    grad_launch(logits, target, lse, dloss, vocab_start, n_valid, ignore_index, smooth_target, smooth_other, out,
                arch_of(logits.device))()
    return out
