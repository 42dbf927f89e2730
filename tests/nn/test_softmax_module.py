"""FusedScaleMaskSoftmax as a drop-in module: its three modes against the eager composition, the mask/causal
rule, argument checks, and torch.compile(fullgraph=True) of an attention block that uses it."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from megakernels.nn import FusedScaleMaskSoftmax
from megakernels.ops.softmax import causal_mask
from tests.helpers import assert_close_to_reference, make


def eager(x, mask, scale):
    z = x.double() * scale
    if mask is not None:
        z = z.masked_fill(mask, float("-inf"))
    return torch.softmax(z, -1)


def test_default_scale_is_one_and_no_mask_is_plain_softmax():
    x = make((2, 3, 4, 10), torch.float32, "cpu")
    assert_close_to_reference(FusedScaleMaskSoftmax()(x), eager(x, None, 1.0), torch.float32, "softmax")


def test_padding_mask_mode():
    x = make((2, 3, 4, 10), torch.float32, "cpu")
    pad = torch.zeros(2, 1, 1, 10, dtype=torch.bool)
    pad[0, ..., 7:] = True
    m = FusedScaleMaskSoftmax(scale=0.125)
    assert_close_to_reference(m(x, pad), eager(x, pad, 0.125), torch.float32, "masked")


@pytest.mark.parametrize("sq, sk", [(6, 6), (3, 8)])
def test_causal_mode(sq, sk):
    x = make((2, 3, sq, sk), torch.bfloat16, "cpu")
    y = FusedScaleMaskSoftmax(scale=0.5, causal=True)(x)
    assert y.dtype == torch.bfloat16
    assert_close_to_reference(y, eager(x, causal_mask(sq, sk), 0.5), torch.bfloat16, "causal")


def test_mask_with_causal_is_an_error():
    with pytest.raises(ValueError, match="mask with causal=True"):
        FusedScaleMaskSoftmax(causal=True)(torch.randn(1, 1, 2, 2), torch.zeros(1, 1, 2, 2, dtype=torch.bool))


def test_bad_scale():
    with pytest.raises(TypeError, match="scale must be a real number"):
        FusedScaleMaskSoftmax(scale="1")
    with pytest.raises(ValueError, match="scale must be a finite number"):
        FusedScaleMaskSoftmax(scale=math.inf)
    assert "scale=0.25, causal=True" in repr(FusedScaleMaskSoftmax(0.25, causal=True))


class Attention(nn.Module):
    """Single-head-group self-attention as a user would write it with the fused softmax."""

    def __init__(self, h=32, heads=4, causal=False):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(h, 3 * h)
        self.out = nn.Linear(h, h)
        self.softmax = FusedScaleMaskSoftmax(scale=1 / math.sqrt(h // heads), causal=causal)

    def forward(self, x, mask=None):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        p = self.softmax(q @ k.transpose(-1, -2), mask)
        return self.out((p @ v).transpose(1, 2).reshape(b, s, h))


@pytest.mark.parametrize("causal", [False, True], ids=["padding_mask", "causal"])
@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_forward_and_backward(compile_backend, causal):
    torch.manual_seed(0)
    model = Attention(causal=causal)
    compiled = torch.compile(model, fullgraph=True, backend=compile_backend)
    x = make((2, 6, 32), torch.float32, "cpu")
    mask = None
    if not causal:
        mask = torch.zeros(2, 1, 1, 6, dtype=torch.bool)
        mask[1, ..., 4:] = True
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    eager_out = model(x1, mask)
    eager_out.square().sum().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out = compiled(x2, mask)
    out.square().sum().backward()
    assert_close_to_reference(out, eager_out, torch.float32, "compiled output")
    assert_close_to_reference(x2.grad, x1.grad, torch.float32, "compiled input grad")
    for g, p in zip(eager_grads, model.parameters()):
        assert_close_to_reference(p.grad, g, torch.float32, "compiled param grad", factor=5)
