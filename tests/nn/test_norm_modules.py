"""FusedLayerNorm / FusedRMSNorm / FusedBiasGeLU as drop-in modules: state_dict compatibility with torch.nn,
numerics against the torch.nn modules, and torch.compile(fullgraph=True)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from megakernels.nn import FusedBiasGeLU, FusedLayerNorm, FusedRMSNorm
from tests.helpers import assert_close_to_reference, make


def randomize(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return module


@pytest.mark.parametrize("shape", [16, (4, 8)])
def test_layer_norm_state_dict_round_trips_with_torch(shape):
    ref = randomize(nn.LayerNorm(shape))
    fused = FusedLayerNorm(shape)
    fused.load_state_dict(ref.state_dict())
    assert set(fused.state_dict()) == {"weight", "bias"}
    back = nn.LayerNorm(shape)
    back.load_state_dict(fused.state_dict())
    x = make((3, 5, *((shape,) if isinstance(shape, int) else shape)), torch.float32, "cpu")
    assert_close_to_reference(fused(x), ref.double()(x.double()), torch.float32, "FusedLayerNorm")
    ref.float()
    assert torch.equal(back(x), ref(x))


def test_layer_norm_constructor_matches_torch_variants():
    for kwargs in [dict(elementwise_affine=False), dict(bias=False), dict(eps=1e-3)]:
        ref, fused = nn.LayerNorm(32, **kwargs), FusedLayerNorm(32, **kwargs)
        assert set(ref.state_dict()) == set(fused.state_dict()), kwargs
        randomize(ref)
        fused.load_state_dict(ref.state_dict())
        x = make((6, 32), torch.float32, "cpu", shift=1.0)
        assert_close_to_reference(fused(x), ref.double()(x.double()), torch.float32, str(kwargs))


def test_layer_norm_module_with_gelu_epilogue_and_bf16_input_fp32_params():
    m = randomize(FusedLayerNorm(64, activation="gelu_tanh"))
    x = make((10, 64), torch.bfloat16, "cpu").requires_grad_(True)
    y = m(x)
    assert y.dtype == torch.bfloat16
    ref = nn.functional.gelu(
        nn.functional.layer_norm(x.double(), (64,), m.weight.double(), m.bias.double()), approximate="tanh"
    )
    assert_close_to_reference(y, ref, torch.bfloat16, "LN+GeLU")
    y.float().sum().backward()
    assert m.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16


def test_rms_norm_module_matches_torch():
    ref = randomize(nn.RMSNorm(48, eps=1e-6))
    fused = FusedRMSNorm(48, eps=1e-6)
    fused.load_state_dict(ref.state_dict())
    x = make((7, 48), torch.float32, "cpu", shift=2.0)
    assert_close_to_reference(fused(x), ref.double()(x.double()), torch.float32, "FusedRMSNorm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_module_with_offset_is_gemmas_one_plus_weight(dtype):
    """offset=1.0: ``x / rms(x) * (1 + weight)`` with the sum in fp32 (the weight stored as the offset from one, so
    it starts at zeros and is never changed); against fp64 and its gradients, a bf16 weight under a bf16 input."""
    m = FusedRMSNorm(48, eps=1e-6, offset=1.0, dtype=dtype)
    assert torch.equal(m.weight, torch.zeros(48, dtype=dtype)) and "offset=1.0" in repr(m)
    randomize(m)
    stored = m.weight.detach().clone()
    x = make((7, 48), dtype, "cpu", shift=2.0).requires_grad_(True)
    y = m(x)
    assert y.dtype == dtype and torch.equal(m.weight.detach(), stored)
    xd, wd = x.detach().double().requires_grad_(True), m.weight.detach().double().requires_grad_(True)
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + wd)
    assert_close_to_reference(y, ref, dtype, "offset RMSNorm")
    dy = make((7, 48), dtype, "cpu", seed=5)
    y.backward(dy)
    ref.backward(dy.double())
    assert_close_to_reference(x.grad, xd.grad, dtype, "dx")
    assert m.weight.grad.dtype == dtype
    assert_close_to_reference(m.weight.grad, wd.grad, dtype, "dweight")


def test_rms_norm_module_offset_must_be_finite_and_have_a_weight():
    with pytest.raises(ValueError, match="FusedRMSNorm: offset"):
        FusedRMSNorm(8, offset=float("inf"))
    with pytest.raises(TypeError, match="FusedRMSNorm: offset"):
        FusedRMSNorm(8, offset="1")
    with pytest.raises(ValueError, match="FusedRMSNorm: offset is 1.0; an offset needs elementwise_affine=True"):
        FusedRMSNorm(8, offset=1.0, elementwise_affine=False)
    assert torch.equal(FusedRMSNorm(8).weight, torch.ones(8))  # default: torch's RMSNorm


def test_bias_gelu_module_uses_own_or_given_bias():
    m = randomize(FusedBiasGeLU(24, approximate="none"))
    x = make((5, 24), torch.float32, "cpu")
    expect = nn.functional.gelu(x.double() + m.bias.double())
    assert_close_to_reference(m(x), expect, torch.float32, "own bias")
    other = make((24,), torch.float32, "cpu", seed=3)
    assert_close_to_reference(m(x, other), nn.functional.gelu(x.double() + other.double()), torch.float32, "given")


def test_bad_module_arguments():
    with pytest.raises(ValueError, match="activation must be"):
        FusedLayerNorm(8, activation="swish")
    with pytest.raises(ValueError, match="normalized_shape"):
        FusedLayerNorm(0)
    with pytest.raises(ValueError, match="do not match normalized_shape"):
        FusedLayerNorm((4, 8))(torch.randn(2, 8, 4))
    with pytest.raises(ValueError, match="approximate must be"):
        FusedBiasGeLU(8, approximate="fast")


@pytest.mark.parametrize("module", [FusedLayerNorm, FusedRMSNorm])
@pytest.mark.parametrize("shape", [2.5, "8", [4.0], (4, "8"), None, True])
def test_normalized_shape_that_is_not_ints_is_refused_naming_it_and_the_value(module, shape):
    with pytest.raises(
        TypeError, match=rf"{module.__name__}: normalized_shape must be .* got {re.escape(repr(shape))}"
    ):
        module(shape)


@pytest.mark.parametrize("eps, exc", [(None, TypeError), ("1e-5", TypeError), (-1.0, ValueError)])
def test_layer_norm_module_eps_must_be_a_number(eps, exc):
    with pytest.raises(exc, match="FusedLayerNorm: eps must be"):
        FusedLayerNorm(8, eps=eps)


def test_rms_norm_module_eps_none_means_the_dtype_epsilon_as_torch():
    x = make((3, 8), torch.float32, "cpu", scale=1e-4)
    expect = nn.RMSNorm(8, eps=None)(x)
    assert_close_to_reference(FusedRMSNorm(8, eps=None)(x), expect.double(), torch.float32, "eps=None")
    with pytest.raises(TypeError, match="FusedRMSNorm: eps must be a real number"):
        FusedRMSNorm(8, eps="small")


class Block(nn.Module):
    """A pre-norm MLP as a user would write it with the fused modules."""

    def __init__(self, h=32):
        super().__init__()
        self.norm = FusedLayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h, bias=False)
        self.act = FusedBiasGeLU(4 * h)
        self.fc2 = nn.Linear(4 * h, h)
        self.norm2 = FusedRMSNorm(h)
        self.ln_gelu = FusedLayerNorm(h, activation="gelu")

    def forward(self, x):
        y = x + self.fc2(self.act(self.fc1(self.norm(x))))
        return self.ln_gelu(self.norm2(y))


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_forward_and_backward(compile_backend):
    torch.manual_seed(0)
    model = randomize(Block())
    compiled = torch.compile(model, fullgraph=True, backend=compile_backend)
    x = make((4, 6, 32), torch.float32, "cpu")
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    eager_out = model(x1)
    eager_out.square().sum().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out = compiled(x2)
    out.square().sum().backward()
    assert_close_to_reference(out, eager_out, torch.float32, "compiled output")
    assert_close_to_reference(x2.grad, x1.grad, torch.float32, "compiled input grad")
    for g, p in zip(eager_grads, model.parameters()):
        assert_close_to_reference(p.grad, g, torch.float32, "compiled param grad", factor=5)
