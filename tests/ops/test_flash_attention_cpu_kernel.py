"""The C++ CPU FlashAttention kernel (csrc/flash_attention; torch.ops.megakernels.flash_attn_fwd_cpu /
flash_attn_bwd_cpu), called directly and through flash_attention on the CPU, against the materialising fp64
reference (out, lse, dq, dk, dv), sliding windows (with their shift) and packed documents against a mask built
here, dropout against the same keep-mask (megakernels.ops.attention.dropout_mask, the GPU kernels' bits); and the
routing: covered calls run it, fp64 / head_dim > 256 keep the blocked PyTorch path
(megakernels/ops/_attention_cpu.py)."""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import megakernels
from megakernels.ops import _attention_cpu
from megakernels.ops.attention import document_ranges, dropout_mask, flash_attention, flash_attention_reference

# (batch, sq, sk, heads, kv_heads, head_dim): shorter than a block, sq != sk both ways (bottom-right causal, rows
# that see no key), GQA and MQA, head dims 8 / 64 / 128 / 256 and sizes that are not multiples of 16.
CASES = [
    (1, 1, 1, 1, 1, 8),
    (2, 17, 17, 4, 2, 64),
    (1, 100, 100, 2, 1, 64),
    (1, 64, 64, 2, 2, 128),
    (1, 130, 257, 4, 1, 33),
    (1, 257, 130, 2, 2, 72),
    (2, 65, 129, 6, 3, 8),
    (1, 96, 40, 2, 1, 256),
]

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _inputs(case, dtype, seed=0):
    b, sq, sk, h, hk, d = case
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, generator=g).to(dtype) for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)))
    do = torch.randn((b, sq, h, d), generator=g).to(dtype)
    return q, k, v, do


def _reference(q, k, v, do, causal, scale):
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = flash_attention_reference(qr, kr, vr, causal=causal, softmax_scale=scale)
    out.backward(do.double())
    return out.detach(), lse, qr.grad, kr.grad, vr.grad


def _err(x, ref):
    return (x.double() - ref).abs().max().item() / max(1.0, ref.abs().max().item())


