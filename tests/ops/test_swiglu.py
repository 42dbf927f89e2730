"""Specification of swiglu on every backend: forward and backward against the fp64 plain-PyTorch reference over
dtypes and widths, any leading shape, strided views, saturating gates, fp64 gradcheck and torch.library.opcheck."""

from __future__ import annotations

import pytest
import torch

from megakernels.ops import geglu, geglu_reference, swiglu, swiglu_reference
from tests.helpers import assert_close_to_reference, kernel_grads, make, reference_grads

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
WIDTHS = [1, 3, 8, 40, 1000, 2056, 4104]


def check(backend, x, dtype, factor=1.0):
    dy = make((*x.shape[:-1], x.shape[-1] // 2), dtype, backend.device, seed=9)
    out, (dx,) = kernel_grads(swiglu, [x], dy)
    ref, (rdx,) = reference_grads(swiglu_reference, [x], dy)
    assert out.dtype == dtype and dx.dtype == dtype
    assert_close_to_reference(out, ref, dtype, "y", factor=factor)
    assert_close_to_reference(dx, rdx, dtype, "dx", factor=2 * factor)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("f", WIDTHS)
def test_forward_and_backward_match_fp64_reference(backend, dtype, f):
    rows = 3 if backend.emulated else 17
    check(backend, make((rows, 2 * f), dtype, backend.device, scale=2.0), dtype)


@pytest.mark.parametrize("shape", [(6,), (2, 3, 16), (2, 1, 3, 64)], ids=lambda s: f"rank{len(s)}")
def test_any_leading_shape(backend, shape):
    check(backend, make(shape, torch.float32, backend.device), torch.float32)


def test_packing_is_gate_first_then_up(backend):
    gate, up = make((4, 8), torch.float32, backend.device), make((4, 8), torch.float32, backend.device, seed=1)
    expect = torch.nn.functional.silu(gate.double()) * up.double()
    assert_close_to_reference(swiglu(torch.cat([gate, up], -1)), expect, torch.float32, "silu(gate) * up")


def test_strided_views_are_handled(backend):
    wide = make((5, 80), torch.bfloat16, backend.device)
    check(backend, wide[:, :64], torch.bfloat16)  # rows wider than 2f: read through the row stride
    check(backend, make((64, 5), torch.float32, backend.device).t(), torch.float32)  # last-dim stride 64: copied


def test_saturating_gates_give_the_limits_without_nan(backend):
    g = torch.tensor([[-1000.0, -100.0, -30.0, 0.0, 30.0, 100.0, 1000.0, float("inf")]], device=backend.device)
    x = torch.cat([g, torch.full_like(g, 2.0)], -1).requires_grad_(True)
    out = swiglu(x)
    y = out[0].detach().cpu()
    assert (y[:3].abs() <= 1e-11).all() and y[3].item() == 0.0  # silu(g) -> 0 as g -> -inf
    assert torch.allclose(y[4:7], 2 * g[0, 4:7].cpu()) and y[7].item() == float("inf")  # silu(g) -> g
    out[0, :7].sum().backward()
    assert torch.isfinite(x.grad[0, :7]).all() and torch.isfinite(x.grad[0, 8:15]).all()


def test_nan_propagates(backend):
    x = torch.tensor([[float("nan"), 1.0, 2.0, float("nan")]], device=backend.device)
    assert torch.isnan(swiglu(x)).all()


def test_gradcheck_fp64(backend):
    x = make((3, 2, 10), torch.float64, backend.device, scale=3.0).requires_grad_(True)
    assert torch.autograd.gradcheck(swiglu, (x,))


def test_empty_input_gives_empty_output(backend):
    x = make((0, 3, 16), torch.float32, backend.device).requires_grad_(True)
    y = swiglu(x)
    assert y.shape == (0, 3, 8)
    y.sum().backward()
    assert x.grad.shape == (0, 3, 16)


def test_cpu_result_independent_of_thread_count():
    x = make((300, 514), torch.bfloat16, "cpu")
    dy = make((300, 257), torch.bfloat16, "cpu", seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel_grads(swiglu, [x], dy)
        torch.set_num_threads(max(2, threads))
        many = kernel_grads(swiglu, [x], dy)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], many[0]) and torch.equal(one[1][0], many[1][0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck(dtype):
    x = make((4, 3, 32), dtype, "cpu").requires_grad_(True)
    torch.library.opcheck(torch.ops.megakernels.swiglu_fwd.default, (x, False))
    dy = make((4, 3, 16), dtype, "cpu", seed=1)
    torch.library.opcheck(torch.ops.megakernels.swiglu_bwd.default, (dy, x.detach(), False))


# gpt-oss's clamped SwiGLU (limit, alpha) and GeGLU share the kernel body; the references are plain fp64 PyTorch
# (torch.clamp's gradient, F.gelu(approximate="tanh")).
GATED = {
    "clamped": (lambda x: swiglu(x, limit=7.0, alpha=1.702), lambda x: swiglu_reference(x, limit=7.0, alpha=1.702)),
    "geglu": (geglu, geglu_reference),
}


@pytest.mark.parametrize("kind", GATED)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("f", [3, 40, 2056])
def test_gated_variants_match_fp64_reference(backend, kind, dtype, f):
    fn, ref_fn = GATED[kind]
    x = make((3 if backend.emulated else 17, 2 * f), dtype, backend.device, scale=6.0)  # |x| past the clamp bound
    dy = make((x.shape[0], f), dtype, backend.device, seed=9)
    out, (dx,) = kernel_grads(fn, [x], dy)
    ref, (rdx,) = reference_grads(ref_fn, [x], dy)
    assert_close_to_reference(out, ref, dtype, "y")
    assert_close_to_reference(dx, rdx, dtype, "dx", factor=2.0)


def test_clamped_swiglu_is_gpt_oss_formula_on_interleaved_columns(backend):
    # transformers' GptOssExperts takes gate = gate_up[..., ::2], up = gate_up[..., 1::2]; de-interleaved into
    # [gate | up] the kernel gives the same product.
    gate_up = make((5, 16), torch.float64, backend.device, scale=10.0)
    gate, up = gate_up[..., ::2].clamp(max=7.0), gate_up[..., 1::2].clamp(-7.0, 7.0)
    expect = (up + 1) * (gate * torch.sigmoid(gate * 1.702))
    packed = torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], -1)
    assert torch.allclose(swiglu(packed, limit=7.0, alpha=1.702), expect, rtol=1e-12, atol=1e-12)


def test_geglu_is_gelu_tanh_gated(backend):
    gate, up = make((4, 8), torch.float64, backend.device), make((4, 8), torch.float64, backend.device, seed=1)
    expect = torch.nn.functional.gelu(gate, approximate="tanh") * up
    assert torch.allclose(geglu(torch.cat([gate, up], -1)), expect, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", GATED)
def test_gated_variants_gradcheck_fp64(backend, kind):
    x = make((3, 2, 10), torch.float64, backend.device, scale=3.0).requires_grad_(True)
    assert torch.autograd.gradcheck(GATED[kind][0], (x,))


def test_gated_variants_saturate_without_nan(backend):
    g = torch.tensor([[-1000.0, -100.0, -30.0, 0.0, 30.0, 100.0, 1000.0]], device=backend.device)
    for fn in (GATED["clamped"][0], geglu):
        x = torch.cat([g, torch.full_like(g, 2.0)], -1).requires_grad_(True)
        out = fn(x)
        out.sum().backward()
        assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()


def test_clamped_swiglu_rejects_bad_arguments():
    x = make((2, 8), torch.float32, "cpu")
    with pytest.raises(ValueError, match="limit"):
        swiglu(x, limit=0.0)
    with pytest.raises(ValueError, match="alpha"):
        swiglu(x, alpha=1.702)
    with pytest.raises(ValueError, match="act"):
        torch.ops.megakernels.swiglu_fwd(x, False, 7)


@pytest.mark.parametrize("act,limit,alpha", [(1, 7.0, 1.702), (2, 0.0, 1.0)], ids=["clamped", "geglu"])
def test_gated_variants_opcheck(act, limit, alpha):
    x = make((4, 3, 32), torch.float32, "cpu").requires_grad_(True)
    torch.library.opcheck(torch.ops.megakernels.swiglu_fwd.default, (x, False, act, limit, alpha))
    dy = make((4, 3, 16), torch.float32, "cpu", seed=1)
    torch.library.opcheck(torch.ops.megakernels.swiglu_bwd.default, (dy, x.detach(), False, act, limit, alpha))
