"""Context parallelism: the sequence split over the ranks of ``state.cp_group()``, attention as ring attention.

**Layout.** A sequence of ``s`` tokens is cut into ``2·cp`` equal chunks; rank ``i`` holds chunks ``i`` and
``2·cp−1−i``, concatenated (``split_for_cp``). Under causal attention a query chunk's work grows with its position;
pairing an early chunk with its mirror gives every rank the same work (``positions`` gives each local token's
position, which rotary embeddings and position tables use).

**Ring attention.** Every rank keeps its queries; key/value chunks travel around the ring (rank ``i`` sends to
``i+1``), each transfer posted before the attention on the chunk already held, so communication overlaps compute.
Partial results merge exactly through their log-sum-exp: with ``(o₁, l₁)`` and ``(o₂, l₂)`` over disjoint keys,
``l = log(e^l₁ + e^l₂)`` and ``o = e^(l₁−l)·o₁ + e^(l₂−l)·o₂``. Causally, at ring step ``t`` rank ``i`` holds the
keys of rank ``j = (i − t) mod cp``:

- ``t = 0`` (its own keys): query chunk 0 against key chunk 0 causally; query chunk 1 against both key chunks
  with the bottom-right aligned causal mask (it sees all of chunk 0 and chunk 1 causally);
- ``j < i``: both query chunks see key chunk 0 of rank ``j`` entirely, and its chunk 1 not at all;
- ``j > i``: query chunk 0 sees nothing of rank ``j``; query chunk 1 sees both its chunks entirely.

So every step costs every rank the same: half of the queries against all held keys, or all queries against half.

**Sliding window** (``window=w``, Mistral). A rank's partial attentions are then one per (query chunk, key chunk)
pair, each a windowed FlashAttention whose diagonal is moved by the chunks' absolute offset (``shift = (a − b)·c``
for query chunk ``a`` and key chunk ``b`` of ``c`` tokens), so every query sees exactly the keys ``i − w < j ≤ i``
(causal) or ``|i − j| < w`` of the whole sequence; a pair that no query's window reaches is skipped, and so is a ring
step whose held chunks no query here sees (no compute: the chunks still travel on, as other ranks need them).
A window as long as the sequence is no window.

**Attention sinks** (``sinks``, one logit per query head) are a column of every query row's softmax, not of a key
chunk: the partial results hold keys only, and the sink joins once, when they are all merged (one more term of the
log-sum-exp whose value is zero). Its gradient comes once from the final output and log-sum-exp of this rank's rows
(``-sum P_sink · rowsum(dO · O)``); the ranks' shares are summed by the data-and-context-parallel gradient reduction,
as every parameter's are.

**Backward** runs the ring again. With the final output and log-sum-exp, FlashAttention's backward of each partial
gives that partial's exact share of dq, dk and dv. The key/value gradients travel with their chunk and are
accumulated by every rank that attended it; one last hop returns them to their owner. The key/value transfer of the
next step is posted before the compute of this one, and each gradient transfer is waited for only after the next
compute.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megakernels.parallel import comm


def chunk_bounds(seq_length: int, cp: int, rank: int) -> list[tuple[int, int]]:
    """The two ``[start, end)`` token ranges rank ``rank`` of ``cp`` holds of a ``seq_length`` sequence.

    Raises:
        ValueError: ``seq_length`` not divisible by ``2·cp``.
    """
    if seq_length % (2 * cp):
        raise ValueError(f"context parallelism: seq_length={seq_length} is not divisible by 2·cp = {2 * cp}")
    c = seq_length // (2 * cp)
    return [(rank * c, (rank + 1) * c), ((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]


def positions(seq_length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Positions (int64 ``[seq_length // cp]``) of the tokens rank ``rank`` holds, in its local order."""
    return torch.cat([torch.arange(a, b, device=device) for a, b in chunk_bounds(seq_length, cp, rank)])


