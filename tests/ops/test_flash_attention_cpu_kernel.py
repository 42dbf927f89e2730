"""The C++ CPU FlashAttention kernel (csrc/flash_attention; torch.ops.megakernels.flash_attn_fwd_cpu /
flash_attn_bwd_cpu), called directly and through flash_attention on the CPU, against the materialising fp64
reference (out, lse, dq, dk, dv); and the routing: covered calls run it, dropout / window / documents / fp64 /
head_dim > 256 keep the blocked PyTorch path (megakernels/ops/_attention_cpu.py)."""

from __future__ import annotations

import math

import pytest
import torch

import megakernels
from megakernels.ops import _attention_cpu
from megakernels.ops.attention import flash_attention, flash_attention_reference

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
    dq, dk, dv = torch.ops.megakernels.flash_attn_bwd_cpu(do, q, k, v, out, lse, causal, scale)
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
        grads = torch.ops.megakernels.flash_attn_bwd_cpu(do, q, k, v, out, lse, causal, 0.1)
        py_grads = _attention_cpu.backward(do, q, k, v, out, lse, causal, 0.1, 0.0, 0)
        for x, y in zip(grads, py_grads):
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


@pytest.mark.parametrize(
    "kwargs",
    [
        {"dropout_p": 0.1},
        {"window": 40},
        {"documents": "docs"},
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
    if kwargs.get("documents") == "docs":
        kwargs["documents"] = torch.tensor([[0] * 40 + [1] * 56])
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
