"""Drop-in attention softmax on the fused kernels (Megatron's ``FusedScaleMaskSoftmax``, without its length caps
or its -10000 mask fill).

``FusedScaleMaskSoftmax(scale=None, causal=False)`` computes ``softmax(x * scale)`` over the last dimension of
attention scores, with either a boolean padding/attention mask given at call time or the causal mask:

- ``causal=False``, ``forward(x)``: :func:`megakernels.ops.scaled_softmax` (any shape);
- ``causal=False``, ``forward(x, mask)``: :func:`megakernels.ops.scaled_masked_softmax` (x ``[b, heads, sq, sk]``,
  mask bool broadcastable, True = masked out);
- ``causal=True``, ``forward(x)``: :func:`megakernels.ops.scaled_causal_softmax` (x ``[..., sq, sk]``, diagonal
  bottom-right aligned). Passing a mask as well is a ValueError: the causal kernel's point is to skip the masked
  triangle, and a combined mask is just a boolean mask (build ``mask | causal_mask(sq, sk)`` and use
  ``causal=False``).

Fully masked rows give zeros, never NaN. Output in x's dtype; all math in fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from megakernels.ops import _checks
from megakernels.ops.softmax import scaled_causal_softmax, scaled_masked_softmax, scaled_softmax


class FusedScaleMaskSoftmax(nn.Module):
    """``softmax(x * scale)`` with an optional boolean mask or the causal mask, fused (no parameters).

    Args:
        scale: multiplier applied to x before the softmax, e.g. ``1/sqrt(head_dim)``; None means 1.0.
        causal: apply the (bottom-right aligned) causal mask.

    Raises:
        TypeError / ValueError at construction for a scale that is not a finite real number; at call time as the
        ops do, and ValueError for a mask together with ``causal=True``.
    """

    def __init__(self, scale: float | None = None, causal: bool = False):
        super().__init__()
        self.scale = 1.0 if scale is None else _checks.real("FusedScaleMaskSoftmax", "scale", scale)
        self.causal = bool(causal)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.causal:
            if mask is not None:
                raise ValueError(
                    "FusedScaleMaskSoftmax: got a mask with causal=True; pass the combined boolean mask "
                    "(mask | causal_mask(sq, sk)) to a causal=False module instead"
                )
            return scaled_causal_softmax(x, self.scale)
        if mask is None:
            return scaled_softmax(x, self.scale)
        return scaled_masked_softmax(x, mask, self.scale)

    def extra_repr(self) -> str:
        return f"scale={self.scale}, causal={self.causal}"