def split_for_cp(t: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s two chunks of ``t`` along ``dim`` (the full sequence), concatenated."""
    if cp == 1:
        return t
    return torch.cat([t.narrow(dim, a, b - a) for a, b in chunk_bounds(t.shape[dim], cp, rank)], dim)


def gather_from_cp(local: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The full sequence from every rank's ``split_for_cp`` part (the inverse; not differentiable)."""
    cp = dist.get_world_size(group)
    if cp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    c = local.shape[dim] // 2
    first = [p.narrow(dim, 0, c) for p in parts]
    second = [p.narrow(dim, c, c) for p in parts]
    return torch.cat(first + second[::-1], dim)


# ---- the partial attentions --------------------------------------------------------------------------------------


def _emulate(q: torch.Tensor) -> bool:
    from megakernels._backend import emulate_for

    return emulate_for("ring_attention", q)


def _fwd(q, k, v, causal, scale, emulate, window=0, shift=0, docs=(None, None)):
    return torch.ops.megakernels.flash_attn_fwd(
        q, k, v, causal, scale, 0.0, None, emulate, False, window, shift, docs[0], docs[1]
    )


def _bwd(dout, q, k, v, out, lse, causal, scale, emulate, window=0, shift=0, docs=(None, None)):
    dq, dk, dv, _ = torch.ops.megakernels.flash_attn_bwd(
        dout, q, k, v, out, lse, causal, scale, 0.0, None, emulate, False, window, shift, docs[0], docs[1]
    )
    return dq, dk, dv


def _chunk_ids(documents: torch.Tensor | None, rank: int, cp: int, c: int) -> torch.Tensor | None:
    """The document ids of the two chunks rank ``rank`` holds (``rank`` and ``2·cp − 1 − rank``, ``c`` tokens
    each) out of the whole sequence's ``[b, 2·cp·c]``: non-decreasing, as the chunks are in sequence order."""
    if documents is None:
        return None
    a, b = rank, 2 * cp - 1 - rank
    return torch.cat([documents[:, a * c : (a + 1) * c], documents[:, b * c : (b + 1) * c]], 1).contiguous()


def _pair(q_ids, k_ids, rows: slice, keys: slice):
    """The (query, key) document ids of one partial attention, or (None, None) without documents."""
    if q_ids is None:
        return None, None
    return q_ids[:, rows].contiguous(), k_ids[:, keys].contiguous()


def _acc_dtype(q: torch.Tensor) -> torch.dtype:
    """Partial results are merged in fp32 (fp64 for fp64 inputs)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _plan(step: int, rank: int, cp: int, causal: bool, c: int, window: int = 0):
    """The partial attentions of ring step ``step``: ``(query slice, key slice, causal, window, shift)`` over the
    local query chunks and the held key chunks (each of ``c`` tokens). Without a window (0) the module docstring's
    plan; with one, a windowed attention per (query chunk, key chunk) pair that some query's window reaches, its
    diagonal moved by the chunks' offset."""
    both, first, second = slice(0, 2 * c), slice(0, c), slice(c, 2 * c)
    if window:
        src = (rank - step) % cp
        plan = []
        for rows, a in ((first, rank), (second, 2 * cp - 1 - rank)):
            for keys, b in ((first, src), (second, 2 * cp - 1 - src)):
                shift = (a - b) * c  # query x and key y are (a - b)·c + x - y apart
                near, far = shift - (c - 1), shift + (c - 1)  # the closest and farthest (query - key) of the pair
                if near >= window or far <= (-1 if causal else -window):
                    continue  # no query of the chunk sees a key of it
                plan.append((rows, keys, causal, window, shift))
        return plan
    if not causal:
        return [(both, both, False, 0, 0)]
    if step == 0:
        return [(first, first, True, 0, 0), (second, both, True, 0, 0)]
    src = (rank - step) % cp
    return [(both, first, False, 0, 0)] if src < rank else [(second, both, False, 0, 0)]


def _merge(out, lse, rows, o, l):
    """Merge the partial ``(o, l)`` of query rows ``rows`` into the running fp32 ``(out, lse)``."""
    o, l = o.to(out.dtype), l.to(lse.dtype)
    cur_o, cur_l = out[:, rows], lse[:, :, rows]
    new_l = torch.logaddexp(cur_l, l)
    # exp(-inf - -inf) is nan: a row that saw nothing yet (cur_l = -inf) takes the partial as it is
    a = torch.where(torch.isneginf(cur_l), 0.0, torch.exp(cur_l - new_l))
    b = torch.where(torch.isneginf(l), 0.0, torch.exp(l - new_l))
    out[:, rows] = cur_o * a.transpose(1, 2).unsqueeze(-1) + o * b.transpose(1, 2).unsqueeze(-1)
    lse[:, :, rows] = new_l


def _merge_sinks(out, lse, sinks) -> None:
    """Merge the sinks (``[h]``: a zero-valued column of logit ``sinks[h]`` in every row) into the merged fp32
    ``(out [b, s, h, d], lse [b, h, s])`` of all keys, in place."""
    sink = sinks.to(lse.dtype)[None, :, None]
    new_l = torch.logaddexp(lse, sink)
    a = torch.where(torch.isneginf(lse), 0.0, torch.exp(lse - new_l))
    out.mul_(a.transpose(1, 2).unsqueeze(-1))
    lse.copy_(new_l)


class _Ring:
    """Posts a send to the next rank and a receive from the previous one; ``wait()`` returns the received."""

    def __init__(self, tensors: list[torch.Tensor], group, name: str):
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        nxt = dist.get_global_rank(group, (self.rank + 1) % self.size)
        prv = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self.recv = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, prv, group) for r in self.recv]
        self.name = name
        comm.record("launch", name)
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            w.wait()
        comm.record("wait", self.name)
        return self.recv


