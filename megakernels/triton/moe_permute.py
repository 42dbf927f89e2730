"""The MoE permutation's kernels (megakernels/ops/moe_permute.py has the contract).

The index pass without a sort, in two kernels over blocks of ``BLOCK`` assignments: the first counts each block's
assignments per expert (an equality of the block's experts against the expert ids, summed); a few ``[blocks, E]``
integer ops then give every block its first place in each expert and every expert its first row; the second
places each assignment at its block's base plus its rank among the block's earlier assignments to the same expert
(an equality of the block against itself, lower indices only). ``unpermute`` is one program per token and block of
hidden columns, summing its ``k`` weighted rows in fp32; its backward one program per token, looping over the
hidden columns to finish each ``dweight`` dot product in the program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megakernels.triton.launch import Launch

BLOCK = 64  # assignments a program of the index pass (its place kernel holds a BLOCK x BLOCK equality)
BLOCK_H = 256  # hidden columns a program (a loop step) of the unpermute


@triton.jit
def _count_kernel(EXPERTS, COUNTS, N, E, BLOCK: tl.constexpr, E_BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(EXPERTS + offs, mask=offs < N, other=-1)
    ids = tl.arange(0, E_BLOCK)
    counts = tl.sum((e[:, None] == ids[None, :]).to(tl.int32), 0)
    tl.store(COUNTS + pid.to(tl.int64) * E + ids, counts, mask=ids < E)


@triton.jit
def _place_kernel(EXPERTS, BASE, KEPT, START, DEST, N, E, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    r = tl.arange(0, BLOCK)
    offs = pid * BLOCK + r
    valid = offs < N
    e = tl.load(EXPERTS + offs, mask=valid, other=-1)
    earlier = (e[:, None] == e[None, :]) & (r[None, :] < r[:, None])
    rank = tl.sum(earlier.to(tl.int32), 1)
    safe = tl.where(valid, e, 0)
    pos = tl.load(BASE + pid.to(tl.int64) * E + safe, mask=valid, other=0) + rank
    kept = tl.load(KEPT + safe, mask=valid, other=0)
    start = tl.load(START + safe, mask=valid, other=0)
    tl.store(DEST + offs, tl.where(pos < kept, start + pos, -1), mask=valid)


def permute_index_launches(experts, counts, base, kept, start, dest, num_experts):
    n = experts.numel()
    grid = (triton.cdiv(n, BLOCK),)
    e_block = triton.next_power_of_2(num_experts)
    return (
        Launch(_count_kernel, grid, (experts, counts, n, num_experts), dict(BLOCK=BLOCK, E_BLOCK=e_block)),
        Launch(_place_kernel, grid, (experts, base, kept, start, dest, n, num_experts), dict(BLOCK=BLOCK)),
    )


def permute_index(experts: torch.Tensor, num_experts: int, capacity: int, pad_multiple: int):
    """(dest [T·k], sizes [E], kept [E]) int64, as the CPU kernel's."""
    flat = experts.reshape(-1)
    n, dev = flat.numel(), flat.device
    blocks = max(1, triton.cdiv(n, BLOCK))
    counts = torch.zeros(blocks, num_experts, dtype=torch.int64, device=dev)
    dest = torch.empty(n, dtype=torch.int64, device=dev)
    count_launch, place_launch = permute_index_launches(flat, counts, counts, counts, counts, dest, num_experts)
    if n:
        count_launch()
    total = counts.sum(0)
    kept = total if capacity < 0 else total.clamp(max=capacity)
    sizes = (kept + pad_multiple - 1) // pad_multiple * pad_multiple
    start = torch.cumsum(sizes, 0) - sizes
    base = torch.cumsum(counts, 0) - counts  # each block's first place in each expert
    if n:
        permute_index_launches(flat, counts, base, kept.contiguous(), start, dest, num_experts)[1]()
    return dest, sizes, kept


@triton.jit
def _unpermute_kernel(ROWS, DEST, W, OUT, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(K):
        d = tl.load(DEST + t * K + j)
        w = tl.load(W + t * K + j)
        r = tl.load(ROWS + d * H + cols, mask=cmask & (d >= 0), other=0.0).to(tl.float32)
        acc += w * r
    tl.store(OUT + t * H + cols, acc.to(OUT.dtype.element_ty), mask=cmask)


@triton.jit
def _unpermute_bwd_kernel(ROWS, DEST, W, DOUT, DROWS, DW, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    for j in tl.static_range(K):
        d = tl.load(DEST + t * K + j)
        w = tl.load(W + t * K + j)
        dot = tl.zeros([BLOCK_H], tl.float32)
        for c in range(0, H, BLOCK_H):
            cols = c + tl.arange(0, BLOCK_H)
            m = (cols < H) & (d >= 0)
            g = tl.load(DOUT + t * H + cols, mask=m, other=0.0).to(tl.float32)
            r = tl.load(ROWS + d * H + cols, mask=m, other=0.0).to(tl.float32)
            dot += g * r
            tl.store(DROWS + d * H + cols, (w * g).to(DROWS.dtype.element_ty), mask=m)
        tl.store(DW + t * K + j, tl.sum(dot, 0))


def unpermute_launch(rows, dest, weights, out) -> Launch:
    t, k = weights.shape
    h = rows.shape[1]
    return Launch(
        _unpermute_kernel, (t, triton.cdiv(h, BLOCK_H)), (rows, dest, weights, out, h), dict(K=k, BLOCK_H=BLOCK_H)
    )


def unpermute(rows, dest, weights):
    out = rows.new_empty((weights.shape[0], rows.shape[1]))
    if out.numel():
        unpermute_launch(rows, dest, weights, out)()
    return out


def unpermute_backward_launch(rows, dest, weights, dout, drows, dw) -> Launch:
    t, k = weights.shape
    return Launch(
        _unpermute_bwd_kernel, (t,), (rows, dest, weights, dout, drows, dw, rows.shape[1]), dict(K=k, BLOCK_H=BLOCK_H)
    )


def unpermute_backward(rows, dest, weights, dout):
    drows, dw = torch.zeros_like(rows), torch.empty_like(weights)
    if weights.numel():
        unpermute_backward_launch(rows, dest, weights, dout, drows, dw)()
    return drows, dw
