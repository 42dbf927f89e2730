"""``FusedSwiGLU``: the activation of a SwiGLU MLP on :func:`megakernels.ops.swiglu`."""

from __future__ import annotations

import torch
from torch import nn

from megakernels.ops.swiglu import swiglu


class FusedSwiGLU(nn.Module):
    """``silu(gate) * up`` on the packed output ``[..., 2f]`` of one fused gate/up projection (gate first).

    No parameters: pair it with a bias-free linear layer of ``2 * ffn_hidden`` outputs whose weight rows are
    ``[W_gate; W_up]`` (per tensor-parallel rank: ``[W_gate_r; W_up_r]``). ``forward(x)`` returns ``[..., f]``.
    Raises as :func:`megakernels.ops.swiglu`.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x)
