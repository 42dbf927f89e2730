"""Context parallelism: the load-balanced chunk layout, and ring attention against unsplit attention in fp64
(forward and every gradient, causal and not, GQA, cp 2 and 4, with and without a sliding window, over packed
documents, with attention sinks counted once per query, with v's head dim differing from q/k's), with each
key/value transfer in flight while the held chunk is computed. One world of 4 gloo processes."""

from __future__ import annotations

import pytest
import torch

import megakernels.parallel as mp
from megakernels.ops.attention import flash_attention_reference
from megakernels.parallel import context
from tests.parallel.checks import Checks, assert_close, randn

CHECKS = Checks()
B, S, HQ, HKV, D = 2, 16, 4, 2, 8


def test_chunks_pair_an_early_and_a_late_block():
    assert context.chunk_bounds(16, 2, 0) == [(0, 4), (12, 16)]
    assert context.chunk_bounds(16, 2, 1) == [(4, 8), (8, 12)]
    assert context.positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    full = torch.arange(16)
    parts = [context.split_for_cp(full, 0, 4, r) for r in range(4)]
    assert sorted(torch.cat(parts).tolist()) == list(range(16))
    with pytest.raises(ValueError, match="seq_length=12 is not divisible by 2·cp = 8"):
        context.chunk_bounds(12, 4, 0)


def test_causal_work_is_balanced():
    """Every rank attends the same number of (query, key) pairs under the causal mask."""
    for cp in (2, 4, 8):
        s = 16 * cp
        work = []
        for r in range(cp):
            pos = context.positions(s, cp, r)
            work.append(int(sum(p + 1 for p in pos.tolist())))
        assert max(work) - min(work) == 0 if cp == 2 else max(work) / min(work) < 1.01, work


def _reference(q, k, v, causal):
    out, _ = flash_attention_reference(q, k, v, causal=causal)
    return out


@CHECKS.add("ring_attention_matches_unsplit_attention_forward_and_backward")
def _(rank, world):
    for cp in (2, 4):
        mp.initialize(cp=cp)
        r = mp.cp_rank()
        for causal in (True, False):
            for hkv in (HQ, HKV):
                what = f"cp{cp} causal={causal} heads_kv={hkv}"
                q, k, v = (randn(B, S, h, D, seed=s).double() for s, h in ((1, HQ), (2, hkv), (3, hkv)))
                dout = randn(B, S, HQ, D, seed=4).double()
                full = [t.clone().requires_grad_(True) for t in (q, k, v)]
                ref = _reference(*full, causal)
                ref.backward(dout)
                local = [context.split_for_cp(t, 1, cp, r).clone().requires_grad_(True) for t in (q, k, v)]
                out = context.ring_attention(*local, causal=causal)
                out.backward(context.split_for_cp(dout, 1, cp, r))
                assert_close(out, context.split_for_cp(ref, 1, cp, r), f"{what}: output", rtol=1e-10)
                for name, mine, f in zip("qkv", local, full):
                    assert_close(mine.grad, context.split_for_cp(f.grad, 1, cp, r), f"{what}: d{name}", rtol=1e-10)
                gathered = context.gather_from_cp(out.detach(), 1, mp.cp_group())
                assert_close(gathered, ref, f"{what}: gathered output", rtol=1e-10)
        mp.destroy()


@CHECKS.add("ring_attention_with_a_value_head_dim_of_its_own_matches_unsplit_attention")
def _(rank, world):
    """d_v != d_qk (multi-head latent attention): out and dv in d_v, dq and dk in d_qk, causal and windowed."""
    mp.initialize(cp=2)
    r, dv = mp.cp_rank(), 2 * D
    for causal, window in ((True, None), (False, None), (True, 6)):
        what = f"cp2 d_v={dv} causal={causal} window={window}"
        q, k = randn(B, S, HQ, D, seed=11).double(), randn(B, S, HKV, D, seed=12).double()
        v, dout = randn(B, S, HKV, dv, seed=13).double(), randn(B, S, HQ, dv, seed=14).double()
        full = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref, _ = flash_attention_reference(*full, causal=causal, window=window)
        ref.backward(dout)
        local = [context.split_for_cp(t, 1, 2, r).clone().requires_grad_(True) for t in (q, k, v)]
        out = context.ring_attention(*local, causal=causal, window=window)
        out.backward(context.split_for_cp(dout, 1, 2, r))
        assert_close(out, context.split_for_cp(ref, 1, 2, r), f"{what}: output", rtol=1e-10)
        for name, mine, f in zip("qkv", local, full):
            assert_close(mine.grad, context.split_for_cp(f.grad, 1, 2, r), f"{what}: d{name}", rtol=1e-10)
    mp.destroy()


