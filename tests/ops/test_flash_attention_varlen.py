"""Attention over packed variable-length sequences: ``flash_attention_varlen`` (flash-attn's cu_seqlens convention)
and ``flash_attention(documents=...)`` against independent fp64 references — the materialising reference run per
document and concatenated (varlen), or a masked softmax with the document mask written here (the dense op) — on
the CPU path, the Triton kernels under the interpreter (cuda_emu) and the GPU: forward, lse and every gradient,
causal and not, GQA, windows, dropout (with the documented mask bits), the deterministic backward; documents of
one token, empty ones, query blocks spanning several documents and documents longer than a block; the custom ops
under opcheck; bad input named; and the block skipping that makes the cost follow the documents' lengths."""

from __future__ import annotations

import math

import pytest
import torch

from megakernels.ops import flash_attention_varlen
from megakernels.ops.attention import dropout_mask, flash_attention, flash_attention_reference

# Document lengths: a one-token document, an empty one, documents longer than the interpreter's 32-row blocks and
# 32-row blocks that hold several documents (5 + 1 + ... inside the first block).
LENGTHS = [5, 1, 40, 0, 23, 70, 3]


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _dtypes(backend):
    if backend.name == "cuda":
        return (torch.float16, torch.bfloat16)
    if backend.emulated:  # the interpreter's bf16 tl.dot is broken (docs/design.md §3)
        return (torch.float16, torch.float32)
    return (torch.float32, torch.float64)


def _tol(dtype) -> float:
    return {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]


def _packed(total_q, total_k, h, hk, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((total_q, h, d), (total_k, hk, d), (total_k, hk, d), (total_q, h, d))
    return [torch.randn(s, generator=g).to(dtype=dtype, device=device) for s in shapes]


def _grads(fn, q, k, v, do):
    """(out, lse, dq, dk, dv) of ``fn(q, k, v) -> (out, lse)`` with ``out.backward(do)``."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = fn(*leaves)
    out.backward(do)
    return [out.detach(), lse.detach()] + [t.grad for t in leaves]


def _per_document(cu_q, cu_k, causal, window=None, keep=None, dropout_p=0.0):
    """The independent reference: flash_attention_reference (materialising, fp64) on each document alone, outputs
    and lse concatenated; a document's queries without keys give zeros and lse -inf. ``keep`` [h, total_q, total_k]
    is the packed sequence's dropout mask, cut per document."""

    def fn(q, k, v):
        outs, lses = [], []
        for a, b, c, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
            if b == a:
                continue
            if e == c:
                outs.append(torch.zeros_like(q[a:b]) + 0.0 * v.sum())
                lses.append(torch.full((q.shape[1], b - a), float("-inf"), dtype=q.dtype))
                continue
            kp = None if keep is None else keep[None, :, a:b, c:e]
            o, lse = flash_attention_reference(
                q[None, a:b], k[None, c:e], v[None, c:e], causal=causal, window=window, keep=kp, dropout_p=dropout_p
            )
            outs.append(o[0])
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, -1)

    return fn


def _compare(got, want, dtype, what):
    names = ("out", "lse", "dq", "dk", "dv")
    for name, g, w in zip(names, got, want, strict=True):
        g = g.detach().cpu().double()
        if name == "lse":  # -inf exactly where the reference has it
            assert torch.equal(torch.isneginf(g), torch.isneginf(w)), f"{what}: lse -inf rows differ"
            g, w = g.masked_fill(torch.isneginf(g), 0.0), w.masked_fill(torch.isneginf(w), 0.0)
        err = (g - w).abs().max().item()
        tol = _tol(dtype) * max(1.0, w.abs().max().item())
        assert err <= tol, f"{what} {name}: max error {err:.3g} > {tol:.3g}"


def _check_varlen(backend, lengths_q, lengths_k, causal, window=None, h=4, hk=2, d=32, deterministic=False):
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    same = lengths_q == lengths_k
    for dtype in _dtypes(backend):
        q, k, v, do = _packed(int(cu_q[-1]), int(cu_k[-1]), h, hk, d, dtype, backend.device)
        got = _grads(
            lambda *t: flash_attention_varlen(
                *t,
                cu_q,
                cu_q if same else cu_k,
                max(lengths_q),
                max(lengths_k),
                causal=causal,
                window=window,
                return_lse=True,
                deterministic=deterministic,
            ),
            q,
            k,
            v,
            do,
        )
        want = _grads(_per_document(cu_q, cu_k, causal, window), *(t.cpu().double() for t in (q, k, v, do)))
        _compare(got, want, dtype, f"{dtype} causal={causal} window={window}")


