"""FlashAttention with a value head dim of its own (``d_v != d_qk``: multi-head latent attention's 192 / 128): the
CPU paths (the C++ kernel for fp32/bf16/fp16, the blocked PyTorch path for fp64) against an fp64 reference with the
mask written out here (causal, windows, documents, sinks, dropout's keep-mask), through ``flash_attention``,
``flash_attention_varlen`` and the custom ops (opcheck); out and dO in d_v, dq and dk in d_qk, dv in d_v."""

from __future__ import annotations

import math

import pytest
import torch

import megakernels
from megakernels.ops import _attention_cpu
from megakernels.ops.attention import (
    dropout_mask,
    flash_attention,
    flash_attention_reference,
    flash_attention_varlen,
)

DIMS = [(32, 16), (48, 32), (24, 40)]
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _inputs(b, sq, sk, h, hk, d, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, dv), (b, sq, h, dv))
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def _reference(q, k, v, do, causal=False, scale=None, window=0, docs=None, sinks=None, keep=None, dropout_p=0.0):
    """fp64 attention with the mask written out (rel = i + sk - sq - j: causal keeps rel >= 0, a window rel < w or
    |rel| < w, documents equal ids), sinks as one more column of value zero, dropout's kept probabilities scaled.
    Returns out, lse and the gradients of q, k, v (and sinks when given)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    sr = sinks.detach().double().requires_grad_() if sinks is not None else None
    qr, kr, vr = leaves
    rel = torch.arange(sq)[:, None] + sk - sq - torch.arange(sk)[None, :]
    mask = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        mask &= rel >= 0
    if window:
        mask &= (rel < window) if causal else (rel.abs() < window)
    mask = mask.expand(b, sq, sk)
    if docs is not None:
        mask = mask & (docs[0][:, :, None] == docs[1][:, None, :])
    kk, vv = kr.repeat_interleave(h // hk, 2), vr.repeat_interleave(h // hk, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", qr, kk) * scale
    s = s.masked_fill(~mask[:, None], float("-inf"))
    if sr is not None:
        s = torch.cat((s, sr[None, :, None, None].expand(b, h, sq, 1)), -1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])[..., :sk]
    p = torch.where(mask[:, None], p, 0.0)
    if keep is not None:
        p = torch.where(keep, p / (1.0 - dropout_p), 0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vv)
    out.backward(do.double())
    grads = [t.grad for t in leaves] + ([sr.grad] if sr is not None else [])
    return out.detach(), lse.detach(), grads


def _err(x, ref):
    return (x.double() - ref).abs().max().item() / max(1.0, ref.abs().max().item())


def _check(out, lse, grads, ref, dtype):
    ref_out, ref_lse, ref_grads = ref
    assert out.shape == ref_out.shape and out.dtype == dtype
    live = ~torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), ~live)
    if bool(live.any()):
        assert (lse.double() - ref_lse)[live].abs().max().item() < max(1e-5, TOL[dtype])
    assert _err(out, ref_out) < TOL[dtype], "out"
    for name, x, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        assert x.shape == r.shape, name
        assert _err(x, r) < TOL[dtype], name


def _run(q, k, v, do, sinks=None, **kw):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sg = sinks.clone().requires_grad_() if sinks is not None else None
    out, lse = flash_attention(*leaves, return_lse=True, sinks=sg, **kw)
    out.backward(do)
    return out.detach(), lse, [t.grad for t in leaves] + ([sg.grad] if sg is not None else [])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dims", DIMS)
def test_matches_the_fp64_reference(dims, causal, dtype):
    """GQA, sq != sk (bottom-right causal: the first rows see no key), more than one block of rows and keys."""
    d, dv = dims
    q, k, v, do = _inputs(2, 150, 90, 4, 2, d, dv, dtype, seed=d + dv)
    with megakernels.backend("cpu"):
        res = _run(q, k, v, do, causal=causal)
    _check(*res, _reference(q, k, v, do, causal), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_192_128_multi_head_latent_attention(dtype):
    q, k, v, do = _inputs(1, 70, 70, 2, 2, 192, 128, dtype, seed=1)
    with megakernels.backend("cpu"):
        res = _run(q, k, v, do, causal=True)
    _check(*res, _reference(q, k, v, do, True), dtype)


def _docs(lengths, s):
    row = [i for i, n in enumerate(lengths) for _ in range(n)]
    return torch.tensor([row + [len(lengths)] * (s - len(row))])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    ("causal", "window", "lengths", "with_sinks"),
    [
        (True, 30, None, False),
        (False, 40, None, True),
        (True, 0, [50, 70, 20], True),
        (True, 25, [100, 40], False),
    ],
)
def test_windows_documents_and_sinks(causal, window, lengths, with_sinks, dtype):
    d, dv = 48, 32
    q, k, v, do = _inputs(1, 140, 140, 4, 1, d, dv, dtype, seed=7)
    docs = None if lengths is None else _docs(lengths, 140)
    sink_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(3), dtype=sink_dtype) if with_sinks else None
    with megakernels.backend("cpu"):
        res = _run(q, k, v, do, sinks=sinks, causal=causal, window=window or None, documents=docs)
    ref = _reference(q, k, v, do, causal, window=window, docs=None if docs is None else (docs, docs), sinks=sinks)
    _check(*res, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("causal", "window"), [(False, 0), (True, 0), (True, 50)])
def test_dropout_matches_the_reference_with_the_shared_keep_mask(causal, window, dtype):
    d, dv = 24, 40
    b, sq, sk, h, hk = 2, 100, 120, 2, 1
    q, k, v, do = _inputs(b, sq, sk, h, hk, d, dv, dtype, seed=11)
    p, seed = 0.2, 4321
    scale = 1.0 / math.sqrt(d)
    seed_t = torch.tensor(seed, dtype=torch.int64)
    args = (q, k, v, causal, scale, p, seed_t, False, False, window)
    with megakernels.backend("cpu"):
        out, lse = torch.ops.megakernels.flash_attn_fwd(*args)
        grads = torch.ops.megakernels.flash_attn_bwd(
            do, q, k, v, out, lse, causal, scale, p, seed_t, False, False, window
        )
    ref = _reference(q, k, v, do, causal, scale, window, keep=dropout_mask(seed, b, h, sq, sk, p), dropout_p=p)
    _check(out, lse, grads[:3], ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_varlen(dtype):
    d, dv = 32, 16
    cu = torch.tensor([0, 30, 30, 100, 130], dtype=torch.int32)
    q, k, v, do = (t[0] for t in _inputs(1, 130, 130, 4, 2, d, dv, dtype, seed=5))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with megakernels.backend("cpu"):
        out, lse = flash_attention_varlen(*leaves, cu, cu, 70, 70, causal=True, return_lse=True)
    out.backward(do)
    assert out.shape == (130, 4, dv)
    docs = _docs([30, 0, 70, 30], 130)
    ref = _reference(q[None], k[None], v[None], do[None], True, docs=(docs, docs))
    _check(out[None].detach(), lse[None], [t.grad[None] for t in leaves], ref, dtype)


def test_deterministic_backward_is_the_same_bits():
    q, k, v, do = _inputs(1, 130, 130, 4, 2, 48, 32, torch.float32, seed=2)
    with megakernels.backend("cpu"):
        first = _run(q, k, v, do, causal=True, deterministic=True)
        second = _run(q, k, v, do, causal=True, deterministic=True)
    assert all(torch.equal(x, y) for x, y in zip(first[2], second[2]))
    _check(*first, _reference(q, k, v, do, True), torch.float32)


def test_the_blocked_path_and_the_default_path_agree():
    """fp32 through the op (the C++ kernel where it covers d_v != d_qk) and megakernels/ops/_attention_cpu.py."""
    q, k, v, do = _inputs(1, 100, 130, 4, 2, 32, 16, torch.float32, seed=4)
    out, lse = torch.ops.megakernels.flash_attn_fwd(q, k, v, True, 0.2, 0.0, None, False)
    py_out, py_lse = _attention_cpu.forward(q, k, v, True, 0.2, 0.0, 0)
    assert (out - py_out).abs().max().item() < 1e-5 and (lse - py_lse).abs().max().item() < 1e-5
    grads = torch.ops.megakernels.flash_attn_bwd(do, q, k, v, out, lse, True, 0.2, 0.0, None, False)[:3]
    py_grads = _attention_cpu.backward(do, q, k, v, out, lse, True, 0.2, 0.0, 0)[:3]
    for x, y in zip(grads, py_grads, strict=True):
        assert x.shape == y.shape and (x - y).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_opcheck(dtype):
    q, k, v, do = _inputs(1, 40, 40, 2, 1, 24, 40, dtype, seed=8)
    args = (q, k, v, True, 0.25, 0.0, None, False)
    torch.library.opcheck(torch.ops.megakernels.flash_attn_fwd.default, args)
    out, lse = torch.ops.megakernels.flash_attn_fwd(*args)
    assert out.shape == (1, 40, 2, 40)
    torch.library.opcheck(
        torch.ops.megakernels.flash_attn_bwd.default, (do, q, k, v, out, lse, True, 0.25, 0.0, None, False)
    )


def test_the_fp64_reference_takes_d_v():
    q, k, v, _ = _inputs(1, 20, 30, 2, 1, 24, 8, torch.float64, seed=9)
    out, lse = flash_attention_reference(q, k, v, causal=True)
    p = torch.softmax(
        (torch.einsum("bqhd,bkhd->bhqk", q, k.expand(-1, -1, 2, -1)) / math.sqrt(24)).masked_fill(
            torch.ones(20, 30, dtype=torch.bool).triu(11), float("-inf")
        ),
        -1,
    )
    assert out.shape == (1, 20, 2, 8) and lse.shape == (1, 2, 20)
    assert torch.allclose(out, torch.einsum("bhqk,bkhd->bqhd", p, v.expand(-1, -1, 2, -1)))


@pytest.mark.parametrize(
    ("k_shape", "v_shape", "match"),
    [
        (
            (1, 8, 2, 16),
            (1, 8, 2, 8),
            r"k has head_dim 16, expected q's head_dim 32 \(q.shape\[-1\] == k.shape\[-1\]\)",
        ),
        ((1, 8, 2, 32), (1, 9, 2, 8), r"v has shape \(1, 9, 2, 8\), expected k's batch, seqlen and heads"),
        ((1, 8, 2, 32), (1, 8, 1, 8), r"expected k's batch, seqlen and heads \(1, 8, 2\)"),
    ],
)
def test_shape_errors_name_the_rule(k_shape, v_shape, match):
    q = torch.zeros(1, 8, 2, 32)
    with pytest.raises(ValueError, match=match):
        flash_attention(q, torch.zeros(k_shape), torch.zeros(v_shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpp_kernel_runs_d_v_and_its_layouts(dtype, monkeypatch):
    """fp32/bf16 calls with d_v != d_qk run the C++ kernel (never the blocked path), out in q's memory order: a
    token-major q gives a token-major out, and the fake output has its strides."""

    def refuse(*args, **kw):
        raise AssertionError("d_v != d_qk must run the C++ kernel")

    monkeypatch.setattr(_attention_cpu, "forward", refuse)
    monkeypatch.setattr(_attention_cpu, "backward", refuse)
    q, k, v, do = _inputs(2, 80, 80, 2, 1, 40, 24, dtype, seed=12)
    q = q.transpose(0, 1).contiguous().transpose(0, 1)  # [s, b, h, d] in memory
    with megakernels.backend("cpu"):
        res = _run(q, k, v, do, causal=True)
    assert res[0].transpose(0, 1).is_contiguous()
    _check(*res, _reference(q, k, v, do, True), dtype)
    out, _ = torch.ops.megakernels.flash_attn_fwd_cpu(q, k, v, True, 0.2)
    assert out.shape == (2, 80, 2, 24) and out.stride() == res[0].stride()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fo, _ = torch.ops.megakernels.flash_attn_fwd(
            *(mode.from_tensor(t) for t in (q, k, v)), True, 0.2, 0.0, None, False
        )
    assert fo.stride() == out.stride()


def test_the_cpp_kernel_refuses_mismatched_shapes():
    q, k, v, do = _inputs(1, 8, 8, 2, 2, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="v must have k's batch, seqlen and heads"):
        torch.ops.megakernels.flash_attn_fwd_cpu(q, k, v[:, :4], False, 1.0)
    with pytest.raises(ValueError, match="v's head_dim 264"):
        torch.ops.megakernels.flash_attn_fwd_cpu(q, k, torch.zeros(1, 8, 2, 264), False, 1.0)
    out, lse = torch.ops.megakernels.flash_attn_fwd_cpu(q, k, v, False, 1.0)
    with pytest.raises(ValueError, match=r"shape \[batch, sq, heads, v's head_dim\]"):
        torch.ops.megakernels.flash_attn_bwd_cpu(torch.zeros(1, 8, 2, 16), q, k, v, out, lse, False, 1.0)


@pytest.mark.parametrize(
    ("dims", "causal", "window", "lengths", "with_sinks", "p"),
    [
        ((32, 16), False, 0, None, False, 0.0),
        ((48, 32), True, 0, None, True, 0.0),
        ((24, 40), True, 20, None, False, 0.2),
        ((32, 16), True, 0, [30, 40, 10], False, 0.0),
    ],
)
def test_the_triton_kernels_under_the_interpreter(dims, causal, window, lengths, with_sinks, p):
    """The Triton kernels (cuda_emu: Triton's interpreter) with V, O, dO and dV tiles in d_v against the reference:
    the forward, the one-pass backward (dQ by atomics) and the deterministic one (the dQ kernel)."""
    d, dv = dims
    b, s, h, hk = 1, 80, 2, 1
    q, k, v, do = _inputs(b, s, s, h, hk, d, dv, torch.float32, seed=d * dv)
    docs = None if lengths is None else _docs(lengths, s)
    sinks = torch.randn(h, generator=torch.Generator().manual_seed(1)) if with_sinks else None
    scale, seed = 1.0 / math.sqrt(d), 77
    seed_t = torch.tensor(seed, dtype=torch.int64)
    args = (q, k, v, causal, scale, p, seed_t, True, False, window, 0, docs, docs, sinks)
    keep = dropout_mask(seed, b, h, s, s, p) if p else None
    ref = _reference(q, k, v, do, causal, scale, window, None if docs is None else (docs, docs), sinks, keep, p)
    with megakernels.backend("cuda_emu"):
        out, lse = torch.ops.megakernels.flash_attn_fwd(*args)
        for deterministic in (False, True):
            grads = torch.ops.megakernels.flash_attn_bwd(
                do, q, k, v, out, lse, causal, scale, p, seed_t, True, deterministic, window, 0, docs, docs, sinks
            )
            _check(out, lse, grads if with_sinks else grads[:3], ref, torch.float32)
