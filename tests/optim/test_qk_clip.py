"""MuonClip (megakernels.optim.qk_clip): the maximum logit per head against the logits materialised and masked
here (causal, a window, packed documents, padding, grouped keys); clipping a head brings its largest logit to tau
exactly — multi-head attention through both projections, grouped-query attention through the queries — and leaves
the other heads alone; what it refuses."""

from __future__ import annotations

import math

import pytest
import torch

from megakernels.ops import attention_logits
from megakernels.optim import qk_clip
from megakernels.parallel.launch import single_process_world


@pytest.fixture
def single_world():
    """``megakernels.parallel`` initialised at tp = pp = dp = 1 (the attention blocks read the layout)."""
    with single_process_world(parallel=True):
        yield


def _logits_reference(q, k, scale, causal, window, mask, documents):
    b, sq, h, d = q.shape
    sk = k.shape[1]
    kf = k.double().repeat_interleave(h // k.shape[2], dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kf) * scale
    i = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    seen = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        seen &= j <= i
    if window:
        seen &= (i - j).abs() < window
    seen = seen.expand(b, h, sq, sk).clone()
    if mask is not None:
        seen &= ~mask.expand(b, h, sq, sk)
    if documents is not None:
        seen &= documents[:, None, :, None] == documents[:, None, None, :]
    return s.masked_fill(~seen, float("-inf")).amax(dim=(0, 2, 3))


@pytest.mark.parametrize(
    "causal,window,masking,kv",
    [(True, None, None, 4), (True, 5, None, 2), (False, None, "padding", 4), (True, None, "documents", 1)],
)
def test_max_logits_match_the_masked_logits(causal, window, masking, kv):
    g = torch.Generator().manual_seed(0)
    b, s, h, d = 2, 13, 4, 8
    q, k = torch.randn(b, s, h, d, generator=g), torch.randn(b, s, kv, d, generator=g)
    mask = documents = None
    if masking == "padding":
        mask = torch.zeros(b, 1, 1, s, dtype=torch.bool)
        mask[1, ..., 9:] = True
    if masking == "documents":
        documents = torch.tensor([[0] * 5 + [1] * 8, [0] * 2 + [1] * 6 + [2] * 5])
    scale = 0.3
    got = attention_logits.max_logits(q, k, scale, causal, window, mask, documents, chunk=4)
    want = _logits_reference(q, k, scale, causal, window, mask, documents)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def _blocks():
    from megakernels.parallel.blocks import ParallelGroupedQueryAttention, ParallelSelfAttention

    torch.manual_seed(1)
    return {
        "mha-qkv": ParallelSelfAttention(32, 4, core="torch", bias=True),
        "mha-q-kv": ParallelGroupedQueryAttention(32, 4, 4, core="torch", bias=True),
        "gqa": ParallelGroupedQueryAttention(32, 4, 2, core="torch"),
    }


@pytest.mark.parametrize("kind", ["mha-qkv", "mha-q-kv", "gqa"])
def test_clipping_brings_a_heads_largest_logit_to_tau(single_world, kind):
    block = _blocks()[kind]
    with torch.no_grad():  # large query/key weights: logits well above 1
        for p in block.parameters():
            p.mul_(4.0)
    model = torch.nn.Sequential(block)
    qk_clip.track(model)
    x = torch.randn(10, 2, 32, generator=torch.Generator().manual_seed(2))
    model(x)
    before = block.max_logits.clone()
    tau = float(before.median())
    assert (before > tau).any() and (before <= tau).any()
    assert qk_clip.clip_(model, tau) == pytest.approx(float(before.max()))
    assert torch.equal(block.max_logits, torch.zeros_like(before))  # reset for the next step
    model(x)
    torch.testing.assert_close(block.max_logits, before.clamp(max=tau), rtol=1e-5, atol=1e-5)


def test_grouped_query_clipping_leaves_the_shared_keys(single_world):
    block = _blocks()["gqa"]
    kv = block.kv.weight.detach().clone()
    gamma = torch.tensor([0.25, 1.0, 0.5, 1.0])
    for p, scale in qk_clip.row_scales(block, gamma):
        with torch.no_grad():
            p.mul_(scale[:, None])
    assert torch.equal(block.kv.weight, kv)


def test_a_flat_piece_takes_its_rows_scales():
    w = torch.arange(12.0).view(4, 3)
    scale = torch.tensor([1.0, 2.0, 3.0, 4.0])
    piece = w.reshape(-1)[4:10].clone()  # rows 1 (last 2), 2 (all), 3 (first)
    qk_clip.scale_rows_(piece, scale, 4, 3)
    assert torch.equal(piece, (w * scale[:, None]).reshape(-1)[4:10])


def test_per_head_norms_cannot_be_clipped(single_world):
    from megakernels.parallel.blocks import ParallelGroupedQueryAttention

    block = ParallelGroupedQueryAttention(32, 4, 2, core="torch", qk_norm_eps=1e-6)
    with pytest.raises(ValueError, match="qk_norm"):
        qk_clip.check(torch.nn.Sequential(block))


def test_gammas():
    got = qk_clip.gammas(torch.tensor([50.0, 100.0, 400.0, -3.0]), 100.0)
    assert got.tolist() == [1.0, 1.0, 0.25, 1.0]
    assert math.isclose(float(qk_clip.gammas(torch.tensor([250.0]), 100.0)), 0.4, rel_tol=1e-7)