@pytest.mark.parametrize("window", [None, 7, 33], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_matches_each_document_alone(triton_backend, causal, window):
    _check_varlen(triton_backend, LENGTHS, LENGTHS, causal, window)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_deterministic_backward_and_mqa(triton_backend, causal):
    _check_varlen(triton_backend, LENGTHS, LENGTHS, causal, h=3, hk=1, deterministic=True)


def test_varlen_cross_attention_with_other_key_lengths(triton_backend):
    """Without causality or a window, each document's queries attend its own keys whatever the lengths (an empty
    key document: zeros and lse -inf)."""
    _check_varlen(triton_backend, [5, 1, 40, 23, 2], [9, 33, 2, 0, 50], causal=False)


def test_varlen_causal_where_every_document_ends_aligned(triton_backend):
    """Causal with unequal lengths where bottom-right alignment per document is index alignment: one document
    (decoding: 3 queries after 40 keys), and documents whose keys end ``total_k - total_q`` after their queries."""
    _check_varlen(triton_backend, [3], [40], causal=True)
    _check_varlen(triton_backend, [0, 20, 37], [6, 20, 37], causal=True)


def test_varlen_causal_with_misaligned_documents_is_refused():
    q = torch.randn(10, 2, 8)
    k = torch.randn(12, 2, 8)
    cu_q, cu_k = _cu([6, 4]), _cu([6, 6])  # document 0's keys end with its queries, document 1's 2 after
    with pytest.raises(ValueError, match="bottom-right aligned per document.*document 0 has 6 queries and 6 keys"):
        flash_attention_varlen(q, k, k, cu_q, cu_k, 6, 6, causal=True)
    with pytest.raises(ValueError, match="bottom-right aligned per document"):
        flash_attention_varlen(q, k, k, cu_q, cu_k, 6, 6, window=3)
    flash_attention_varlen(q, k, k, cu_q, cu_k, 6, 6)  # no causality, no window: any lengths
    flash_attention_varlen(q, k, k, _cu([4, 6]), cu_k, 6, 6, causal=True)  # both end 2 keys after their queries


def test_varlen_dropout_uses_the_documented_mask(triton_backend):
    """Dropout draws the same bits as flash_attention at batch 1 over the packed sequence (``dropout_mask``): the
    reference applies that mask cut per document."""
    p, h, hk, d = 0.3, 4, 2, 32
    cu = _cu(LENGTHS)
    total = int(cu[-1])
    dev = triton_backend.device
    for causal in (False, True):
        dtype = _dtypes(triton_backend)[-1] if triton_backend.name != "cuda" else torch.float16
        q, k, v, do = _packed(total, total, h, hk, d, dtype, dev)
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64, device=dev, generator=_gen(dev, 7)))
        keep = dropout_mask(seed, 1, h, total, total, p, device=dev)[0].cpu()
        got = _grads(
            lambda *t: flash_attention_varlen(
                *t,
                cu,
                cu,
                max(LENGTHS),
                max(LENGTHS),
                causal=causal,
                dropout_p=p,
                return_lse=True,
                generator=_gen(dev, 7),
            ),
            q,
            k,
            v,
            do,
        )
        want = _grads(_per_document(cu, cu, causal, keep=keep, dropout_p=p), *(t.cpu().double() for t in (q, k, v, do)))
        _compare(got, want, dtype, f"dropout causal={causal}")


def _gen(device, seed):
    return torch.Generator(device=device).manual_seed(seed)


def test_gradcheck_cpu_fp64_varlen():
    g = torch.Generator().manual_seed(5)
    cu = _cu([3, 1, 5])
    for causal, window in ((False, None), (True, None), (True, 2)):
        q, k, v = (torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True) for s in ((9, 2, 8),) * 3)
        assert torch.autograd.gradcheck(
            lambda *t: flash_attention_varlen(*t, cu, cu, 5, 5, causal=causal, window=window), (q, k, v)
        )


# ----------------------------------------------------------------------------------------------------------------
# The dense op with documents: batches with their own ids, sq != sk, index-based causality and windows on top


