"""Token dispatchers: how a MoE layer's token rows reach the ranks of their experts and come back.

A dispatcher is called once per layer and micro-batch as ``dispatcher(tokens, weights, experts, compute,
capacity, side)``: ``tokens`` ``[T, h]`` (every token this rank routes), ``weights``/``experts`` ``[T, k]`` (the
router's choices over all ``num_experts``), ``compute(rows, sizes)`` the local experts (rows grouped by local
expert, ``sizes`` ``[num_local]`` int64), ``capacity`` rows per expert (None: dropless), ``side`` a function run
while the first exchange is in flight (the shared experts), or None. It returns the weighted sum of each token's
expert outputs ``[T, h]``, the ``Permutation`` of its assignments (drop statistics) and ``side``'s result.

- ``alltoall`` (default): the assignments permuted by global expert (``dispatch.permute``) and exchanged within
  the expert-parallel group (variable splits), the counts first. With ``chunks`` N > 1 the tokens go in N chunks
  whose exchanges are asynchronous: while the experts compute one chunk the next one's rows travel and the previous
  one's outputs go back; the counts of all chunks are exchanged at once, one host read a layer. Dropless only
  (a capacity keeps the earliest tokens of the whole micro-batch, which chunks cannot see). With a capacity the
  splits are fixed (every expert ``capacity`` rows from every rank, padded): no counts are exchanged and nothing is
  read back to the host.
- ``fp8`` (with ``alltoall``): the dispatched rows travel as FP8 (e4m3) values with one fp32 scale a row (the row's
  absolute maximum over 448), about half the bytes of bf16 rows, and are dequantised on arrival into the experts'
  input dtype; the gradient travels back in full precision (the quantisation is the identity to autograd: a
  straight-through estimate, as FP8 training treats its casts) and the combine stays in full precision. The
  experts' FP8 GEMMs (``--precision fp8``) quantise their input again with their own recipe.
- ``allgather``: every rank's tokens and choices all-gathered over the expert-parallel group, each rank computing
  its experts' assignments of all of them and the partial outputs reduce-scattered back: fixed-size collectives,
  for small expert-parallel groups. Dropless only.
- external backends: ``register(name, factory)``; ``factory(group, num_experts, chunks)`` returns a callable of the
  signature above. The package ships none (a fake one in its tests exercises the interface); a DeepEP adapter
  would be one, untested here.

Without expert parallelism (``group`` None) every dispatcher permutes locally; a capacity then gives every expert a
fixed-size buffer (no host read: the sync-free mode).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megakernels.parallel import comm, mappings
from megakernels.parallel.moe.dispatch import Permutation, local_order, permute, unpermute

_REGISTRY: dict = {}
_DEFAULT = {"name": "alltoall", "chunks": 1, "fp8": False}
FP8_MAX = 448.0  # e4m3's largest finite value


def configure(name: str = "alltoall", chunks: int = 1, fp8: bool = False) -> None:
    """The dispatcher, chunk count and FP8 dispatch of the MoE layers that do not choose their own (the trainer's
    ``--moe-dispatcher``, ``--moe-a2a-chunks``, ``--moe-fp8-dispatch``)."""
    make(name, None, 1, chunks, fp8)  # checked
    _DEFAULT.update(name=name, chunks=chunks, fp8=bool(fp8))


def settings(name: str | None, chunks: int | None, fp8: bool | None = None) -> tuple[str, int, bool]:
    """``(name, chunks, fp8)`` with ``configure``'s values where None."""
    return (
        _DEFAULT["name"] if name is None else name,
        _DEFAULT["chunks"] if chunks is None else chunks,
        _DEFAULT["fp8"] if fp8 is None else bool(fp8),
    )


