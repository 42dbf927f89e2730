"""Moving a mixture-of-experts layer's token rows to their experts and back, without a sort (csrc/moe/permute.h;
Triton on CUDA: megakernels/triton/moe_permute.py).

``moe_permute(x [T, h], experts [T, k], E)``: the assignments ``a = t·k + j`` in that order; each expert keeps its
first ``capacity`` ones (all without a capacity: dropless), its kept rows padded with zero rows up to a multiple of
``pad_multiple`` (FP8 GEMM tiles); the experts' row blocks follow each other in expert order. A counting pass
(the assignments per expert, then each one's place among its expert's) gives ``dest[a]``, the row of assignment
``a`` or -1 when dropped — what an ``argsort`` of all assignments gave before, in one pass over ``T·k`` integers
instead of a sort. The rows are one gather of ``x``.

``moe_unpermute(rows, dest, weights [T, k])``: ``out[t] = Σ_j weights[t, j] · rows[dest[t·k + j]]`` (a dropped
assignment adds nothing), the router weights applied in the same pass, fp32 sums, in the rows' dtype; its backward
in one pass too (``drows`` and ``dweights``; padding rows get zero gradient). Both differentiable: gradients reach
``x``, the expert outputs and the router weights.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

import megakernels._lib  # noqa: F401  (registers torch.ops.megakernels.*)
from megakernels._backend import emulate_for, runs_triton
from megakernels.ops import _checks

OP = "moe_permute"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Permuted(NamedTuple):
    """``rows`` [R, h] in expert order, ``group_sizes`` [E] int64 (each expert's rows, padding included),
    ``dest`` [T·k] int64 (each assignment's row, -1 when dropped), ``kept`` [E] int64 (kept assignments) and
    ``dropped`` (an int: the assignments over capacity)."""

    rows: torch.Tensor
    group_sizes: torch.Tensor
    dest: torch.Tensor
    kept: torch.Tensor
    dropped: int


@torch.library.custom_op("megakernels::moe_permute_index", mutates_args=())
def _index(
    experts: torch.Tensor, num_experts: int, capacity: int, pad_multiple: int, emulate: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if runs_triton(OP, experts, emulate):
        from megakernels.triton import moe_permute as kernels

        return kernels.permute_index(experts, num_experts, capacity, pad_multiple)
    return tuple(torch.ops.megakernels.moe_permute_index_cpu(experts, num_experts, capacity, pad_multiple))


@_index.register_fake
def _(experts, num_experts, capacity, pad_multiple, emulate):
    i64 = dict(dtype=torch.int64, device=experts.device)
    return torch.empty(experts.numel(), **i64), torch.empty(num_experts, **i64), torch.empty(num_experts, **i64)


@torch.library.custom_op("megakernels::moe_unpermute_fwd", mutates_args=())
def _unpermute(rows: torch.Tensor, dest: torch.Tensor, weights: torch.Tensor, emulate: bool) -> torch.Tensor:
    if runs_triton("moe_unpermute", rows, emulate):
        from megakernels.triton import moe_permute as kernels

        return kernels.unpermute(rows, dest, weights)
    return torch.ops.megakernels.moe_unpermute_cpu(rows, dest, weights)


@_unpermute.register_fake
def _(rows, dest, weights, emulate):
    return rows.new_empty((weights.shape[0], rows.shape[1]))


@torch.library.custom_op("megakernels::moe_unpermute_bwd", mutates_args=())
def _unpermute_bwd(
    rows: torch.Tensor, dest: torch.Tensor, weights: torch.Tensor, dout: torch.Tensor, emulate: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if runs_triton("moe_unpermute", rows, emulate):
        from megakernels.triton import moe_permute as kernels

        return kernels.unpermute_backward(rows, dest, weights, dout)
    return tuple(torch.ops.megakernels.moe_unpermute_grad_cpu(rows, dest, weights, dout))


@_unpermute_bwd.register_fake
def _(rows, dest, weights, dout, emulate):
    return torch.empty_like(rows), torch.empty_like(weights)


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, dest, weights, emulate):
        ctx.save_for_backward(rows, dest, weights)
        ctx.emulate = emulate
        return _unpermute(rows, dest, weights, emulate)

    @staticmethod
    def backward(ctx, dout):
        rows, dest, weights = ctx.saved_tensors
        drows, dw = _unpermute_bwd(rows, dest, weights, dout.contiguous(), ctx.emulate)
        return drows, None, dw, None


def _check_experts(op, experts, num_experts):
    _checks.tensor(op, "experts", experts)
    if experts.dim() != 2 or experts.dtype != torch.int64:
        raise ValueError(f"{op}: experts must be int64 [tokens, k], got {experts.dtype} {tuple(experts.shape)}")
    return _checks.integer(op, "num_experts", num_experts, minimum=1)


def moe_permute(
    x: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
    *,
    capacity: int | None = None,
    pad_multiple: int = 1,
    fixed: bool = False,
) -> Permuted:
    """The rows of ``x`` ``[T, h]`` for the experts ``experts`` ``[T, k]`` chose (module docstring).

    Args:
        x: ``[T, h]`` fp32/bf16/fp16 (or fp64), CPU or CUDA.
        experts: int64 ``[T, k]`` in ``[0, num_experts)``.
        num_experts: E.
        capacity: the most assignments an expert keeps (None: all).
        pad_multiple: each expert's rows padded with zero rows to a multiple of this (1: none).
        fixed: every expert gets exactly ``capacity`` rows (rounded up to ``pad_multiple``), kept ones first, then
            zero rows: the output's size never depends on the routing, so nothing is read back to the host (a step
            can be captured as a CUDA graph); ``dropped`` is then a 0-dim int64 tensor. Needs ``capacity``.

    Returns:
        ``Permuted``; reading the row count back to the host is the one synchronisation (dropless routing sizes
        its output by the data).

    Raises:
        TypeError / ValueError naming the argument: a wrong shape or dtype, experts on another device or out of
        range, a capacity below 0 or a pad_multiple below 1.
    """
    _checks.tensor(OP, "x", x)
    num_experts = _check_experts(OP, experts, num_experts)
    if x.dim() != 2 or experts.shape[0] != x.shape[0]:
        raise ValueError(
            f"{OP}: x must be [tokens, h] with experts' {experts.shape[0]} tokens, got shape {tuple(x.shape)}"
        )
    _checks.same_device(OP, "x", x, ("experts", experts))
    cap = -1 if capacity is None else _checks.integer(OP, "capacity", capacity, minimum=0)
    pad_multiple = _checks.integer(OP, "pad_multiple", pad_multiple, minimum=1)
    if fixed and capacity is None:
        raise ValueError(f"{OP}: fixed=True needs a capacity (the rows every expert gets)")
    t, k = experts.shape
    emulate = emulate_for(OP, experts, "experts")
    dest, sizes, kept = _index(experts.contiguous(), num_experts, cap, pad_multiple, emulate)
    if fixed:  # expert e's rows at [e * S, (e + 1) * S): the counting pass's places moved to that layout
        per = -(-cap // pad_multiple) * pad_multiple
        flat = experts.reshape(-1)
        first = torch.cumsum(sizes, 0) - sizes
        dest = torch.where(dest >= 0, flat * per + (dest - first[flat]), -1)
        sizes = torch.full_like(sizes, per)
        total = per * num_experts
        src = torch.full((total + 1,), t, dtype=torch.int64, device=x.device)
        src.index_copy_(0, torch.where(dest >= 0, dest, total), torch.arange(t * k, device=x.device) // k)
        src = src[:total]
        rows = x.index_select(0, src.clamp(max=max(t - 1, 0))).masked_fill((src == t).unsqueeze(1), 0)
        return Permuted(rows, sizes, dest, kept, t * k - kept.sum())
    if cap < 0 and pad_multiple == 1:  # dropless, unpadded: T·k rows whatever the routing (no host read; traceable)
        total = kept_total = t * k
    else:
        total, kept_total = torch.stack([sizes.sum(), kept.sum()]).tolist()
    # each row's token (padding rows: t, then zeroed); dropped assignments land on a spare row, cut off after
    src = torch.full((total + 1,), t, dtype=torch.int64, device=x.device)
    src.index_copy_(0, torch.where(dest >= 0, dest, total), torch.arange(t * k, device=x.device) // k)
    src = src[:total]
    rows = x.index_select(0, src.clamp(max=max(t - 1, 0))) if t else x.new_zeros((total, x.shape[1]))
    if total > kept_total:  # padding rows
        rows = rows.masked_fill((src == t).unsqueeze(1), 0)
    return Permuted(rows, sizes, dest, kept, t * k - kept_total)


def moe_unpermute(rows: torch.Tensor, dest: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[T, h]``: each token's expert outputs weighted by ``weights`` ``[T, k]`` and summed (module docstring).

    Args:
        rows: ``[R, h]`` fp32/bf16/fp16, the expert outputs in ``moe_permute``'s row order.
        dest: int64 ``[T·k]``, ``moe_permute``'s ``dest``.
        weights: ``[T, k]`` (cast to fp32), the router weights.

    Raises:
        TypeError / ValueError naming the argument: a wrong shape or dtype, a device mismatch, dest out of range.
    """
    op = "moe_unpermute"
    for name, t in (("rows", rows), ("dest", dest), ("weights", weights)):
        _checks.tensor(op, name, t)
    if rows.dim() != 2 or rows.dtype not in DTYPES:
        raise ValueError(f"{op}: rows must be [R, h] fp32/bf16/fp16, got {rows.dtype} {tuple(rows.shape)}")
    if weights.dim() != 2 or dest.dtype != torch.int64 or dest.numel() != weights.numel():
        raise ValueError(
            f"{op}: weights must be [tokens, k] and dest int64 with one entry per assignment, got weights "
            f"{tuple(weights.shape)} and dest {dest.dtype} {tuple(dest.shape)}"
        )
    _checks.same_device(op, "rows", rows, ("dest", dest), ("weights", weights))
    emulate = emulate_for(op, rows, "rows")
    return _Unpermute.apply(rows.contiguous(), dest.contiguous(), weights.float().contiguous(), emulate)


def moe_permute_reference(x, experts, num_experts, capacity=None, pad_multiple=1):
    """``moe_permute`` by a stable argsort of the assignments (tests): ``(rows, group_sizes, dest)``."""
    t, k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    kept = counts if capacity is None else counts.clamp(max=capacity)
    sizes = (kept + pad_multiple - 1) // pad_multiple * pad_multiple
    start = torch.cumsum(sizes, 0) - sizes
    first = torch.cumsum(counts, 0) - counts
    dest = torch.full_like(flat, -1)
    pos = torch.arange(flat.numel(), device=flat.device) - first[flat[order]]
    keep = pos < kept[flat[order]]
    dest[order[keep]] = start[flat[order[keep]]] + pos[keep]
    rows = x.new_zeros((int(sizes.sum()), x.shape[1]))
    rows[dest[dest >= 0]] = x[(torch.arange(t * k, device=x.device) // k)[dest >= 0]]
    return rows, sizes, dest