class RingAttention(torch.autograd.Function):
    """Autograd of ``ring_attention`` (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, group, window: int = 0, documents=None, sinks=None):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        emulate = _emulate(q)
        c = q.shape[1] // 2
        b, s, h, _ = q.shape
        acc = _acc_dtype(q)
        out = torch.zeros(q.shape[:3] + v.shape[3:], dtype=acc, device=q.device)  # v's head dim
        lse = torch.full((b, h, s), -math.inf, dtype=acc, device=q.device)
        held = (k, v)
        q_ids = _chunk_ids(documents, rank, cp, c)
        for step in range(cp):
            ring = _Ring(list(held), group, "cp_kv") if step < cp - 1 else None
            k_ids = _chunk_ids(documents, (rank - step) % cp, cp, c)  # the held chunks' (their owner's)
            for rows, keys, cz, w, shift in _plan(step, rank, cp, causal, c, window):
                docs = _pair(q_ids, k_ids, rows, keys)
                o, l = _fwd(q[:, rows], held[0][:, keys], held[1][:, keys], cz, scale, emulate, w, shift, docs)
                comm.record("compute", "cp_attention")
                _merge(out, lse, rows, o, l)
            if ring is not None:
                held = tuple(ring.wait())
        if sinks is not None:
            _merge_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.causal, ctx.scale, ctx.group, ctx.emulate, ctx.window = causal, scale, group, emulate, window
        ctx.documents = documents
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        group, causal, scale, emulate = ctx.group, ctx.causal, ctx.scale, ctx.emulate
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        c = q.shape[1] // 2
        dout = dout.contiguous()
        acc = _acc_dtype(q)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        held, incoming = (k, v), None
        q_ids = _chunk_ids(ctx.documents, rank, cp, c)
        for step in range(cp):
            ring = _Ring(list(held), group, "cp_kv") if step < cp - 1 else None
            dk = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv = torch.zeros(v.shape, dtype=acc, device=v.device)
            k_ids = _chunk_ids(ctx.documents, (rank - step) % cp, cp, c)
            for rows, keys, cz, w, shift in _plan(step, rank, cp, causal, c, ctx.window):
                pq, pk, pv = _bwd(
                    dout[:, rows],
                    q[:, rows],
                    held[0][:, keys],
                    held[1][:, keys],
                    out[:, rows],
                    lse[:, :, rows].contiguous(),
                    cz,
                    scale,
                    emulate,
                    w,
                    shift,
                    _pair(q_ids, k_ids, rows, keys),
                )
                comm.record("compute", "cp_attention_backward")
                dq[:, rows] += pq.to(acc)
                dk[:, keys] += pk.to(acc)
                dv[:, keys] += pv.to(acc)
            if incoming is not None:  # what the ranks before this one added to the held chunk's gradients
                prev_dk, prev_dv = incoming.wait()
                dk += prev_dk
                dv += prev_dv
            incoming = _Ring(
                [dk, dv], group, "cp_dkv"
            )  # on to the next holder; the last hop returns them to their owner
            if ring is not None:
                held = tuple(ring.wait())
        dk, dv = incoming.wait()
        dsinks = None
        if sinks is not None:
            from megakernels.ops._sinks import sinks_grad

            dsinks = sinks_grad(dout, out, lse, sinks)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, dsinks


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    group=None,
    window: int | None = None,
    documents: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention over a sequence split by ``split_for_cp`` over ``group`` (default ``state.cp_group()``).

    Args:
        q: this rank's queries ``[batch, s/cp, heads, head_dim]`` (its two chunks); k, v: its keys and values
            ``[batch, s/cp, heads_kv, head_dim]`` and ``[batch, s/cp, heads_kv, head_dim_v]`` (GQA allowed; v's
            head dim may differ from q/k's, as in multi-head latent attention).
        causal: causal over the *whole* sequence's positions.
        softmax_scale: default ``1 / sqrt(head_dim)`` (q's).
        window: sliding-window attention over the whole sequence's positions (``flash_attention``'s ``window``);
            None: every key.
        documents: packed sequences: int ``[batch, s]``, the *whole* sequence's document ids (non-decreasing);
            a token attends only within its document.
        sinks: fp32 ``[heads]`` attention sinks (``flash_attention``'s), counted once per query row; their
            gradient is this rank's rows' share.

    Returns:
        ``[batch, s/cp, heads, head_dim_v]``, this rank's rows of the full attention; differentiable.

    Raises:
        ValueError: a local sequence that is not two equal chunks, a window that is not a positive int, or bad
            sinks.
    """
    from megakernels.ops.attention import check_sinks, check_window

    window = check_window("ring_attention", window)
    sinks = check_sinks("ring_attention", sinks, q)
    if group is None:
        from megakernels.parallel import state

        group = state.cp_group()
    if q.shape[1] % 2 or k.shape[1] != q.shape[1]:
        raise ValueError(
            f"ring_attention: q and k must hold the same two equal chunks (an even local length), got "
            f"{q.shape[1]} queries and {k.shape[1]} keys"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if window >= q.shape[1] * dist.get_world_size(group):  # the band holds the whole sequence
        window = 0
    if documents is not None:
        from megakernels.ops.attention import check_documents

        whole = q.new_empty((q.shape[0], q.shape[1] * dist.get_world_size(group), 1, 1))  # the sequence's shape
        documents = check_documents("ring_attention", documents, whole, whole)[0]
    return RingAttention.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), bool(causal), scale, group, window, documents, sinks
    )
