"""Fused LayerNorm (+ GeLU epilogue) and RMSNorm over the last dimension.

Algorithm (csrc/norms): each row's mean and variance are computed in fp32 (fp64 for fp64 input) — Welford on the
GPU, two-pass over a cached row on the CPU — then ``y = act((x - mean) * rstd * weight + bias)`` is written in
x's dtype in the same pass. Only ``mean`` and ``rstd`` (one fp32 each per row) are saved for backward besides the
input; the normalised tensor is recomputed. Backward per row::

    dz    = dy * act'(xhat * w + b)            (dz = dy without activation)
    dx    = rstd * (dz*w - mean(dz*w) - xhat * mean(dz*w*xhat))
    dw    = sum_rows dz * xhat,  db = sum_rows dz   (deterministic fixed-order reductions)

RMSNorm is the same with mean = 0 and no bias: ``rstd = 1/sqrt(mean(x^2) + eps)``.

Dtypes: x in fp32/fp16/bf16/fp64; weight/bias in x's dtype or fp32 when x is fp16/bf16 (apex's mixed LayerNorm);
output in x's dtype. Any leading shape; any hidden size >= 1.
"""

from __future__ import annotations

import torch

import megakernels._lib  # noqa: F401  (registers torch.ops.megakernels.*)
from megakernels._backend import emulate_for
from megakernels.ops import _checks
from megakernels.ops._autograd import eager_autograd

ACTIVATIONS = {None: 0, "none": 0, "gelu": 1, "gelu_tanh": 2}


def activation_code(op: str, activation: str | None) -> int:
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be None, 'gelu' or 'gelu_tanh', got {activation!r}")
    return ACTIVATIONS[activation]


@torch.library.register_fake("megakernels::norm_fwd")
def _norm_fwd_fake(x, weight, bias, eps, activation, rms, emulate):
    _checks.same_device("rms_norm" if rms else "layer_norm", "x", x, ("weight", weight), ("bias", bias))
    rows = x.numel() // max(x.shape[-1], 1)  # hidden 0 is rejected by the real kernel
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return y, x.new_empty((0 if rms else rows,), dtype=acc), x.new_empty((rows,), dtype=acc)


@torch.library.register_fake("megakernels::norm_bwd")
def _norm_bwd_fake(grad_output, x, weight, bias, mean, rstd, activation, rms, emulate):
    _checks.same_device(
        "rms_norm_backward" if rms else "layer_norm_backward",
        "x",
        x,
        ("grad_output", grad_output),
        ("weight", weight),
        ("bias", bias),
        ("mean", mean),
        ("rstd", rstd),
    )
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dw = torch.empty_like(weight) if weight is not None else x.new_empty((0,))
    db = torch.empty_like(bias) if bias is not None else x.new_empty((0,))
    return dx, dw, db


def _norm_setup_context(ctx, inputs, output):
    x, weight, bias, _eps, activation, rms, emulate = inputs
    _y, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.activation, ctx.rms, ctx.emulate = activation, rms, emulate


def _norm_backward(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = torch.ops.megakernels.norm_bwd(dy, x, weight, bias, mean, rstd, ctx.activation, ctx.rms, ctx.emulate)
    return dx, (dw if weight is not None else None), (db if bias is not None else None), None, None, None, None


torch.library.register_autograd("megakernels::norm_fwd", _norm_backward, setup_context=_norm_setup_context)
_norm_fwd = eager_autograd(
    "norm_fwd_eager", torch.ops.megakernels.norm_fwd.default, _norm_setup_context, _norm_backward
)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    activation: str | None = None,
) -> torch.Tensor:
    """LayerNorm over the last dimension with an optional fused GeLU epilogue.

    Args:
        x: ``[..., hidden]``, fp32/fp16/bf16/fp64, on CPU or CUDA (non-contiguous input is copied).
        weight, bias: ``[hidden]`` or None, on x's device; x's dtype, or fp32 for a fp16/bf16 x.
        eps: added to the variance, a finite real number >= 0.
        activation: None, ``"gelu"`` (erf) or ``"gelu_tanh"``, applied to ``xhat * weight + bias``.

    Returns:
        ``[..., hidden]`` in x's dtype. Differentiable w.r.t. x, weight and bias.

    Raises:
        TypeError: a non-tensor or non-floating argument, an eps that is not a real number. ValueError: a sparse
        tensor, a weight/bias of the wrong length or on another device than x (meta included), an empty last
        dimension, a negative or non-finite eps, an unknown activation, a backend that cannot take x.
    """
    op = "layer_norm"
    _checks.tensor(op, "x", x)
    _checks.tensor(op, "weight", weight, optional=True)
    _checks.tensor(op, "bias", bias, optional=True)
    act = activation_code(op, activation)
    eps = _checks.real(op, "eps", eps, minimum=0.0)
    y, _, _ = _norm_fwd(x, weight, bias, eps, act, False, emulate_for(op, x))
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x^2) + eps) * weight``.

    Same dtypes, shapes, devices and errors as :func:`layer_norm` (no bias, no activation).
    """
    op = "rms_norm"
    _checks.tensor(op, "x", x)
    _checks.tensor(op, "weight", weight, optional=True)
    eps = _checks.real(op, "eps", eps, minimum=0.0)
    y, _, _ = _norm_fwd(x, weight, None, eps, 0, True, emulate_for(op, x))
    return y


# ----------------------------------------------------------------------------------------------------------------
# Reference semantics in plain PyTorch (used by the tests and as documentation).


def gelu_reference(z: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None or activation == "none":
        return z
    return torch.nn.functional.gelu(z, approximate="tanh" if activation == "gelu_tanh" else "none")


def layer_norm_reference(x, weight=None, bias=None, eps=1e-5, activation=None, compute_dtype=torch.float64):
    """``layer_norm`` computed in ``compute_dtype`` with ``torch.nn.functional`` ops; returns compute_dtype."""
    xc = x.to(compute_dtype)
    wc = weight.to(compute_dtype) if weight is not None else None
    bc = bias.to(compute_dtype) if bias is not None else None
    z = torch.nn.functional.layer_norm(xc, (x.shape[-1],), wc, bc, eps)
    return gelu_reference(z, activation)


def rms_norm_reference(x, weight=None, eps=1e-6, compute_dtype=torch.float64):
    xc = x.to(compute_dtype)
    y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    return y * weight.to(compute_dtype) if weight is not None else y
