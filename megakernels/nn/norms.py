"""Drop-in normalisation modules on the fused kernels.

``FusedLayerNorm`` takes torch.nn.LayerNorm's constructor arguments and has its state_dict keys (``weight``,
``bias``), so a LayerNorm checkpoint loads into it unchanged (and back); ``activation=`` adds the fused GeLU.
``FusedRMSNorm`` mirrors torch.nn.RMSNorm; ``offset=1.0`` makes it Gemma's ``x / rms(x) * (1 + weight)`` (the
weight stored as the offset from one, the sum taken in fp32). Multi-dimensional ``normalized_shape`` is supported by
flattening the normalised dims (the math is the same: statistics over all of them).
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from megakernels.ops import _checks
from megakernels.ops.norms import activation_code, layer_norm, rms_norm


def _shape(module: str, normalized_shape) -> tuple[int, ...]:
    """normalized_shape as a tuple of ints >= 1; anything else (a float such as 2.5, a string, an empty tuple) is an
    error naming the parameter and the value, never a silent int() truncation."""
    dims = (normalized_shape,) if isinstance(normalized_shape, numbers.Integral) else normalized_shape
    rule = f"{module}: normalized_shape must be a positive int or a non-empty tuple/list of positive ints"
    if not isinstance(dims, (tuple, list, torch.Size)) or not all(
        isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in dims
    ):
        raise TypeError(f"{rule}, got {normalized_shape!r}")
    if not dims or any(s < 1 for s in dims):
        raise ValueError(f"{rule}, got {normalized_shape!r}")
    return tuple(int(s) for s in dims)


def _flatten_last(op: str, x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    _checks.tensor(op, "x", x)
    k = len(shape)
    if tuple(x.shape[-k:]) != shape:
        raise ValueError(f"{op}: input's last dims {tuple(x.shape[-k:])} do not match normalized_shape {shape}")
    return x if k == 1 else x.reshape(*x.shape[:-k], math.prod(shape))


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """``rms_norm(x, weight + offset, eps)`` with ``weight + offset`` formed in fp32 (fp64 for a fp64 x) on each
    call, so a weight stored as the offset from one (Gemma's, initialised to zeros) keeps its precision under a
    bf16 x and the stored tensor is never changed.

    Args:
        x: ``[..., hidden]``, fp32/fp16/bf16/fp64. weight: ``[hidden]``, any floating dtype, on x's device.
        eps: added to the mean square, a real number >= 0. offset: a finite real number added to the weight.

    Returns:
        ``[..., hidden]`` in x's dtype; differentiable w.r.t. x and weight (the weight's gradient in its dtype).

    Raises:
        TypeError / ValueError: as :func:`megakernels.ops.rms_norm`, and a non-finite or non-real ``offset``.
    """
    offset = _checks.real("offset_rms_norm", "offset", offset)
    _checks.tensor("offset_rms_norm", "weight", weight)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return rms_norm(x, weight.to(acc) + offset, eps)


class FusedLayerNorm(nn.Module):
    """LayerNorm with an optional fused GeLU epilogue (``activation=None|"gelu"|"gelu_tanh"``).

    Same arguments and parameters as :class:`torch.nn.LayerNorm`. Input ``[..., *normalized_shape]``; fp32,
    fp16, bf16 or fp64; parameters may stay fp32 under a bf16/fp16 input (mixed precision).
    """

    def __init__(
        self,
        normalized_shape,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
        activation: str | None = None,
    ):
        super().__init__()
        self.normalized_shape = _shape("FusedLayerNorm", normalized_shape)
        self.eps = _checks.real("FusedLayerNorm", "eps", eps, minimum=0.0)
        self.elementwise_affine = elementwise_affine
        activation_code("FusedLayerNorm", activation)
        self.activation = activation
        factory = {"device": device, "dtype": dtype}
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape, **factory))
            self.bias = nn.Parameter(torch.zeros(self.normalized_shape, **factory)) if bias else None
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = _flatten_last("FusedLayerNorm", x, self.normalized_shape)
        w = self.weight.reshape(-1) if self.weight is not None else None
        b = self.bias.reshape(-1) if self.bias is not None else None
        return layer_norm(xf, w, b, self.eps, self.activation).reshape(x.shape)

    def extra_repr(self) -> str:
        act = f", activation={self.activation!r}" if self.activation else ""
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}{act}"


class FusedRMSNorm(nn.Module):
    """RMSNorm ``x / sqrt(mean(x^2) + eps) * (weight + offset)``; arguments and parameters as
    :class:`torch.nn.RMSNorm` (``eps=None`` means ``torch.finfo(x.dtype).eps``, as there). ``offset`` (default 0:
    torch's RMSNorm) is added to the weight in fp32 on each call (:func:`offset_rms_norm`); with ``offset=1.0`` the
    weight starts at zeros (Gemma's RMSNorm). Raises TypeError/ValueError naming ``offset`` for a non-finite one,
    or ``offset`` without ``elementwise_affine``."""

    def __init__(
        self,
        normalized_shape,
        eps: float | None = 1e-6,
        elementwise_affine: bool = True,
        device=None,
        dtype=None,
        offset: float = 0.0,
    ):
        super().__init__()
        self.normalized_shape = _shape("FusedRMSNorm", normalized_shape)
        self.eps = None if eps is None else _checks.real("FusedRMSNorm", "eps", eps, minimum=0.0)
        self.offset = _checks.real("FusedRMSNorm", "offset", offset)
        if self.offset != 0.0 and not elementwise_affine:
            raise ValueError(f"FusedRMSNorm: offset is {offset}; an offset needs elementwise_affine=True")
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
            self.reset_parameters()
        else:
            self.register_parameter("weight", None)

    def reset_parameters(self) -> None:
        """The weight at ``1 - offset`` (the identity scale)."""
        if self.weight is not None:
            nn.init.constant_(self.weight, 1.0 - self.offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = _flatten_last("FusedRMSNorm", x, self.normalized_shape)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        w = self.weight.reshape(-1) if self.weight is not None else None
        if self.offset != 0.0:
            return offset_rms_norm(xf, w, eps, self.offset).reshape(x.shape)
        return rms_norm(xf, w, eps).reshape(x.shape)

    def extra_repr(self) -> str:
        offset = f", offset={self.offset}" if self.offset else ""
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}{offset}"
