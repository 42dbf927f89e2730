"""FlashSelfAttention: packed and separate inputs, dropout only in training, and torch.compile(fullgraph)."""

import pytest
import torch

from megakernels.nn import FlashSelfAttention
from megakernels.ops.attention import flash_attention_reference


def test_packed_and_separate_inputs_match_the_reference():
    torch.manual_seed(0)
    qkv = torch.randn(2, 19, 3, 4, 32, dtype=torch.float64)
    attn = FlashSelfAttention(causal=True)
    ref, _ = flash_attention_reference(*qkv.unbind(2), causal=True)
    assert torch.allclose(attn(qkv), ref, atol=1e-10)
    assert torch.allclose(attn(*qkv.unbind(2)), ref, atol=1e-10)
    ref_full, _ = flash_attention_reference(*qkv.unbind(2), causal=False)
    assert torch.allclose(attn(qkv, causal=False), ref_full, atol=1e-10)


def test_dropout_applies_in_training_only():
    torch.manual_seed(0)
    qkv = torch.randn(1, 16, 3, 2, 32)
    attn = FlashSelfAttention(attention_dropout=0.5)
    ref, _ = flash_attention_reference(*qkv.unbind(2))
    assert not torch.allclose(attn.train()(qkv), ref.float(), atol=1e-3)
    assert torch.allclose(attn.eval()(qkv), ref.float(), atol=1e-5)


def test_bad_input():
    with pytest.raises(ValueError, match="packed qkv must be"):
        FlashSelfAttention()(torch.randn(1, 4, 2, 2, 8))
    with pytest.raises(ValueError, match="all of q, k and v"):
        FlashSelfAttention()(torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8))
    with pytest.raises(ValueError, match="attention_dropout"):
        FlashSelfAttention(attention_dropout=1.5)


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(compile_backend):
    torch.manual_seed(0)
    attn = FlashSelfAttention(causal=True)
    qkv = torch.randn(1, 24, 3, 2, 32, requires_grad=True)
    compiled = torch.compile(attn, fullgraph=True, backend=compile_backend)
    out = compiled(qkv)
    out.square().sum().backward()
    grad = qkv.grad.clone()
    qkv.grad = None
    attn(qkv).square().sum().backward()
    ref, _ = flash_attention_reference(*qkv.detach().unbind(2), causal=True)
    assert torch.allclose(out.detach().double(), ref, atol=1e-5)
    assert torch.allclose(grad, qkv.grad, atol=1e-5)


@pytest.mark.parametrize("name", ["flash", "torch"])
def test_a_padding_mask_and_gqa_match_the_reference(name):
    """Both library cores take a boolean mask (True = masked out) and fewer K/V heads than query heads."""
    from megakernels.nn import attention_core

    torch.manual_seed(1)
    q = torch.randn(2, 7, 4, 16, dtype=torch.float64)
    k, v = torch.randn(2, 7, 2, 16, dtype=torch.float64), torch.randn(2, 7, 2, 16, dtype=torch.float64)
    mask = torch.zeros(2, 1, 1, 7, dtype=torch.bool)
    mask[0, ..., 5:] = True
    kr, vr = k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kr) / 4.0
    ref = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(mask, float("-inf")).softmax(-1), vr)
    got = attention_core(name)(q, k, v, mask=mask)
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9)


