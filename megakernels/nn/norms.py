"""Drop-in normalisation modules on the fused kernels.

``FusedLayerNorm`` takes torch.nn.LayerNorm's constructor arguments and has its state_dict keys (``weight``,
``bias``), so a LayerNorm checkpoint loads into it unchanged (and back); ``activation=`` adds the fused GeLU.
``FusedRMSNorm`` mirrors torch.nn.RMSNorm. Multi-dimensional ``normalized_shape`` is supported by flattening the
normalised dims (the math is the same: statistics over all of them).
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
    """RMSNorm ``x / sqrt(mean(x^2) + eps) * weight``; arguments and parameters as :class:`torch.nn.RMSNorm`
    (``eps=None`` means ``torch.finfo(x.dtype).eps``, as there)."""

    def __init__(
        self, normalized_shape, eps: float | None = 1e-6, elementwise_affine: bool = True, device=None, dtype=None
    ):
        super().__init__()
        self.normalized_shape = _shape("FusedRMSNorm", normalized_shape)
        self.eps = None if eps is None else _checks.real("FusedRMSNorm", "eps", eps, minimum=0.0)
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = _flatten_last("FusedRMSNorm", x, self.normalized_shape)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        w = self.weight.reshape(-1) if self.weight is not None else None
        return rms_norm(xf, w, eps).reshape(x.shape)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
