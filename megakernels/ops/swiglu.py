"""Fused gated activations on a packed gate/up projection ``x = [g | u]`` along the last dim, forward and backward
(csrc/swiglu): SwiGLU (Shazeer 2020) ``y = silu(g) * u``; the clamped SwiGLU of gpt-oss (``swiglu(x, limit=,
alpha=)``: ``g' = min(g, limit)``, ``y = g' * sigmoid(alpha * g') * (clamp(u, -limit, limit) + 1)``);
and GeGLU ``y = gelu_tanh(g) * u`` (``geglu``, Gemma's MLP). One kernel body, the activation a compile-time
parameter.

One read of x and one write of y (PyTorch eager writes silu(g) and reads it back; its backward materialises
sigmoid(g), silu(g) and two products). Backward recomputes from the saved x::

    s = sigmoid(g),  dg = dy * u * s * (1 + g * (1 - s)),  du = dy * g * s

and writes ``dx = [dg | du]`` in one pass. Packing: the gate comes first, then the up projection, in the last dim.
gpt-oss's checkpoints interleave gate and up columns; de-interleave them into this layout before the op.
Under tensor parallelism each rank's column shard of the fused gate/up weight is ``[gate_r | up_r]``, so the op
sees a self-contained local tensor and needs no communication. Math in fp32 (fp64 for fp64 x), output in x's dtype.
"""

from __future__ import annotations

import torch

import megakernels._lib  # noqa: F401  (registers torch.ops.megakernels.*)
from megakernels._backend import emulate_for
from megakernels.ops import _checks
from megakernels.ops._autograd import eager_autograd

OP = "swiglu"

# swiglu::Act (csrc/swiglu/swiglu.h)
SILU, CLAMPED_SILU, GELU_TANH = 0, 1, 2


@torch.library.register_fake("megakernels::swiglu_fwd")
def _swiglu_fwd_fake(x, emulate, act=SILU, limit=0.0, alpha=1.0):
    _check_packed(OP, x)
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def _check_packed(op: str, x: torch.Tensor) -> None:
    """The shape rule the kernel checks too, here for the fake (meta) path: ``[..., 2f]``."""
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"{op}: x has shape {tuple(x.shape)}; expected [..., 2 * f] (the gate half, then the up half)")


@torch.library.register_fake("megakernels::swiglu_bwd")
def _swiglu_bwd_fake(grad_output, x, emulate, act=SILU, limit=0.0, alpha=1.0):
    _checks.same_device("swiglu_backward", "x", x, ("grad_output", grad_output))
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _setup_context(ctx, inputs, output):
    x, *ctx.args = inputs
    ctx.save_for_backward(x)


def _backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return torch.ops.megakernels.swiglu_bwd(dy, x, *ctx.args), *([None] * len(ctx.args))


torch.library.register_autograd("megakernels::swiglu_fwd", _backward, setup_context=_setup_context)
_swiglu_fwd = eager_autograd("swiglu_fwd_eager", torch.ops.megakernels.swiglu_fwd.default, _setup_context, _backward)


def swiglu(x: torch.Tensor, limit: float | None = None, alpha: float = 1.0) -> torch.Tensor:
    """``silu(x[..., :f]) * x[..., f:]`` for x ``[..., 2f]``; with ``limit``, gpt-oss's clamped SwiGLU.

    Args:
        x: ``[..., 2f]``, the packed gate/up projection (gate first), fp32/bf16/fp16/fp64, any leading shape, CPU
            or CUDA. A non-unit last-dim stride (or leading dims that do not flatten) costs one copy.
        limit: None for plain SwiGLU; a positive bound for the clamped form
            ``g' = min(g, limit)``, ``y = g' * sigmoid(alpha * g') * (clamp(u, -limit, limit) + 1)``.
        alpha: the sigmoid's slope of the clamped form (gpt-oss: 1.702); must stay 1.0 without ``limit``.

    Returns:
        ``[..., f]`` in x's dtype; differentiable w.r.t. x (a clamp passes the gradient strictly inside its
        bounds, as torch.clamp does).

    Raises:
        TypeError: a non-tensor or non-floating x. ValueError: a sparse or 0-dim x, an odd last dim, a backend that
        cannot take x, a non-positive ``limit``, an ``alpha`` other than 1.0 without ``limit``.
    """
    _checks.tensor(OP, "x", x)
    if limit is None:
        if alpha != 1.0:
            raise ValueError(f"{OP}: alpha is {alpha}; a slope other than 1.0 needs limit (the clamped SwiGLU)")
        return _swiglu_fwd(x, emulate_for(OP, x))
    if not limit > 0:
        raise ValueError(f"{OP}: limit is {limit}; expected a positive clamp bound or None")
    return _swiglu_fwd(x, emulate_for(OP, x), CLAMPED_SILU, float(limit), float(alpha))


def geglu(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x[..., :f]) * x[..., f:]`` for x ``[..., 2f]`` (GeGLU with the tanh GeLU, Gemma's MLP).

    Args:
        x: ``[..., 2f]``, the packed gate/up projection (gate first), fp32/bf16/fp16/fp64, any leading shape, CPU
            or CUDA.

    Returns:
        ``[..., f]`` in x's dtype; differentiable w.r.t. x.

    Raises:
        TypeError: a non-tensor or non-floating x. ValueError: a sparse or 0-dim x, an odd last dim, a backend that
        cannot take x.
    """
    _checks.tensor("geglu", "x", x)
    return _swiglu_fwd(x, emulate_for(OP, x), GELU_TANH)


def swiglu_reference(x, compute_dtype=torch.float64, limit=None, alpha=1.0):
    """``F.silu(gate) * up`` (or, with ``limit``, gpt-oss's clamped form) in plain PyTorch in ``compute_dtype``
    (differentiable)."""
    gate, up = x.to(compute_dtype).chunk(2, dim=-1)
    if limit is None:
        return torch.nn.functional.silu(gate) * up
    gate = gate.clamp(max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up.clamp(-limit, limit) + 1)


def geglu_reference(x, compute_dtype=torch.float64):
    """``F.gelu(gate, approximate="tanh") * up`` in plain PyTorch in ``compute_dtype`` (differentiable)."""
    gate, up = x.to(compute_dtype).chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up
