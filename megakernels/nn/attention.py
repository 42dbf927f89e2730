"""``FlashSelfAttention``: the attention core of a Transformer layer on :func:`megakernels.ops.flash_attention`
(flash-attn's module of the same name). No parameters: it takes projected q, k, v and returns the per-head
context; the projections and the output GEMM belong to the layer (megakernels.parallel's attention block)."""

from __future__ import annotations

import torch
from torch import nn

from megakernels.ops import _checks
from megakernels.ops.attention import flash_attention


class FlashSelfAttention(nn.Module):
    """Exact softmax attention with O(seqlen) memory.

    Args:
        causal: bottom-right aligned causal mask by default (overridable per call).
        softmax_scale: defaults to ``1 / sqrt(head_dim)``.
        attention_dropout: dropout on the attention probabilities, applied in training mode only.

    ``forward(qkv)`` with qkv ``[batch, seqlen, 3, heads, head_dim]`` (packed), or ``forward(q, k, v)`` with
    ``[batch, sq, heads, head_dim]`` and k/v ``[batch, sk, heads_kv, head_dim]`` (GQA/MQA). Returns
    ``[batch, sq, heads, head_dim]``. Raises ValueError as :func:`megakernels.ops.flash_attention`, and for a
    packed input that is not ``[b, s, 3, h, d]``.
    """

    def __init__(self, causal: bool = False, softmax_scale: float | None = None, attention_dropout: float = 0.0):
        super().__init__()
        if not 0.0 <= _checks.real("FlashSelfAttention", "attention_dropout", attention_dropout) < 1.0:
            raise ValueError(f"FlashSelfAttention: attention_dropout must be in [0, 1), got {attention_dropout}")
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.dropout_p = attention_dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                causal: bool | None = None) -> torch.Tensor:
        if k is None and v is None:
            if q.dim() != 5 or q.shape[2] != 3:
                raise ValueError(f"FlashSelfAttention: packed qkv must be [batch, seqlen, 3, heads, head_dim], got "
                                 f"shape {tuple(q.shape)}")
            q, k, v = q.unbind(2)
        elif k is None or v is None:
            raise ValueError("FlashSelfAttention: pass either packed qkv, or all of q, k and v")
        return flash_attention(q, k, v, causal=self.causal if causal is None else causal,
                               softmax_scale=self.softmax_scale, dropout_p=self.dropout_p if self.training else 0.0)

    def extra_repr(self) -> str:
        return f"causal={self.causal}, softmax_scale={self.softmax_scale}, attention_dropout={self.dropout_p}"