def _check_lse(lse, ref):
    assert lse.dtype == torch.float32
    dead = torch.isneginf(ref)
    assert torch.equal(torch.isneginf(lse), dead)  # rows that see no key: -inf, and only those
    if bool((~dead).any()):
        assert (lse.double() - ref)[~dead].abs().max().item() < 1e-5


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_fp64_reference(case, causal, dtype):
    q, k, v, do = _inputs(case, dtype)
    scale = 1.0 / math.sqrt(case[-1])
    out, lse = torch.ops.megakernels.flash_attn_fwd_cpu(q, k, v, causal, scale)
    dq, dk, dv, dsinks = torch.ops.megakernels.flash_attn_bwd_cpu(do, q, k, v, out, lse, causal, scale)
    assert dsinks.shape == (0,)  # no sinks: no gradient of them
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = _reference(q, k, v, do, causal, scale)
    assert out.dtype == dtype and dq.dtype == dtype and dk.dtype == dtype and dv.dtype == dtype
    assert dk.shape == k.shape and dv.shape == v.shape
    _check_lse(lse, ref_lse)
    for name, x, ref in (("out", out, ref_out), ("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dv", dv, ref_dv)):
        assert _err(x, ref) < TOL[dtype], name
    if causal and case[1] > case[2]:  # the first sq - sk queries see nothing: zero output and gradient
        assert torch.all(out[:, : case[1] - case[2]] == 0) and torch.all(dq[:, : case[1] - case[2]] == 0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_flash_attention_routes_to_the_kernel_and_matches_the_reference(causal, dtype, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the covered case must not take the PyTorch path")

    monkeypatch.setattr(_attention_cpu, "forward", refuse)
    monkeypatch.setattr(_attention_cpu, "backward", refuse)
    case = (2, 150, 200, 4, 2, 64)
    q, k, v, do = _inputs(case, dtype, seed=1)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    with megakernels.backend("cpu"):
        out, lse = flash_attention(qg, kg, vg, causal=causal, softmax_scale=0.3, return_lse=True)
    out.backward(do)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = _reference(q, k, v, do, causal, 0.3)
    _check_lse(lse, ref_lse)
    for name, x, ref in (("out", out, ref_out), ("dq", qg.grad, ref_dq), ("dk", kg.grad, ref_dk)):
        assert _err(x, ref) < TOL[dtype], name
    assert _err(vg.grad, ref_dv) < TOL[dtype]


def test_kernel_and_pytorch_path_agree_in_fp32():
    q, k, v, do = _inputs((1, 300, 300, 4, 2, 128), torch.float32, seed=3)
    for causal in (False, True):
        out, lse = torch.ops.megakernels.flash_attn_fwd_cpu(q, k, v, causal, 0.1)
        py_out, py_lse = _attention_cpu.forward(q, k, v, causal, 0.1, 0.0, 0)
        assert (out - py_out).abs().max().item() < 1e-5 and (lse - py_lse).abs().max().item() < 1e-5
        grads = torch.ops.megakernels.flash_attn_bwd_cpu(do, q, k, v, out, lse, causal, 0.1)[:3]
        py_grads = _attention_cpu.backward(do, q, k, v, out, lse, causal, 0.1, 0.0, 0)[:3]
        for x, y in zip(grads, py_grads, strict=True):
            assert (x - y).abs().max().item() < 1e-5


def test_results_do_not_depend_on_the_thread_count():
    q, k, v, do = _inputs((1, 200, 330, 4, 2, 64), torch.float32, seed=4)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, max(2, threads), 3):
            torch.set_num_threads(n)
            out, lse = torch.ops.megakernels.flash_attn_fwd_cpu(q, k, v, True, 0.125)
            results.append((out, lse, *torch.ops.megakernels.flash_attn_bwd_cpu(do, q, k, v, out, lse, True, 0.125)))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert all(torch.equal(x, y) for x, y in zip(results[0], other))


def test_noncontiguous_inputs():
    q, k, v, do = _inputs((1, 70, 90, 2, 2, 32), torch.float32, seed=5)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # [b, s, h, d] with the heads outermost in memory
    out, lse = torch.ops.megakernels.flash_attn_fwd_cpu(qt, k, v, False, 0.2)
    ref, _ = torch.ops.megakernels.flash_attn_fwd_cpu(q, k, v, False, 0.2)
    assert torch.equal(out, ref)


def _token_major(s, b, h, d, n, dtype, seed):
    """``n`` [b, s, h, d] views unbound from one token-major [s, b, h, n, d] tensor (a packed projection's layout)."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randn(s, b, h, n, d, generator=g).to(dtype)
    return [t.transpose(0, 1) for t in packed.unbind(3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_strided_views_in_token_major_layouts(dtype, causal):
    """q, k, v unbound from packed token-major projections (GQA: k, v from their own), dO a token-major view: the
    same bits as contiguous copies, every output in its input's memory order (out, dq token-major, dk/dv too), and
    the fp64 reference met; the into-variant writes the gradients into slices of one packed buffer."""
    s, b, h, hk, d = 90, 2, 4, 2, 24
    (q,) = _token_major(s, b, h, d, 1, dtype, 0)
    k, v = _token_major(s, b, hk, d, 2, dtype, 1)
    (do,) = _token_major(s, b, h, d, 1, dtype, 2)
    scale = 1.0 / math.sqrt(d)
    fwd, bwd = torch.ops.megakernels.flash_attn_fwd_cpu, torch.ops.megakernels.flash_attn_bwd_cpu
    out, lse = fwd(q, k, v, causal, scale)
    grads = bwd(do, q, k, v, out, lse, causal, scale)
    qc, kc, vc, doc = (t.contiguous() for t in (q, k, v, do))
    ref_out, ref_lse = fwd(qc, kc, vc, causal, scale)
    ref_grads = bwd(doc, qc, kc, vc, ref_out, ref_lse, causal, scale)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert all(torch.equal(x, y) for x, y in zip(grads, ref_grads))
    for t, like in ((out, q), (grads[0], q), (grads[1], k), (grads[2], v)):
        assert t.transpose(0, 1).is_contiguous() and t.shape == like.shape  # token-major, as its input
    assert ref_out.is_contiguous() and all(x.is_contiguous() for x in ref_grads)  # contiguous in, contiguous out
    exact = _reference(q, k, v, do, causal, scale)
    for x, ref in zip((out, *grads), (exact[0], *exact[2:])):
        assert _err(x, ref) < TOL[dtype]
    # dk and dv written into the two halves of one [s, b, hk, 2, d] buffer, dq into a strided slice of another
    dkv = torch.full((s, b, hk, 2, d), float("nan"), dtype=dtype)
    dq = torch.full((s, b, h, 3, d), float("nan"), dtype=dtype)[:, :, :, 1].transpose(0, 1)
    dk, dv = (t.transpose(0, 1) for t in dkv.unbind(3))
    torch.ops.megakernels.flash_attn_bwd_cpu_into(do, q, k, v, out, lse, causal, scale, 0, 0, None, 0.0, 0, dq, dk, dv)
    assert all(torch.equal(x, y) for x, y in zip((dq, dk, dv), ref_grads))


def test_opcheck_with_token_major_views():
    """The custom ops' fake outputs have the strides the C++ kernel gives (its inputs' memory order)."""
    (q,) = _token_major(40, 2, 2, 16, 1, torch.float32, 3)
    k, v = _token_major(40, 2, 2, 16, 2, torch.float32, 4)
    (do,) = _token_major(40, 2, 2, 16, 1, torch.float32, 5)
    args = (q, k, v, True, 0.25, 0.0, None, False)
    torch.library.opcheck(torch.ops.megakernels.flash_attn_fwd.default, args)
    out, lse = torch.ops.megakernels.flash_attn_fwd(*args)
    assert out.transpose(0, 1).is_contiguous()
    bwd_args = (do, q, k, v, out, lse, True, 0.25, 0.0, None, False)
    torch.library.opcheck(torch.ops.megakernels.flash_attn_bwd.default, bwd_args)

    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fo, _ = torch.ops.megakernels.flash_attn_fwd(fq, fk, fv, True, 0.25, 0.0, None, False)
    assert fo.stride() == out.stride()


def test_into_refuses_gradients_of_the_wrong_shape_or_layout():
    q, k, v, do = _inputs((1, 20, 20, 2, 2, 16), torch.float32)
    out, lse = torch.ops.megakernels.flash_attn_fwd_cpu(q, k, v, False, 0.25)
    into = torch.ops.megakernels.flash_attn_bwd_cpu_into
    args = (do, q, k, v, out, lse, False, 0.25, 0, 0, None, 0.0, 0)
    with pytest.raises(ValueError, match="dk must be a CPU Float tensor of shape"):
        into(*args, torch.empty_like(q), torch.empty(1, 20, 2, 8), torch.empty_like(v))
    with pytest.raises(ValueError, match="dq must be .* contiguous head_dim"):
        into(*args, torch.empty(1, 20, 16, 2).transpose(2, 3), torch.empty_like(k), torch.empty_like(v))
    with pytest.raises(ValueError, match="dk has elements that share memory"):
        into(*args, torch.empty_like(q), torch.empty(1, 1, 2, 16).expand(1, 20, 2, 16), torch.empty_like(v))
    with pytest.raises(ValueError, match="dq shares memory with q"):
        into(*args, q, torch.empty_like(k), torch.empty_like(v))
    shared = torch.empty_like(k)
    with pytest.raises(ValueError, match="dk shares memory with dv"):
        into(*args, torch.empty_like(q), shared, shared)
    with pytest.raises(ValueError, match="dv must be a CPU Float"):
        into(*args, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"dtype": torch.float64},
        {"head_dim": 264},
    ],
)
def test_uncovered_cases_keep_the_pytorch_path(kwargs, monkeypatch):
    calls = []
    forward, backward = _attention_cpu.forward, _attention_cpu.backward

    def fwd(*args, **kw):
        calls.append("fwd")
        return forward(*args, **kw)

    def bwd(*args, **kw):
        calls.append("bwd")
        return backward(*args, **kw)

    monkeypatch.setattr(_attention_cpu, "forward", fwd)
    monkeypatch.setattr(_attention_cpu, "backward", bwd)
    kwargs = dict(kwargs)
    dtype, d = kwargs.pop("dtype", torch.float32), kwargs.pop("head_dim", 32)
    q, k, v, do = _inputs((1, 96, 96, 2, 1, d), dtype, seed=6)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    with megakernels.backend("cpu"):
        out = flash_attention(qg, kg, vg, causal=True, **kwargs)
    out.backward(do)
    assert calls == ["fwd", "bwd"]


@pytest.mark.parametrize(
    ("shapes", "dtype", "match"),
    [
        (((1, 4, 2, 8), (1, 4, 2, 8)), torch.float64, "fp32, bf16 or fp16"),
        (((1, 4, 2, 264), (1, 4, 2, 264)), torch.float32, "head_dim 264"),
        (((1, 4, 3, 8), (1, 4, 2, 8)), torch.float32, "not a multiple"),
        (((1, 4, 2, 8), (1, 4, 2, 16)), torch.float32, "head_dim"),
        (((1, 0, 2, 8), (1, 4, 2, 8)), torch.float32, "empty"),
    ],
)
def test_kernel_refuses_what_it_does_not_cover(shapes, dtype, match):
    q = torch.zeros(shapes[0], dtype=dtype)
    k = torch.zeros(shapes[1], dtype=dtype)
    with pytest.raises(ValueError, match=match):
        torch.ops.megakernels.flash_attn_fwd_cpu(q, k, k, False, 1.0)


def _masked_reference(q, k, v, do, causal, scale, window=0, shift=0, docs=None, keep=None, dropout_p=0.0):
    """fp64 attention with the mask written out: rel = i + sk - sq + shift - j; causal keeps rel >= 0, a window
    rel < window (causal) or |rel| < window, documents equal ids. Rows that see no key: zeros and lse -inf."""
    b, sq, h, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    rel = torch.arange(sq)[:, None] + sk - sq + shift - torch.arange(sk)[None, :]
    mask = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        mask &= rel >= 0
    if window:
        mask &= (rel < window) if causal else (rel.abs() < window)
    mask = mask.expand(b, sq, sk)
    if docs is not None:
        mask = mask & (docs[0][:, :, None] == docs[1][:, None, :])
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    kk, vv = kr.repeat_interleave(h // hk, 2), vr.repeat_interleave(h // hk, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", qr, kk) * scale
    s = s.masked_fill(~mask[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.where(mask[:, None], torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None]), 0.0)
    if keep is not None:  # dropout after the softmax: the kept probabilities, scaled
        p = torch.where(keep, p / (1.0 - dropout_p), 0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vv)
    out.backward(do.double())
    return out.detach(), lse.detach(), qr.grad, kr.grad, vr.grad


def _docs(lengths_per_batch, s):
    ids = []
    for lengths in lengths_per_batch:
        row = [i for i, n in enumerate(lengths) for _ in range(n)]
        ids.append(row + [len(lengths)] * (s - len(row)))
    return torch.tensor(ids)


# (case, causal, window, shift, documents as lengths per batch or None): windows narrower and wider than a block,
# sq != sk both ways, a shifted diagonal, documents alone, with causal and with a window
MASKED = [
    ((1, 200, 200, 2, 1, 64), True, 40, 0, None),
    ((1, 200, 200, 2, 2, 32), False, 70, 0, None),
    ((2, 90, 300, 4, 2, 48), True, 130, 0, None),
    ((1, 300, 90, 2, 1, 64), False, 17, 0, None),
    ((1, 120, 200, 2, 1, 64), True, 50, 37, None),
    ((1, 150, 150, 2, 1, 64), False, 64, -20, None),
    ((2, 230, 230, 4, 2, 64), False, 0, 0, [[70, 100, 60], [230]]),
    ((2, 230, 230, 4, 2, 64), True, 0, 0, [[1, 129, 100], [64, 64, 64, 38]]),
    ((1, 257, 257, 2, 1, 40), True, 33, 0, [[100, 157]]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("case", "causal", "window", "shift", "lengths"), MASKED)
def test_windows_and_documents_match_the_masked_reference(case, causal, window, shift, lengths, dtype):
    q, k, v, do = _inputs(case, dtype, seed=7)
    scale = 1.0 / math.sqrt(case[-1])
    docs = None if lengths is None else (_docs(lengths, case[1]), _docs(lengths, case[2]))
    q_keys = None if docs is None else document_ranges(*docs)[0]
    out, lse = torch.ops.megakernels.flash_attn_fwd_cpu(q, k, v, causal, scale, window, shift, q_keys)
    grads = torch.ops.megakernels.flash_attn_bwd_cpu(do, q, k, v, out, lse, causal, scale, window, shift, q_keys)
    ref_out, ref_lse, *ref_grads = _masked_reference(q, k, v, do, causal, scale, window, shift, docs)
    _check_lse(lse, ref_lse)
    for name, x, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        assert _err(x, ref) < TOL[dtype], name


def test_windows_and_documents_route_to_the_kernel(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("windows and documents must not take the PyTorch path")

    monkeypatch.setattr(_attention_cpu, "forward", refuse)
    monkeypatch.setattr(_attention_cpu, "backward", refuse)
    q, k, v, do = _inputs((2, 160, 160, 4, 2, 64), torch.float32, seed=8)
    docs = _docs([[50, 110], [160]], 160)
    for kwargs, ref_kwargs in (
        ({"window": 48}, {"window": 48}),
        ({"documents": docs}, {"docs": (docs, docs)}),
        ({"window": 30, "documents": docs}, {"window": 30, "docs": (docs, docs)}),
    ):
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        with megakernels.backend("cpu"):
            out = flash_attention(qg, kg, vg, causal=True, softmax_scale=0.2, **kwargs)
        out.backward(do)
        ref_out, _, ref_dq, ref_dk, ref_dv = _masked_reference(q, k, v, do, True, 0.2, **ref_kwargs)
        for name, x, ref in (
            ("out", out, ref_out),
            ("dq", qg.grad, ref_dq),
            ("dk", kg.grad, ref_dk),
            ("dv", vg.grad, ref_dv),
        ):
            assert _err(x, ref) < TOL[torch.float32], (name, kwargs.keys())


def test_kernel_refuses_bad_windows_and_spans():
    q = torch.zeros(1, 8, 2, 16)
    with pytest.raises(ValueError, match="shift"):
        torch.ops.megakernels.flash_attn_fwd_cpu(q, q, q, True, 1.0, 0, 3, None)
    with pytest.raises(ValueError, match="window"):
        torch.ops.megakernels.flash_attn_fwd_cpu(q, q, q, True, 1.0, -1, 0, None)
    with pytest.raises(ValueError, match="q_keys"):
        torch.ops.megakernels.flash_attn_fwd_cpu(q, q, q, True, 1.0, 0, 0, torch.zeros(1, 8, 2, dtype=torch.int64))
    bad = torch.zeros(1, 8, 2, dtype=torch.int32)
    bad[0, 3, 1] = 9  # past sk
    with pytest.raises(ValueError, match="q_keys"):
        torch.ops.megakernels.flash_attn_fwd_cpu(q, q, q, True, 1.0, 0, 0, bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("case", "causal", "window", "lengths", "p", "seed"),
    [
        ((2, 130, 150, 4, 2, 64), False, 0, None, 0.1, 1234),
        ((1, 200, 200, 2, 1, 32), True, 0, None, 0.3, -7),
        ((1, 200, 200, 2, 1, 48), True, 60, None, 0.2, 2**40 + 3),
        ((2, 230, 230, 4, 2, 40), True, 0, [[70, 100, 60], [230]], 0.15, 99),
    ],
)
def test_dropout_matches_the_masked_reference_with_the_shared_keep_mask(case, causal, window, lengths, p, seed, dtype):
    q, k, v, do = _inputs(case, dtype, seed=9)
    scale = 1.0 / math.sqrt(case[-1])
    b, sq, sk, h = case[:4]
    docs = None if lengths is None else (_docs(lengths, sq), _docs(lengths, sk))
    q_keys = None if docs is None else document_ranges(*docs)[0]
    out, lse = torch.ops.megakernels.flash_attn_fwd_cpu(q, k, v, causal, scale, window, 0, q_keys, p, seed)
    grads = torch.ops.megakernels.flash_attn_bwd_cpu(do, q, k, v, out, lse, causal, scale, window, 0, q_keys, p, seed)
    keep = dropout_mask(seed, b, h, sq, sk, p)
    ref_out, ref_lse, *ref_grads = _masked_reference(q, k, v, do, causal, scale, window, 0, docs, keep, p)
    _check_lse(lse, ref_lse)  # the normaliser is the whole softmax's
    for name, x, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        assert _err(x, ref) < TOL[dtype], name
    # another seed drops other scores
    other, _ = torch.ops.megakernels.flash_attn_fwd_cpu(q, k, v, causal, scale, window, 0, q_keys, p, seed + 1)
    assert not torch.equal(other, out)


def test_dropout_through_flash_attention_equals_the_pytorch_path():
    """The C++ kernel and megakernels/ops/_attention_cpu.py drop the same scores: their outputs and gradients agree
    in fp32 for one seed (so a CPU run and a GPU run with that seed see the same mask)."""
    q, k, v, do = _inputs((1, 150, 170, 4, 2, 64), torch.float32, seed=10)
    out, lse = torch.ops.megakernels.flash_attn_fwd_cpu(q, k, v, True, 0.125, 0, 0, None, 0.2, 31337)
    py_out, py_lse = _attention_cpu.forward(q, k, v, True, 0.125, 0.2, 31337)
    assert (out - py_out).abs().max().item() < 1e-5 and (lse - py_lse).abs().max().item() < 1e-5
    grads = torch.ops.megakernels.flash_attn_bwd_cpu(do, q, k, v, out, lse, True, 0.125, 0, 0, None, 0.2, 31337)[:3]
    py_grads = _attention_cpu.backward(do, q, k, v, out, lse, True, 0.125, 0.2, 31337)[:3]
    for x, y in zip(grads, py_grads, strict=True):
        assert (x - y).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="dropout_p"):
        torch.ops.megakernels.flash_attn_fwd_cpu(q, k, v, True, 0.125, 0, 0, None, 1.0, 0)


def _cpu_has_avx512_bf16() -> bool:
    """Whether the kernels running here multiply bf16 panels: a CPU with AVX512-BF16 and the AVX-512 clones chosen
    (MEGAKERNELS_CPU_ISA may pick a narrower ISA)."""
    import megakernels

    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read().split()
    except OSError:
        return False
    return "avx512_bf16" in flags and megakernels.cpu_isa() in ("avx512", "native")


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_forward_with_bf16_products_and_with_fp32_panels(causal, monkeypatch):
    """bf16 on a CPU with AVX512-BF16 multiplies bf16 panels forward and backward (P, dS rounded to bf16, sums in fp32);
    MEGAKERNELS_CPU_BF16_DOT=0 keeps the fp32 panels. Both against fp64; on such a CPU they differ in the last bits
    (the products really changed), elsewhere they are the same path."""
    q, k, v, do = _inputs((2, 200, 260, 4, 2, 64), torch.bfloat16, seed=11)
    ref_out, ref_lse, *ref_grads = _reference(q, k, v, do, causal, 0.125)
    results = {}
    for env in ("1", "0"):
        monkeypatch.setenv("MEGAKERNELS_CPU_BF16_DOT", env)
        out, lse = torch.ops.megakernels.flash_attn_fwd_cpu(q, k, v, causal, 0.125)
        grads = torch.ops.megakernels.flash_attn_bwd_cpu(do, q, k, v, out, lse, causal, 0.125)
        _check_lse(lse, ref_lse)
        for name, x, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
            assert _err(x, ref) < TOL[torch.bfloat16], (env, name)
        results[env] = out
    assert torch.equal(results["1"], results["0"]) != _cpu_has_avx512_bf16()
