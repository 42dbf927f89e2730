"""Moving tokens to their experts and back.

``permute`` orders a micro-batch's (token, choice) assignments by expert (by token within an expert; a counting
pass, ``ops.moe_permute``), so each expert's rows are contiguous for the grouped GEMM; with a capacity of ``C``
rows per expert the first ``C`` assignments of each expert in that order (the earliest tokens) are kept and the
rest dropped. ``unpermute`` puts
the expert outputs back in token order and sums each token's ``k`` outputs weighted by its router weights (a dropped
assignment contributes nothing; the token keeps its residual). Both are differentiable: gradients reach the tokens,
the expert outputs and the router weights.

Under expert parallelism the assignments sorted by global expert are exchanged by ``AllToAll`` within the expert-
parallel group, every rank sending each peer the rows of that peer's experts: the per-expert counts go first (so
every rank can size its receive), then the rows, with variable split sizes. ``ExpertExchange`` does the exchange,
re-sorts the received rows by local expert for the grouped GEMM, and undoes both on the way back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megakernels.ops.moe_permute import moe_permute, moe_unpermute
from megakernels.parallel import comm


class Permutation:
    """The result of ``permute``: rows for the experts, their counts, and how to put them back (``dest``: each
    assignment's row, -1 when dropped)."""

    def __init__(
        self, rows: torch.Tensor, group_sizes: torch.Tensor, dest: torch.Tensor, num_tokens: int, k: int, dropped: int
    ):
        self.rows, self.group_sizes, self.dest = rows, group_sizes, dest
        self.num_tokens, self.k, self.dropped = num_tokens, k, dropped


def permute(
    x: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
    capacity: int | None = None,
    pad_multiple: int = 1,
    fixed: bool = False,
) -> Permutation:
    """``x`` ``[T, h]``, ``experts`` ``[T, k]`` -> the kept assignments' rows in expert order (``ops.moe_permute``:
    a counting pass, no sort); ``capacity`` None is dropless; ``pad_multiple`` pads each expert's rows; ``fixed``
    gives every expert ``capacity`` rows (no host read: the sync-free mode)."""
    T, k = experts.shape
    p = moe_permute(x, experts, num_experts, capacity=capacity, pad_multiple=pad_multiple, fixed=fixed)
    return Permutation(p.rows, p.group_sizes, p.dest, T, k, p.dropped)


def unpermute(out_rows: torch.Tensor, perm: Permutation, weights: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """Expert outputs ``[rows, h]`` -> ``[T, h]``: each token's outputs weighted by ``weights`` ``[T, k]`` and summed
    in one pass (``ops.moe_unpermute``: fp32 sums, in the rows' dtype). fp64 rows, or ``fused=False``, take PyTorch's
    gather, multiply and sum instead (fp32 sums for 16-bit rows): the same values up to the rounding order."""
    if out_rows.dtype == torch.float64 or not fused:
        T, k, h = perm.num_tokens, perm.k, out_rows.shape[1]
        acc = torch.float64 if out_rows.dtype == torch.float64 else torch.float32
        gathered = torch.cat([out_rows, out_rows.new_zeros(1, h)]).index_select(
            0, perm.dest.where(perm.dest >= 0, out_rows.shape[0])
        )
        return (gathered.view(T, k, h).to(acc) * weights.to(acc).unsqueeze(-1)).sum(1).to(out_rows.dtype)
    return moe_unpermute(out_rows, perm.dest, weights)


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with variable splits; backward is the exchange the other way."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        comm.record("launch", "all_to_all")
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, dout):
        dx = dout.new_empty((sum(ctx.send),) + tuple(dout.shape[1:]))
        dist.all_to_all_single(dx, dout.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return dx, None, None, None


def local_order(recv_counts: torch.Tensor) -> torch.Tensor:
    """Rows received by source rank, then local expert (``recv_counts`` ``[source, local expert]``) -> the index
    that orders them by local expert, then source rank."""
    ep, local = recv_counts.shape
    seg = recv_counts.flatten()
    starts = torch.cumsum(seg, 0) - seg
    seg_t = seg.view(ep, local).t().reshape(-1)
    idx = torch.repeat_interleave(starts.view(ep, local).t().reshape(-1), seg_t)
    within = torch.arange(idx.numel(), device=idx.device)
    return idx + within - torch.repeat_interleave(torch.cumsum(seg_t, 0) - seg_t, seg_t)


class ExpertExchange:
    """Exchange of rows sorted by global expert within the expert-parallel ``group`` (``num_experts`` split into
    equal blocks per rank). ``forward(rows, sizes)`` -> this rank's rows sorted by local expert and their
    ``[num_local]`` counts; ``backward(out_rows)`` -> the outputs back in the original order on their senders."""

    def __init__(self, group, num_experts: int):
        self.group, self.ep = group, dist.get_world_size(group)
        self.local = num_experts // self.ep

    def forward(self, rows: torch.Tensor, sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ep, local = self.ep, self.local
        counts = sizes.view(ep, local)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts.contiguous(), group=self.group)  # [source, local expert]
        self.send = counts.sum(1).tolist()
        self.recv = recv_counts.sum(1).tolist()
        received = AllToAll.apply(rows, self.send, self.recv, self.group)
        self.order = local_order(recv_counts)
        return received.index_select(0, self.order), recv_counts.sum(0)

    def backward(self, out_rows: torch.Tensor) -> torch.Tensor:
        back = out_rows.new_zeros(out_rows.shape).index_copy(0, self.order, out_rows)
        return AllToAll.apply(back, self.recv, self.send, self.group)
