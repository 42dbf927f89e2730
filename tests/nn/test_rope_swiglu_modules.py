"""RotaryEmbedding and FusedSwiGLU as modules: the ops' numerics, the cached-table mode, constructor errors, and a
Llama-style block under torch.compile(fullgraph=True)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megakernels.nn import FusedRMSNorm, FusedSwiGLU, RotaryEmbedding
from megakernels.ops import fused_rope, rope_reference, swiglu_reference
from tests.helpers import assert_close_to_reference, make


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_rotary_embedding_applies_fused_rope(interleaved):
    q, k = make((2, 6, 4, 16), torch.float32, "cpu"), make((2, 6, 2, 16), torch.float32, "cpu", seed=1)
    module = RotaryEmbedding(16, theta=500000.0, interleaved=interleaved)
    out = module(q, k, position_offset=3)
    ref = rope_reference(q, k, theta=500000.0, interleaved=interleaved, position_offset=3)
    assert_close_to_reference(out[0], ref[0], torch.float32, "q")
    assert_close_to_reference(out[1], ref[1], torch.float32, "k")
    sbd = module(q.transpose(0, 1), k.transpose(0, 1), seq_dim=0, position_offset=3)
    assert torch.equal(sbd[0].transpose(0, 1), out[0])


def test_rotary_embedding_with_a_cached_table_matches_computed_angles():
    q, k = make((1, 8, 2, 32), torch.bfloat16, "cpu"), make((1, 8, 1, 32), torch.bfloat16, "cpu", seed=1)
    cached = RotaryEmbedding(32, theta=10000.0, max_positions=64)
    assert cached.cos_sin.shape == (64, 16, 2) and "cos_sin" not in cached.state_dict()
    pos = torch.tensor([0, 9, 63, 4, 5, 6, 40, 41])
    a, c = cached(q, k, pos), fused_rope(q, k, pos)
    assert_close_to_reference(a[0], c[0].double(), torch.bfloat16, "cached vs computed")


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(head_dim=7), ValueError, "head_dim must be even"),
        (dict(head_dim=0), ValueError, "head_dim must be an int >= 2"),
        (dict(head_dim=8.0), TypeError, "head_dim must be an int"),
        (dict(head_dim=8, theta=-1.0), ValueError, "theta must be a finite number > 0"),
        (dict(head_dim=8, theta="1e4"), TypeError, "theta must be a real number"),
        (dict(head_dim=8, interleaved=1), TypeError, "interleaved must be a bool"),
        (dict(head_dim=8, max_positions=0), ValueError, "max_positions must be a positive int"),
    ],
)
def test_rotary_embedding_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=f"RotaryEmbedding: {match}"):
        RotaryEmbedding(**kwargs)


def test_rotary_embedding_refuses_another_head_dim():
    with pytest.raises(ValueError, match="RotaryEmbedding: q has head_dim 8, expected 16"):
        RotaryEmbedding(16)(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))


def test_fused_swiglu_module():
    x = make((3, 5, 24), torch.float32, "cpu")
    assert_close_to_reference(FusedSwiGLU()(x), swiglu_reference(x), torch.float32, "FusedSwiGLU")
    assert list(FusedSwiGLU().parameters()) == []


class LlamaBlockCore(nn.Module):
    """RMSNorm, q/k/v projection with RoPE, and the SwiGLU MLP, as a Llama layer uses them (attention left out)."""

    def __init__(self, h=32, heads=4, kv_heads=2, ffn=48):
        super().__init__()
        self.heads, self.kv_heads, self.d = heads, kv_heads, h // heads
        self.norm = FusedRMSNorm(h)
        self.qkv = nn.Linear(h, (heads + 2 * kv_heads) * self.d, bias=False)
        self.rope = RotaryEmbedding(self.d, theta=500000.0)
        self.gate_up = nn.Linear(h, 2 * ffn, bias=False)
        self.act = FusedSwiGLU()
        self.down = nn.Linear(ffn, h, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(self.norm(x)).view(b, s, self.heads + 2 * self.kv_heads, self.d)
        q, k = self.rope(qkv[:, :, : self.heads], qkv[:, :, self.heads : self.heads + self.kv_heads])
        mixed = q.sum(2).repeat(1, 1, self.heads) + k.sum(2).repeat(1, 1, self.heads)
        return x + self.down(self.act(self.gate_up(mixed)))


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_forward_and_backward(compile_backend):
    torch.manual_seed(0)
    model = LlamaBlockCore()
    compiled = torch.compile(model, fullgraph=True, backend=compile_backend)
    x = make((2, 6, 32), torch.float32, "cpu")
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    eager = model(x1)
    eager.square().sum().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out = compiled(x2)
    out.square().sum().backward()
    assert_close_to_reference(out, eager, torch.float32, "compiled output")
    assert_close_to_reference(x2.grad, x1.grad, torch.float32, "compiled input grad")
    for g, p in zip(eager_grads, model.parameters()):
        assert_close_to_reference(p.grad, g, torch.float32, "compiled param grad", factor=5)
