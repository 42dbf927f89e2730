"""The conjugate communication operators of tensor and sequence parallelism, as autograd functions.

Megatron-LM (Shoeybi et al., 2019) splits a Transformer layer over the tp ranks of a group with two operators:

    f = copy_to_tensor_model_parallel_region       forward: identity         backward: all-reduce
    g = reduce_from_tensor_model_parallel_region   forward: all-reduce       backward: identity

An MLP ``Y = GeLU(X A) B`` with A split by columns and B by rows is ``g(GeLU(f(X) A_i) B_i)``: f hands every rank
the full X and sums the partial input gradients; g sums the partial outputs ``GeLU(X A_i) B_i``. The gradient of
the sum is the broadcast (identity) and vice versa, which is why each is the other's transpose.

Sequence parallelism (Korthikanti et al., 2022) keeps activations outside the TP regions (LayerNorm, dropout,
residual) split along the sequence — dim 0 of Megatron's ``[s, b, h]`` layout — and replaces g's all-reduce by a
reduce-scatter along the sequence and f by an all-gather along it, with the same total traffic:

    gather_from_sequence_parallel_region       forward: all-gather dim 0   backward: reduce-scatter dim 0
    reduce_scatter_to_sequence_parallel_region forward: reduce-scatter     backward: all-gather dim 0
    scatter_to_sequence_parallel_region        forward: keep own block     backward: all-gather dim 0

plus scatter/gather along the last (hidden) dim for layers whose input or output is wanted whole:

    scatter_to_tensor_model_parallel_region    forward: keep own block     backward: all-gather last dim
    gather_from_tensor_model_parallel_region   forward: all-gather last    backward: keep own block

``group`` defaults to the tensor-parallel group of ``megakernels.parallel.initialize``; on a group of one rank every
operator is the identity, with no communication. Blocks are contiguous and in rank order of the group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megakernels.parallel import comm, state


def _group(group):
    return state.tp_group() if group is None else group


def _single(group) -> bool:
    return dist.get_world_size(group) == 1


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return comm.all_reduce(dy.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return comm.all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _ScatterLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.split(x, -1, group)

    @staticmethod
    def backward(ctx, dy):
        return comm.all_gather(dy, -1, ctx.group), None


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_gather(x, -1, group)

    @staticmethod
    def backward(ctx, dy):
        return comm.split(dy, -1, ctx.group), None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.split(x, 0, group)

    @staticmethod
    def backward(ctx, dy):
        return comm.all_gather(dy, 0, ctx.group), None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group, ctx.reduce = group, tensor_parallel_output_grad
        return comm.all_gather(x, 0, group)

    @staticmethod
    def backward(ctx, dy):
        if ctx.reduce:
            return comm.reduce_scatter(dy, 0, ctx.group), None, None
        return comm.split(dy, 0, ctx.group), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.reduce_scatter(x, 0, group)

    @staticmethod
    def backward(ctx, dy):
        return comm.all_gather(dy, 0, ctx.group), None


def _check_dim(op: str, x: torch.Tensor, dim: int, group) -> None:
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have at least one dimension, got a scalar")
    world = dist.get_world_size(group)
    if x.shape[dim] % world:
        raise ValueError(
            f"{op}: x has {x.shape[dim]} elements along dim {dim % x.dim()}, not divisible by the "
            f"tensor-parallel size {world}"
        )


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """f: ``x`` unchanged forward; the gradient is summed over the group backward. Any shape and dtype."""
    group = _group(group)
    return x if _single(group) else _CopyToTP.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """g: ``x`` summed over the group forward (a new tensor); the gradient passes unchanged backward."""
    group = _group(group)
    return x if _single(group) else _ReduceFromTP.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """``[..., h]`` -> this rank's ``[..., h/tp]`` block forward; all-gather of the gradient backward.

    Raises:
        ValueError: ``h`` not divisible by the group size.
    """
    group = _group(group)
    _check_dim("scatter_to_tensor_model_parallel_region", x, -1, group)
    return x if _single(group) else _ScatterLast.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """``[..., h/tp]`` -> ``[..., h]`` (all-gather, rank order) forward; this rank's block of the gradient back."""
    group = _group(group)
    if x.dim() == 0:
        raise ValueError("gather_from_tensor_model_parallel_region: x must have at least one dimension")
    return x if _single(group) else _GatherLast.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """``[s, ...]`` -> this rank's ``[s/tp, ...]`` block forward; all-gather along dim 0 backward.

    Raises:
        ValueError: ``s`` not divisible by the group size.
    """
    group = _group(group)
    _check_dim("scatter_to_sequence_parallel_region", x, 0, group)
    return x if _single(group) else _ScatterSeq.apply(x, group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group=None, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """``[s/tp, ...]`` -> ``[s, ...]`` (all-gather along dim 0) forward.

    Backward: reduce-scatter of the gradient when the consumer is a tensor-parallel region whose ranks each hold a
    partial gradient of the full sequence (``tensor_parallel_output_grad=True``, the usual case: the input of a
    column-parallel layer); this rank's block of it when every rank computed the same full gradient.
    """
    group = _group(group)
    if x.dim() == 0:
        raise ValueError("gather_from_sequence_parallel_region: x must have at least one dimension")
    return x if _single(group) else _GatherSeq.apply(x, group, bool(tensor_parallel_output_grad))


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """``[s, ...]`` partial sums -> this rank's ``[s/tp, ...]`` block of their sum forward; all-gather backward.

    Raises:
        ValueError: ``s`` not divisible by the group size.
    """
    group = _group(group)
    _check_dim("reduce_scatter_to_sequence_parallel_region", x, 0, group)
    return x if _single(group) else _ReduceScatterSeq.apply(x, group)