def register(name: str, factory) -> None:
    """Make ``factory(group, num_experts, chunks)`` the dispatcher called ``name`` (``--moe-dispatcher name``)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register: name must be a non-empty string, got {name!r}")
    _REGISTRY[name] = factory


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def make(name: str, group, num_experts: int, chunks: int = 1, fp8: bool = False):
    """The dispatcher ``name`` over the expert-parallel ``group`` (None: no expert parallelism).

    Raises:
        ValueError: an unknown ``name``, ``chunks`` < 1, ``fp8`` with another dispatcher than ``alltoall``.
    """
    if name not in _REGISTRY:
        raise ValueError(f"moe dispatcher must be one of {', '.join(_REGISTRY)}, got {name!r}")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"moe dispatcher: chunks must be a positive int, got {chunks!r}")
    if fp8:
        if name != "alltoall":
            raise ValueError(f"moe dispatcher: FP8 dispatch is the alltoall dispatcher's, not {name!r}'s")
        return AllToAllDispatcher(group, num_experts, chunks, fp8=True)
    return _REGISTRY[name](group, num_experts, chunks)


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows ``[R, h]`` -> ``[R, h + 4]`` bytes: each row's e4m3 values then its fp32 scale (amax / 448)."""
    scale = (x.detach().abs().amax(1, keepdim=True).float() / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (x.detach().float() / scale).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([q, scale.view(torch.uint8)], 1)


def dequantize_rows(packed: torch.Tensor, h: int, dtype) -> torch.Tensor:
    """``quantize_rows``' bytes -> the rows ``[R, h]`` in ``dtype``."""
    q = packed[:, :h].contiguous().view(torch.float8_e4m3fn)
    scale = packed[:, h:].contiguous().view(torch.float32)
    return (q.float() * scale).to(dtype)


def _local(tokens, weights, experts, compute, num_experts, capacity, side):
    fixed = capacity is not None
    perm = permute(tokens, experts, num_experts, capacity, fixed=fixed)
    extra = side() if side is not None else None
    out = unpermute(compute(perm.rows, perm.group_sizes.to(torch.int64)), perm, weights)
    return out, perm, extra


class _Started(torch.autograd.Function):
    """An all-to-all launched asynchronously (its result filled when ``handle`` is waited on: ``_Waited``); with
    ``fp8`` the rows travel as ``quantize_rows``' bytes and are dequantised at the wait. Backward: the exchange the
    other way, synchronous, in the gradient's precision."""

    @staticmethod
    def forward(ctx, x, send, recv, group, handle, fp8=False):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        sent, into = (quantize_rows(x), None) if fp8 else (x.contiguous(), out)
        if fp8:
            into = sent.new_empty((sum(recv), sent.shape[1]))
        comm.record("launch", "all_to_all")
        comm.count("all_to_all", sent)
        work = dist.all_to_all_single(into, sent, recv, send, group=group, async_op=True)
        handle.append((work, into if fp8 else None))
        return out

    @staticmethod
    def backward(ctx, dout):
        dx = dout.new_empty((sum(ctx.send),) + tuple(dout.shape[1:]))
        dist.all_to_all_single(dx, dout.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return dx, None, None, None, None, None


class _Waited(torch.autograd.Function):
    """Identity once ``handle``'s collective has finished (FP8 rows dequantised into ``x`` first)."""

    @staticmethod
    def forward(ctx, x, handle):
        work, packed = handle.pop()
        work.wait()
        comm.record("wait", "all_to_all")
        if packed is None:
            return x.view_as(x)
        ctx.mark_dirty(x)
        return x.copy_(dequantize_rows(packed, x.shape[1], x.dtype))

    @staticmethod
    def backward(ctx, dx):
        return dx, None


class AllToAllDispatcher:
    def __init__(self, group, num_experts: int, chunks: int = 1, fp8: bool = False):
        self.group, self.num_experts, self.chunks, self.fp8 = group, num_experts, chunks, bool(fp8)
        self.ep = 1 if group is None else dist.get_world_size(group)
        self.num_local = num_experts // self.ep

    def __call__(self, tokens, weights, experts, compute, capacity=None, side=None):
        if self.ep == 1:
            return _local(tokens, weights, experts, compute, self.num_experts, capacity, side)
        n = min(self.chunks, max(1, tokens.shape[0]))
        if n > 1 and capacity is not None:
            raise ValueError("moe dispatcher alltoall: chunks > 1 needs the dropless mode (no capacity factor)")
        if capacity is not None:
            return self._fixed(tokens, weights, experts, compute, capacity, side)
        ep, local = self.ep, self.num_local
        bounds = [tokens.shape[0] * c // n for c in range(n + 1)]
        perms = [
            permute(tokens[a:b], experts[a:b], self.num_experts, capacity) for a, b in zip(bounds[:-1], bounds[1:])
        ]
        counts = torch.stack([p.group_sizes.to(torch.int64) for p in perms]).view(n, ep, local)
        recv_counts = torch.empty_like(counts.transpose(0, 1).contiguous())  # [source, chunk, local expert]
        comm.record("launch", "all_to_all_counts")
        dist.all_to_all_single(recv_counts, counts.transpose(0, 1).contiguous(), group=self.group)
        send = counts.sum(2).tolist()  # [chunk][destination]
        recv = recv_counts.sum(2).t().tolist()  # [chunk][source]
        per_chunk = recv_counts.transpose(0, 1)  # [chunk, source, local]
        handles = [[] for _ in range(n)]
        back_handles = [[] for _ in range(n)]
        started = [None] * n

        def start(c):
            started[c] = _Started.apply(perms[c].rows, send[c], recv[c], self.group, handles[c], self.fp8)

        start(0)
        extra = side() if side is not None else None
        returned = [None] * n
        for c in range(n):
            if c + 1 < n:
                start(c + 1)
            received = _Waited.apply(started[c], handles[c])
            order = local_order(per_chunk[c])
            out = compute(received.index_select(0, order), per_chunk[c].sum(0))
            back = out.new_zeros(out.shape).index_copy(0, order, out)
            returned[c] = _Started.apply(back, recv[c], send[c], self.group, back_handles[c])
        outs = []
        for c in range(n):
            rows = _Waited.apply(returned[c], back_handles[c])
            a, b = bounds[c], bounds[c + 1]
            outs.append(unpermute(rows, perms[c], weights[a:b]))
        out = outs[0] if n == 1 else torch.cat(outs)
        dropped = sum(p.dropped for p in perms) if all(isinstance(p.dropped, int) for p in perms) else None
        if dropped is None:
            dropped = torch.stack([torch.as_tensor(p.dropped) for p in perms]).sum()
        perm = Permutation(None, None, None, tokens.shape[0], experts.shape[1], dropped)
        return out, perm, extra

    def _fixed(self, tokens, weights, experts, compute, capacity, side):
        """With a capacity: every expert gets ``capacity`` rows from every rank (the assignments past it dropped,
        the free rows padding), so the exchange's splits are known without counting: no counts exchanged, nothing
        read back to the host (the sync-free mode under expert parallelism)."""
        ep, local, c = self.ep, self.num_local, capacity
        perm = permute(tokens, experts, self.num_experts, capacity, fixed=True)
        split = [local * c] * ep
        handle, back_handle = [], []
        received = _Waited.apply(_Started.apply(perm.rows, split, split, self.group, handle, self.fp8), handle)
        extra = side() if side is not None else None
        h = received.shape[1]
        # received: by source rank, then local expert -> by local expert, then source rank
        rows = received.view(ep, local, c, h).transpose(0, 1).reshape(local * ep * c, h)
        sizes = torch.full((local,), ep * c, dtype=torch.int64, device=rows.device)
        out = compute(rows, sizes)
        back = out.view(local, ep, c, -1).transpose(0, 1).reshape(ep * local * c, -1)
        returned = _Waited.apply(_Started.apply(back, split, split, self.group, back_handle), back_handle)
        return unpermute(returned, perm, weights), perm, extra


class AllGatherDispatcher:
    def __init__(self, group, num_experts: int, chunks: int = 1):
        self.group, self.num_experts = group, num_experts
        self.ep = 1 if group is None else dist.get_world_size(group)
        self.num_local = num_experts // self.ep
        self.start = 0 if group is None else dist.get_rank(group) * self.num_local

    def __call__(self, tokens, weights, experts, compute, capacity=None, side=None):
        if self.ep == 1:
            return _local(tokens, weights, experts, compute, self.num_experts, capacity, side)
        if capacity is not None:
            raise ValueError("moe dispatcher allgather: dropless only (no capacity factor)")
        local = self.num_local
        all_tokens = mappings.gather_from_sequence_parallel_region(tokens, self.group, True)
        extra = side() if side is not None else None
        all_weights = mappings.gather_from_sequence_parallel_region(weights, self.group, True)
        all_experts = comm.all_gather(experts.contiguous(), 0, self.group)
        mine = (all_experts >= self.start) & (all_experts < self.start + local)
        # the other ranks' experts become one extra group, whose rows (last in expert order) are not computed
        ids = torch.where(mine, all_experts - self.start, torch.full_like(all_experts, local))
        perm = permute(all_tokens, ids, local + 1)
        sizes = perm.group_sizes.to(torch.int64)
        kept = int(sizes[:local].sum())
        out = compute(perm.rows[:kept], sizes[:local])
        out = torch.cat([out, out.new_zeros((perm.rows.shape[0] - kept, out.shape[1]))])
        partial = unpermute(out, perm, all_weights)
        mine_stats = Permutation(None, None, None, tokens.shape[0], experts.shape[1], 0)
        return mappings.reduce_scatter_to_sequence_parallel_region(partial, self.group), mine_stats, extra


register("alltoall", AllToAllDispatcher)
register("allgather", AllGatherDispatcher)