def _dense_reference(q_docs, k_docs, causal, window=None, shift=0):
    """fp64 masked softmax: query i sees key j iff same id, and (index-based, ``rel = i + sk - sq + shift - j``)
    ``rel >= 0`` (causal) and ``|rel| < window`` (a window); rows that see nothing give zeros and lse -inf."""

    def fn(q, k, v):
        b, sq, h, d = q.shape
        sk, hk = k.shape[1], k.shape[2]
        kd = k.transpose(1, 2).repeat_interleave(h // hk, 1)
        vd = v.transpose(1, 2).repeat_interleave(h // hk, 1)
        s = q.transpose(1, 2) @ kd.transpose(-1, -2) / math.sqrt(d)
        rel = torch.arange(sq)[:, None] + (sk - sq + shift) - torch.arange(sk)[None, :]
        seen = (q_docs[:, :, None] == k_docs[:, None, :])[:, None]
        if causal:
            seen = seen & (rel >= 0)
        if window:
            seen = seen & (rel < window) & (rel > -window)
        s = s.masked_fill(~seen, float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0.0)[..., None])
        return (p @ vd).transpose(1, 2), lse

    return fn


def _ids(lengths_per_batch) -> torch.Tensor:
    return torch.stack(
        [torch.repeat_interleave(torch.arange(len(ls)) * 3 + 1, torch.tensor(ls)) for ls in lengths_per_batch]
    )


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dense_documents_per_batch_with_sq_ne_sk(triton_backend, causal):
    """Two batch elements with different documents; sq < sk (ids as a pair; a query id without keys: zeros)."""
    q_docs = _ids([[10, 1, 29], [40]])  # ids 1, 4, 7 / 1
    k_docs = _ids([[30, 0, 37, 3], [5, 45, 20]])  # ids 1, (4 empty), 7, 10 / 1, 4, 7
    dev = triton_backend.device
    for dtype in _dtypes(triton_backend):
        g = torch.Generator().manual_seed(1)
        q, do = (torch.randn(2, 40, 4, 32, generator=g).to(dtype=dtype, device=dev) for _ in range(2))
        k, v = (torch.randn(2, 70, 2, 32, generator=g).to(dtype=dtype, device=dev) for _ in range(2))
        docs = (q_docs.to(dev), k_docs.to(dev))
        got = _grads(lambda *t: flash_attention(*t, causal=causal, documents=docs, return_lse=True), q, k, v, do)
        want = _grads(_dense_reference(q_docs, k_docs, causal), *(t.cpu().double() for t in (q, k, v, do)))
        _compare(got, want, dtype, f"dense {dtype} causal={causal}")
        assert (got[0][0, 10:11] == 0).all()  # batch 0's id 4 has no key


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_documents_with_a_shifted_window_through_the_custom_ops(triton_backend, causal):
    """The ops' ``shift`` (context parallelism's chunk offset) with a query chunk's and a key chunk's ids, as the
    ring would pass them: the custom ops against the masked reference with the shifted band."""
    dev = triton_backend.device
    dtype = _dtypes(triton_backend)[-1]
    q_docs, k_docs = _ids([[20, 30]]), _ids([[5, 30, 15]])  # ids 1, 4 / 1, 4, 7
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 50, 2, 32, generator=g).to(dtype=dtype, device=dev)
    k, v = (torch.randn(1, 50, 2, 32, generator=g).to(dtype=dtype, device=dev) for _ in range(2))
    do = torch.randn(1, 50, 2, 32, generator=g).to(dtype=dtype, device=dev)
    scale, window, shift = 1 / math.sqrt(32), 20, 13
    emulate = triton_backend.emulated
    ops = torch.ops.megakernels
    out, lse = ops.flash_attn_fwd(
        q, k, v, causal, scale, 0.0, None, emulate, False, window, shift, q_docs.to(dev), k_docs.to(dev)
    )
    dq, dk, dv, _ = ops.flash_attn_bwd(
        do, q, k, v, out, lse, causal, scale, 0.0, None, emulate, False, window, shift, q_docs.to(dev), k_docs.to(dev)
    )
    want = _grads(_dense_reference(q_docs, k_docs, causal, window, shift), *(t.cpu().double() for t in (q, k, v, do)))
    _compare([out, lse, dq, dk, dv], want, dtype, f"shifted causal={causal}")


def test_one_document_is_attention_without_documents(backend):
    q = torch.randn(2, 37, 2, 16, device=backend.device)
    docs = torch.zeros(2, 37, dtype=torch.int64, device=backend.device)
    for causal in (False, True):
        want = flash_attention(q, q, q, causal=causal)
        torch.testing.assert_close(flash_attention(q, q, q, causal=causal, documents=docs), want)