def _windowed_reference(q, k, v, causal, window):
    """fp64 attention masked by hand: causal query i sees key j iff i - w < j <= i, else iff |i - j| < w."""
    pos = torch.arange(q.shape[1])
    rel = pos[:, None] - pos[None, :]
    hidden = (rel >= window) | ((rel < 0) if causal else (rel <= -window))
    kk, vv = (t.repeat_interleave(q.shape[2] // t.shape[2], 2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) / q.shape[-1] ** 0.5
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores.masked_fill(hidden, float("-inf")), -1), vv)


@CHECKS.add("windowed_ring_attention_matches_unsplit_windowed_attention_and_skips_unseen_chunks")
def _(rank, world):
    """Sliding windows shorter than a chunk, between one and two chunks, and longer: every rank's rows and
    gradients equal single-device windowed attention; a (query chunk, key chunk) pair no query's window reaches is
    never computed (the attentions each rank runs are exactly the pairs the mask meets)."""
    for cp in (2, 4):
        mp.initialize(cp=cp)
        r = mp.cp_rank()
        c = S // (2 * cp)
        chunks = [r, 2 * cp - 1 - r]
        for causal in (True, False):
            for window in (2, 3, 5, 9):  # window 1: dq = dk = 0 exactly (a softmax over one key)
                what = f"cp{cp} causal={causal} window={window}"
                q, k, v = (randn(B, S, h, D, seed=s).double() for s, h in ((1, HQ), (2, HKV), (3, HKV)))
                dout = randn(B, S, HQ, D, seed=4).double()
                full = [t.clone().requires_grad_(True) for t in (q, k, v)]
                ref = _windowed_reference(*full, causal, window)
                ref.backward(dout)
                local = [context.split_for_cp(t, 1, cp, r).clone().requires_grad_(True) for t in (q, k, v)]
                with mp.record_events() as events:
                    out = context.ring_attention(*local, causal=causal, window=window)
                out.backward(context.split_for_cp(dout, 1, cp, r))
                assert_close(out, context.split_for_cp(ref, 1, cp, r), f"{what}: output", rtol=1e-10)
                for name, mine, f in zip("qkv", local, full):
                    assert_close(mine.grad, context.split_for_cp(f.grad, 1, cp, r), f"{what}: d{name}", rtol=1e-10)
                met = 0
                for a in chunks:
                    for b in range(2 * cp):
                        d = [(a - b) * c + x - y for x in range(c) for y in range(c)]  # query - key positions
                        met += any((0 <= e < window) if causal else (abs(e) < window) for e in d)
                computed = sum(e == ("compute", "cp_attention") for e in events)
                assert computed == met, f"{what}: {computed} partial attentions, {met} chunk pairs meet the window"
        mp.destroy()


def _documents_reference(q, k, v, causal, window, docs):
    """fp64 attention masked by hand: within each document only, then causal / windowed as above."""
    pos = torch.arange(q.shape[1])
    rel = pos[:, None] - pos[None, :]
    hidden = (rel < 0) if causal else torch.zeros_like(rel, dtype=torch.bool)
    if window:
        hidden = hidden | (rel >= window) | (rel <= -window)
    hidden = hidden[None, None] | (docs[:, None, :, None] != docs[:, None, None, :])
    kk, vv = (t.repeat_interleave(q.shape[2] // t.shape[2], 2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) / q.shape[-1] ** 0.5
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores.masked_fill(hidden, float("-inf")), -1), vv)


@CHECKS.add("ring_attention_over_packed_documents_matches_unsplit_document_masked_attention")
def _(rank, world):
    """Packed documents whose boundaries fall inside chunks, on them, and span several chunks (and one document
    per sample in the second sample): every rank's rows and gradients equal single-device attention masked to
    each document, causal or not, with and without a window."""
    lengths = ([3, 5, 1, 7], [16])
    docs = torch.stack([torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n)) for n in lengths]).int()
    for cp in (2, 4):
        mp.initialize(cp=cp)
        r = mp.cp_rank()
        for causal, window in ((True, 0), (False, 0), (True, 3)):
            what = f"cp{cp} causal={causal} window={window} documents"
            q, k, v = (randn(B, S, h, D, seed=s).double() for s, h in ((1, HQ), (2, HKV), (3, HKV)))
            dout = randn(B, S, HQ, D, seed=4).double()
            full = [t.clone().requires_grad_(True) for t in (q, k, v)]
            ref = _documents_reference(*full, causal, window, docs)
            ref.backward(dout)
            local = [context.split_for_cp(t, 1, cp, r).clone().requires_grad_(True) for t in (q, k, v)]
            out = context.ring_attention(*local, causal=causal, window=window or None, documents=docs)
            out.backward(context.split_for_cp(dout, 1, cp, r))
            assert_close(out, context.split_for_cp(ref, 1, cp, r), f"{what}: output", rtol=1e-10)
            for name, mine, f in zip("qkv", local, full):
                assert_close(mine.grad, context.split_for_cp(f.grad, 1, cp, r), f"{what}: d{name}", rtol=1e-10)
        with pytest.raises(ValueError, match=r"documents must have shape \[batch, seqlen\] = \[2, 16\]"):
            context.ring_attention(*local, causal=True, documents=docs[:, :8])
        mp.destroy()


