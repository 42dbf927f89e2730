"""Fused bias-add + GeLU (Megatron's ``bias_gelu``): ``y = gelu(x + bias)``, bias broadcast over the leading dims.

One read of x and one write of y (PyTorch eager reads and writes the sum in between). Backward recomputes
``x + bias`` and returns ``dx = dy * gelu'(x + bias)`` and ``dbias = sum over rows of dx``, the latter reduced in a
fixed order (deterministic). fp32/fp16/bf16/fp64 x; bias in x's dtype or fp32 for a 16-bit x.
"""

from __future__ import annotations

import torch

import megakernels._lib  # noqa: F401
from megakernels._backend import emulate_for
from megakernels.ops import _checks
from megakernels.ops._autograd import eager_autograd

APPROXIMATIONS = {"none": 1, "tanh": 2}


@torch.library.register_fake("megakernels::bias_gelu_fwd")
def _bias_gelu_fwd_fake(x, bias, approximate, emulate):
    _checks.same_device("bias_gelu", "x", x, ("bias", bias))
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.register_fake("megakernels::bias_gelu_bwd")
def _bias_gelu_bwd_fake(grad_output, x, bias, approximate, emulate):
    _checks.same_device("bias_gelu_backward", "x", x, ("grad_output", grad_output), ("bias", bias))
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty_like(bias)


def _setup_context(ctx, inputs, output):
    x, bias, approximate, emulate = inputs
    ctx.save_for_backward(x, bias)
    ctx.approximate, ctx.emulate = approximate, emulate


def _backward(ctx, dy):
    x, bias = ctx.saved_tensors
    dx, dbias = torch.ops.megakernels.bias_gelu_bwd(dy, x, bias, ctx.approximate, ctx.emulate)
    return dx, dbias, None, None


torch.library.register_autograd("megakernels::bias_gelu_fwd", _backward, setup_context=_setup_context)
_bias_gelu_fwd = eager_autograd(
    "bias_gelu_fwd_eager", torch.ops.megakernels.bias_gelu_fwd.default, _setup_context, _backward
)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """``gelu(x + bias)`` in one pass.

    Args:
        x: ``[..., hidden]``, fp32/fp16/bf16/fp64, CPU or CUDA.
        bias: ``[hidden]`` on x's device, x's dtype or fp32 for a fp16/bf16 x.
        approximate: ``"tanh"`` (Megatron's default) or ``"none"`` (erf GeLU), as ``torch.nn.functional.gelu``.

    Returns:
        ``[..., hidden]`` in x's dtype; differentiable w.r.t. x and bias.

    Raises:
        TypeError / ValueError naming the argument for a wrong dtype, shape, layout (sparse), device (meta
        included) or ``approximate``.
    """
    op = "bias_gelu"
    _checks.tensor(op, "x", x)
    _checks.tensor(op, "bias", bias)
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"{op}: approximate must be 'tanh' or 'none', got {approximate!r}")
    return _bias_gelu_fwd(x, bias, APPROXIMATIONS[approximate], emulate_for(op, x))


def bias_gelu_reference(x, bias, approximate="tanh", compute_dtype=torch.float64):
    """Plain-PyTorch ``gelu(x + bias)`` in ``compute_dtype``."""
    return torch.nn.functional.gelu(x.to(compute_dtype) + bias.to(compute_dtype), approximate=approximate)