def test_gradcheck_cpu_fp64_documents():
    g = torch.Generator().manual_seed(3)
    q_docs, k_docs = _ids([[3, 6], [9]]), _ids([[5, 6], [11]])
    q = torch.randn(2, 9, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 11, 1, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(lambda *t: flash_attention(*t, causal=True, documents=(q_docs, k_docs)), (q, k, v))


@pytest.mark.parametrize("emulate", [False, True], ids=["cpu", "triton_interpreter"])
def test_opcheck_with_documents(emulate):
    if emulate:
        from megakernels.triton import interpreting

        if not interpreting():
            pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1)")
    g = torch.Generator().manual_seed(4)
    q, k, v, do = (torch.randn(1, 20, 2, 16, generator=g) for _ in range(4))
    q_docs = k_docs = _ids([[7, 13]])
    seed = torch.tensor(12345)
    args = (q, k, v, True, 0.25, 0.2, seed, emulate, False, 0, 0, q_docs, k_docs)
    torch.library.opcheck(torch.ops.megakernels.flash_attn_fwd.default, args)
    out, lse = torch.ops.megakernels.flash_attn_fwd(*args)
    torch.library.opcheck(
        torch.ops.megakernels.flash_attn_bwd.default,
        (do, q, k, v, out, lse, True, 0.25, 0.2, seed, emulate, False, 5, 2, q_docs, k_docs),
    )
    leaves = tuple(t.clone().requires_grad_(True) for t in (q, k, v))
    torch.library.opcheck(torch.ops.megakernels.flash_attn_fwd.default, leaves + args[3:])


# ----------------------------------------------------------------------------------------------------------------
# Bad input


def _varlen_args(**over):
    cu = _cu([3, 5])
    a = dict(q=torch.randn(8, 2, 8), k=torch.randn(8, 2, 8), v=torch.randn(8, 2, 8), cu_seqlens_q=cu)
    a.update(cu_seqlens_k=cu, max_seqlen_q=5, max_seqlen_k=5)
    a.update(over)
    return a


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(cu_seqlens_q=torch.tensor([0, 3, 8])), "cu_seqlens_q must be int32"),
        (dict(cu_seqlens_k=torch.tensor([[0, 8]], dtype=torch.int32)), "cu_seqlens_k must be 1-D"),
        (dict(cu_seqlens_q=torch.tensor([8], dtype=torch.int32)), "cu_seqlens_q must be 1-D"),
        (dict(cu_seqlens_q=torch.tensor([1, 3, 8], dtype=torch.int32)), "cu_seqlens_q must start at 0"),
        (dict(cu_seqlens_q=torch.tensor([0, 5, 3, 8], dtype=torch.int32)), "cu_seqlens_q must be non-decreasing"),
        (dict(cu_seqlens_k=torch.tensor([0, 3, 7], dtype=torch.int32)), "cu_seqlens_k's last entry 7 must equal .* 8"),
        (dict(max_seqlen_q=4), "max_seqlen_q=4 is shorter than the longest document \\(5"),
        (dict(max_seqlen_k=-1), "max_seqlen_k must be a non-negative int"),
        (
            dict(cu_seqlens_k=torch.tensor([0, 8], dtype=torch.int32), max_seqlen_k=8),
            "cu_seqlens_q has 3 entries and cu_seqlens_k 2",
        ),
        (dict(q=torch.randn(1, 8, 2, 8)), "q must be 3-D"),
        (dict(v=torch.randn(8, 3, 8)), "v has shape"),
    ],
)
def test_varlen_bad_input_is_named(over, match):
    with pytest.raises((ValueError, TypeError), match=match):
        flash_attention_varlen(**_varlen_args(**over))


def test_bad_documents_are_named():
    q = torch.randn(2, 6, 2, 8)
    k = torch.randn(2, 7, 2, 8)
    ok = torch.zeros(2, 6, dtype=torch.int32)
    with pytest.raises(ValueError, match="documents must be non-decreasing"):
        flash_attention(q, q, q, documents=torch.tensor([[0, 0, 1, 1, 0, 2]] * 2))
    with pytest.raises(ValueError, match="documents must be int32 or int64"):
        flash_attention(q, q, q, documents=ok.float())
    with pytest.raises(ValueError, match=r"documents must have shape \[batch, seqlen\] = \[2, 6\]"):
        flash_attention(q, q, q, documents=ok[:1])
    with pytest.raises(ValueError, match="documents as one tensor needs sq == sk"):
        flash_attention(q, k, k, documents=ok)
    with pytest.raises(ValueError, match=r"documents\[1\] \(k_docs\) must have shape"):
        flash_attention(q, k, k, documents=(ok, ok))
    with pytest.raises(TypeError, match="documents must be a"):
        flash_attention(q, q, q, documents=[ok])