@CHECKS.add("ring_attention_with_sinks_counts_each_sink_once_per_query")
def _(rank, world):
    """Attention sinks under the ring: every rank's rows and gradients equal single-device attention whose scores
    have the sink column once (not once per ring step or partial attention), causal or not, with a window, over
    documents; the sinks' gradient summed over the ranks (as the gradient reduction sums it) is the unsplit one."""
    import torch.distributed as dist

    lengths = ([3, 5, 1, 7], [16])
    docs = torch.stack([torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n)) for n in lengths]).int()
    for cp in (2, 4):
        mp.initialize(cp=cp)
        r = mp.cp_rank()
        for causal, window, documents in ((True, 0, None), (False, 0, None), (True, 3, None), (True, 0, docs)):
            what = f"cp{cp} causal={causal} window={window} documents={documents is not None} sinks"
            q, k, v = (randn(B, S, h, D, seed=s).double() for s, h in ((1, HQ), (2, HKV), (3, HKV)))
            dout = randn(B, S, HQ, D, seed=4).double()
            sinks = torch.tensor([-1.5, 0.0, 0.7, 2.5], dtype=torch.float64)
            full = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
            ref = _sink_reference(*full, causal, window, documents)
            ref.backward(dout)
            local = [context.split_for_cp(t, 1, cp, r).clone().requires_grad_(True) for t in (q, k, v)]
            mine = sinks.clone().requires_grad_(True)
            out = context.ring_attention(*local, causal=causal, window=window or None, documents=documents, sinks=mine)
            out.backward(context.split_for_cp(dout, 1, cp, r))
            dsinks = mine.grad.clone()
            dist.all_reduce(dsinks, group=mp.cp_group())
            assert_close(out, context.split_for_cp(ref, 1, cp, r), f"{what}: output", rtol=1e-10)
            for name, g, f in zip("qkv", local, full):
                assert_close(g.grad, context.split_for_cp(f.grad, 1, cp, r), f"{what}: d{name}", rtol=1e-10)
            assert_close(dsinks, full[3].grad, f"{what}: dsinks summed over the ranks", rtol=1e-10)
        mp.destroy()


def _sink_reference(q, k, v, sinks, causal, window, docs):
    """fp64 attention masked by hand (causal, window, documents as above) whose scores get one more column per
    head, ``sinks[h]``, of value zero."""
    pos = torch.arange(q.shape[1])
    rel = pos[:, None] - pos[None, :]
    hidden = (rel < 0) if causal else torch.zeros_like(rel, dtype=torch.bool)
    if window:
        hidden = hidden | (rel >= window) | (rel <= -window)
    hidden = hidden[None, None]
    if docs is not None:
        hidden = hidden | (docs[:, None, :, None] != docs[:, None, None, :])
    kk, vv = (t.repeat_interleave(q.shape[2] // t.shape[2], 2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(hidden, float("-inf"))
    b, h, s, _ = scores.shape
    probs = torch.softmax(torch.cat((scores, sinks[None, :, None, None].expand(b, h, s, 1)), -1), -1)[..., :s]
    return torch.einsum("bhqk,bkhd->bqhd", probs, vv)


def _overlapped(events) -> list[str]:
    """Each transfer (launch -> its wait, matched per kind in order) has some attention computed in between;
    returns the kinds of the transfers that did not."""
    open_, bad = {}, []
    for event, detail in events:
        if event == "launch":
            open_.setdefault(detail, []).append(False)
        elif event == "compute":
            for pending in open_.values():
                pending[:] = [True] * len(pending)
        elif event == "wait":
            if not open_[detail].pop(0):
                bad.append(detail)
    return bad


@CHECKS.add("each_transfer_is_in_flight_while_the_held_chunk_is_computed")
def _(rank, world):
    mp.initialize(cp=4)
    r = mp.cp_rank()
    q, k, v = (context.split_for_cp(randn(B, S, HQ, D, seed=s), 1, 4, r).requires_grad_(True) for s in (5, 6, 7))
    with mp.record_events() as fwd:
        out = context.ring_attention(q, k, v, causal=True)
    with mp.record_events() as bwd:
        out.sum().backward()
    launches = lambda ev, kind: sum(e == ("launch", kind) for e in ev)  # noqa: E731
    assert launches(fwd, "cp_kv") == 3 and launches(bwd, "cp_kv") == 3 and launches(bwd, "cp_dkv") == 4
    assert _overlapped(fwd) == [], fwd
    # the last gradient hop (back to the owner) has nothing left to overlap with
    assert _overlapped(bwd) == ["cp_dkv"], bwd


def _world(rank, world_size):
    return CHECKS.run(rank, world_size)


world = CHECKS.fixture(4, _world)


@pytest.mark.parametrize("name", CHECKS.names())
def test_context(world, name):
    CHECKS.assert_passed(world, name)