def test_a_mask_with_causal_is_refused_and_unknown_cores_are_named():
    from megakernels.nn import attention_core

    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="either causal=True or a mask"):
        FlashSelfAttention(causal=True)(q, q, q, mask=torch.zeros(1, 1, 1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="attention must be one of flash, torch, got 'xformers'"):
        attention_core("xformers")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("sq,sk", [(37, 37), (20, 37)])
def test_flash_and_torch_cores_agree_with_a_window(causal, sq, sk):
    """``--attention flash`` and ``--attention torch`` compute the same sliding-window attention (GQA, sq != sk,
    with and without a padding mask), equal to the fp64 reference masked by hand: causal query i (at position
    i + sk - sq) sees key j iff i - w < j <= i; without causality |i - j| < w."""
    from megakernels.nn import attention_core

    torch.manual_seed(2)
    q = torch.randn(2, sq, 4, 16, dtype=torch.float64)
    k, v = torch.randn(2, sk, 2, 16, dtype=torch.float64), torch.randn(2, sk, 2, 16, dtype=torch.float64)
    w = 6
    qpos, kpos = torch.arange(sq)[:, None] + sk - sq, torch.arange(sk)[None, :]
    hidden = ((kpos > qpos) | (kpos <= qpos - w)) if causal else ((qpos - kpos).abs() >= w)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, 2)) / 4.0
    probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1)
    ref = torch.einsum("bhqk,bkhd->bqhd", probs, v.repeat_interleave(2, 2))
    outs = {name: attention_core(name, causal, window=w)(q, k, v) for name in ("flash", "torch")}
    for name, out in outs.items():
        assert torch.allclose(out, ref, atol=1e-10), name
    if not causal:  # with a padding mask: the band and the mask together
        pad = torch.zeros(2, 1, 1, sk, dtype=torch.bool)
        pad[1, ..., :3] = True
        want = torch.einsum(
            "bhqk,bkhd->bqhd",
            torch.softmax(scores.masked_fill(hidden | pad, float("-inf")), -1),
            v.repeat_interleave(2, 2),
        )
        for name in ("flash", "torch"):
            assert torch.allclose(attention_core(name, False, window=w)(q, k, v, mask=pad), want, atol=1e-10), name
    assert "window=6" in repr(attention_core("flash", causal, window=w))
    with pytest.raises(ValueError, match="window must be a positive int"):
        attention_core("torch", causal, window=-3)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("window", [None, 6])
def test_both_cores_take_sinks(causal, window):
    """``sinks=`` on both library cores (GQA, sq != sk, with and without a window): the fp64 softmax over the scores
    and one more column per head, ``sinks[h]``, of value zero; the torch core also with a padding mask, which the
    flash core refuses (its masked path has no sink)."""
    from megakernels.nn import attention_core

    torch.manual_seed(3)
    sq, sk, w = 20, 37, window
    q = torch.randn(2, sq, 4, 16, dtype=torch.float64)
    k, v = torch.randn(2, sk, 2, 16, dtype=torch.float64), torch.randn(2, sk, 2, 16, dtype=torch.float64)
    sinks = torch.tensor([-1.0, 0.0, 2.0, 4.0], dtype=torch.float64)
    qpos, kpos = torch.arange(sq)[:, None] + sk - sq, torch.arange(sk)[None, :]
    hidden = (kpos > qpos) if causal else torch.zeros(sq, sk, dtype=torch.bool)
    if w:
        hidden = hidden | ((kpos <= qpos - w) if causal else ((qpos - kpos).abs() >= w))

    def reference(hidden):
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, 2)) / 4.0
        scores = scores.masked_fill(hidden, float("-inf"))
        scores = torch.cat((scores, sinks[None, :, None, None].expand(2, 4, sq, 1)), -1)
        return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1)[..., :sk], v.repeat_interleave(2, 2))

    for name in ("flash", "torch"):
        got = attention_core(name, causal, window=w)(q, k, v, sinks=sinks)
        torch.testing.assert_close(got, reference(hidden), rtol=1e-10, atol=1e-10, msg=name)
    if not causal:
        pad = torch.zeros(2, 1, 1, sk, dtype=torch.bool)
        pad[1, ..., :3] = True
        got = attention_core("torch", False, window=w)(q, k, v, mask=pad, sinks=sinks)
        torch.testing.assert_close(got, reference(hidden | pad), rtol=1e-10, atol=1e-10)
        with pytest.raises(ValueError, match="sinks go through the FlashAttention kernels, not with a mask"):
            attention_core("flash", False, window=w)(q, k, v, mask=pad, sinks=sinks)