# ----------------------------------------------------------------------------------------------------------------
# Block skipping: the work follows the documents


def test_cpu_blocks_skip_other_documents():
    """The CPU path's query blocks multiply only the keys between their first row's document start and their last
    row's document end: for 16 documents of 512 tokens packed into 8192, causal, the key columns visited are
    within 1.25x of 1/16 of the single document's, and every visible key is visited."""
    from megakernels.ops import _attention_cpu
    from megakernels.ops.attention import document_ranges

    s, n = 8192, 16
    docs = torch.arange(n).repeat_interleave(s // n)[None]
    spans = document_ranges(docs, docs)[0][0].tolist()
    rows = _attention_cpu._rows_per_block(1, 8, s, 4)
    packed = sum(
        (k1 - k0) * (stop - start) for start, stop, k0, k1 in _attention_cpu._blocks(s, s, rows, True, spans=spans)
    )
    dense = sum((k1 - k0) * (stop - start) for start, stop, k0, k1 in _attention_cpu._blocks(s, s, rows, True))
    assert packed <= 1.25 * dense / n, (packed, dense)
    visible = n * (s // n) * (s // n + 1) // 2  # (query, key) pairs a causal document of 512 holds
    assert packed >= visible


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_kernel_schedules_skip_other_documents(causal):
    """The sm_90 launches' schedules (what the kernels' device-side bounds give; tests/triton/test_schedules.py
    holds them together): each program visits exactly the blocks of the other side that hold a visible pair, and
    an 8k pack of 16 documents runs about 1/16 of one 8k document's tile iterations."""
    from megakernels.ops.attention import document_ranges
    from megakernels.triton import flash_attention as fa

    s, d, h, n = 8192, 128, 2, 16
    docs = torch.arange(n).repeat_interleave(s // n)[None]
    ranges = document_ranges(docs, docs)
    q, lse = _meta(1, s, h, d), _meta(1, h, s, dtype=torch.float32)
    delta = _meta(2, 1, h, s, dtype=torch.float32)
    fcfg, bcfg = fa.candidates(fa.FWD_CONFIGS, 90, d)[0], fa.candidates(fa.BWD_CONFIGS, 90, d)[0]
    totals = {}
    for rng in (None, ranges):
        fwd = fa.forward_launch(q, q, q, q, lse, lse, causal, 0.1, 0.0, fcfg, ranges=rng)
        bwd, dq = fa.backward_launches(
            q, q, q, q, q, lse, delta, q, q, q, lse, causal, 0.1, 0.0, bcfg, True, ranges=rng
        )[1:]
        for launch in (fwd, bwd, dq):
            runs = [sum(it.values()) for it in fa.SCHEDULES[launch.name](launch).iterations()]
            totals[launch.name, rng is not None] = sum(runs)
            if rng is None:
                continue
            bm, bn = launch.arg("BLOCK_M"), launch.arg("BLOCK_N")
            pos = torch.arange(s)
            seen = docs[0][:, None] == docs[0][None, :]
            if causal:
                seen &= pos[:, None] >= pos[None, :]
            pairs = seen.view(s // bm, bm, s // bn, bn).any(3).any(1)  # [query block, key block]: a visible pair
            ids = launch.program_ids()
            if launch is bwd:  # per key block, the query blocks of each head of its group
                want = [int(pairs.sum(0)[x]) * launch.arg("GROUP") for x, _ in ids]
            elif launch is fwd and causal:  # grid (b * h, blocks), the heaviest query block first
                want = [int(pairs.sum(1)[launch.grid[1] - 1 - y]) for _, y in ids]
            else:
                want = [int(pairs.sum(1)[x]) for x, _ in ids]
            assert runs == want, launch.name
    for name in ("fa_fwd_kernel", "fa_bwd_kernel", "fa_bwd_dq_kernel"):
        ratio = totals[name, True] / totals[name, False]
        assert ratio <= 1.3 / n, (name, ratio)
