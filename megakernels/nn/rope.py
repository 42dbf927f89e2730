"""``RotaryEmbedding``: rotary position embedding of a layer's q and k on :func:`megakernels.ops.fused_rope`.

No parameters and no table in memory by default: the kernel computes each token's angles from its position. With
``max_positions`` the module keeps the contract's fp32 cos/sin table as a (non-persistent) buffer and the kernel
reads it instead. With position ``scaling`` (``megakernels.ops.RopeScaling``: Llama 3.1's, linear interpolation
or YaRN) the angles always come from such a table, built from the scaled inverse frequencies (and, for YaRN, its
cos and sin multiplied by the attention factor); it covers ``max_positions`` (default 4096) and is rebuilt larger
when a call without explicit positions reaches past it, or when ``cover`` is told of a later position (a model
decoding with a KV cache passes explicit positions and calls it).
"""

from __future__ import annotations

import torch
from torch import nn

from megakernels.ops import _checks
from megakernels.ops.rope import RopeScaling, fused_rope, rope_cos_sin_table


class RotaryEmbedding(nn.Module):
    """Applies RoPE to ``q`` and ``k`` in one fused pass.

    Args:
        head_dim: the per-head size d (even).
        theta: the base (10000 Llama 2, 500000 Llama 3), a finite number > 0.
        interleaved: False for the half-rotated NeoX/Llama layout (HF's rotate_half), True for GPT-J's.
        max_positions: if given, cache the cos/sin table for positions ``[0, max_positions)`` as a buffer.
        scaling: position scaling of the frequencies (``RopeScaling``), or None.

    ``forward(q, k, positions=None, seq_dim=1, position_offset=0)`` with q ``[batch, seq, heads_q, d]`` and k
    ``[batch, seq, heads_k, d]`` (or sequence-first with ``seq_dim=0``); returns ``(q_rot, k_rot)``. Raises as
    :func:`megakernels.ops.fused_rope`, and ValueError for a q whose last dim is not ``head_dim``.
    """

    def __init__(
        self,
        head_dim: int,
        theta: float = 10000.0,
        interleaved: bool = False,
        max_positions: int | None = None,
        device=None,
        scaling: RopeScaling | None = None,
    ):
        super().__init__()
        name = "RotaryEmbedding"
        self.head_dim = _checks.integer(name, "head_dim", head_dim, minimum=2)
        if self.head_dim % 2:
            raise ValueError(f"{name}: head_dim must be even, got {self.head_dim}")
        self.theta = _checks.real(name, "theta", theta)
        if not self.theta > 0:
            raise ValueError(f"{name}: theta must be a finite number > 0, got {self.theta}")
        if not isinstance(interleaved, bool):
            raise TypeError(f"{name}: interleaved must be a bool, got {interleaved!r}")
        self.interleaved = interleaved
        if scaling is not None and not isinstance(scaling, RopeScaling):
            raise TypeError(f"{name}: scaling must be a megakernels.ops.RopeScaling or None, got {scaling!r}")
        self.scaling = scaling
        if max_positions is None and scaling is not None:
            max_positions = 4096
        self.max_positions = (
            None if max_positions is None else _checks.integer(name, "max_positions", max_positions, minimum=1)
        )
        self.register_buffer(
            "cos_sin", None if max_positions is None else self._table(self.max_positions, device), False
        )

    def _table(self, positions: int, device) -> torch.Tensor:
        return rope_cos_sin_table(positions, self.head_dim, self.theta, device, self.scaling)

    def cover(self, last: int) -> None:
        """Make a table reach position ``last`` (rebuilt at twice the need if it does not: generation past it).
        Called with the host's count of positions, never by reading a positions tensor (a device sync)."""
        if self.cos_sin is not None and last >= self.cos_sin.shape[0] and self.cos_sin.device.type != "meta":
            self.max_positions = 2 * (last + 1)
            self.cos_sin = self._table(self.max_positions, self.cos_sin.device)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor | None = None,
        seq_dim: int = 1,
        position_offset: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(q, torch.Tensor) and q.dim() >= 1 and q.shape[-1] != self.head_dim:
            raise ValueError(f"RotaryEmbedding: q has head_dim {q.shape[-1]}, expected {self.head_dim}")
        if self.scaling is not None and positions is None and isinstance(q, torch.Tensor) and q.dim() == 4:
            self.cover(position_offset + q.shape[seq_dim] - 1)
        return fused_rope(
            q,
            k,
            positions,
            theta=self.theta,
            interleaved=self.interleaved,
            position_offset=position_offset,
            cos_sin=self.cos_sin,
            seq_dim=seq_dim,
        )

    def extra_repr(self) -> str:
        cache = f", max_positions={self.max_positions}" if self.max_positions else ""
        scaled = f", scaling={self.scaling}" if self.scaling else ""
        return f"{self.head_dim}, theta={self.theta}, interleaved={self.interleaved}{cache}{scaled}"
