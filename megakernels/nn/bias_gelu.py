"""``FusedBiasGeLU``: the bias add and GeLU that follow a linear layer, fused (Megatron's bias_gelu)."""

from __future__ import annotations

import torch
from torch import nn

from megakernels.ops import _checks
from megakernels.ops.bias_gelu import APPROXIMATIONS, bias_gelu


class FusedBiasGeLU(nn.Module):
    """``gelu(x + bias)`` with its own ``bias`` parameter ``[hidden_size]`` (zeros at init).

    Pair it with a bias-free linear layer (``nn.Linear(..., bias=False)``): the linear's bias add moves into this
    fused kernel. ``forward(x, bias=None)`` uses an explicitly passed bias instead of the parameter, for layers
    that keep their bias elsewhere (Megatron's ``skip_bias_add``).
    """

    def __init__(self, hidden_size: int, approximate: str = "tanh", device=None, dtype=None):
        super().__init__()
        if approximate not in APPROXIMATIONS:
            raise ValueError(f"FusedBiasGeLU: approximate must be 'tanh' or 'none', got {approximate!r}")
        self.hidden_size = _checks.integer("FusedBiasGeLU", "hidden_size", hidden_size, minimum=1)
        self.approximate = approximate
        self.bias = nn.Parameter(torch.zeros(self.hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return bias_gelu(x, self.bias if bias is None else bias, self.approximate)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, approximate={self.approximate!r}"
