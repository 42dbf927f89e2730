"""Attention cores: the part of a Transformer layer between the projections, ``softmax(q kᵀ · scale + mask) v``.

No parameters: a core takes projected ``q``, ``k``, ``v`` ``[batch, seqlen, heads, head_dim]`` (k/v may have fewer
heads: GQA/MQA) and returns the per-head context; the projections and the output GEMM belong to the layer
(``megakernels.parallel.ParallelSelfAttention``). Two interchangeable cores, chosen by name with
``attention_core``:

- ``"flash"`` — ``FlashSelfAttention`` (flash-attn's module of the same name) on
  :func:`megakernels.ops.flash_attention`: exact attention with O(seqlen) memory, causal or not. An arbitrary
  boolean mask (BERT's padding) is something FlashAttention's tiles cannot take, so with ``mask=`` the scores are
  formed explicitly and go through the fused masked softmax (:class:`FusedScaleMaskSoftmax`) instead.
- ``"torch"`` — ``TorchSelfAttention`` on PyTorch's ``scaled_dot_product_attention`` (the baseline).

Both take packed sequences (``documents=``: per-token document ids, non-decreasing along the sequence; a token
attends only within its own document, on top of causality and the window): the flash core passes them to
:func:`megakernels.ops.flash_attention`, which skips the key blocks of other documents; the torch core adds the
document boundaries to SDPA's boolean mask. ``DocumentMask`` carries the ids through a model's ``attention_mask``.

Both take a sliding ``window`` (Mistral; :func:`megakernels.ops.flash_attention`'s: causal query i sees key j iff
``i - window < j <= i``, bottom-right aligned; without causality ``|i - j| < window``): the flash core skips the key
blocks outside it, the torch core passes SDPA the band as a boolean mask.

Both take attention sinks (``sinks=``, gpt-oss: fp32 ``[heads]``, one logit per query head joining every row's
softmax denominator with a zero value; :func:`megakernels.ops.flash_attention`'s): the flash core passes them to the
kernels, the torch core to SDPA as a key of zero whose float mask entry is the sink. The cores hold no parameters:
the layer that learns the sinks passes them (``megakernels.parallel.ParallelGroupedQueryAttention(sinks=True)``).

Attention dropout is applied in training mode only; a model-parallel layer runs the core under its RNG tracker so
the masks differ per tensor-parallel rank.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from megakernels.nn.softmax import FusedScaleMaskSoftmax
from megakernels.ops import _checks
from megakernels.ops.attention import check_documents, check_sinks, check_window, flash_attention, window_mask


@dataclasses.dataclass(frozen=True)
class DocumentMask:
    """Packed sequences as a model's attention mask: ``ids`` int ``[b, s]``, each token's document, non-decreasing
    along the sequence; a token attends only within its document. The ids are the whole sequence's, also under
    context parallelism (ring attention takes each chunk's)."""

    ids: torch.Tensor


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[b, s, kv_heads, d]`` -> ``[b, s, heads, d]``: each K/V head serves ``heads // kv_heads`` query heads."""
    kv = t.shape[2]
    return t if kv == heads else t.repeat_interleave(heads // kv, dim=2)


class _Core(nn.Module):
    def __init__(
        self,
        causal: bool = False,
        softmax_scale: float | None = None,
        attention_dropout: float = 0.0,
        window: int | None = None,
    ):
        super().__init__()
        if not 0.0 <= _checks.real(type(self).__name__, "attention_dropout", attention_dropout) < 1.0:
            raise ValueError(f"{type(self).__name__}: attention_dropout must be in [0, 1), got {attention_dropout}")
        self.causal = bool(causal)
        self.softmax_scale = softmax_scale
        self.dropout_p = float(attention_dropout)
        self.window = check_window(type(self).__name__, window) or None

    def _args(self, q, k, v, causal, mask):
        if k is None and v is None:
            if q.dim() != 5 or q.shape[2] != 3:
                raise ValueError(
                    f"{type(self).__name__}: packed qkv must be [batch, seqlen, 3, heads, head_dim], "
                    f"got shape {tuple(q.shape)}"
                )
            q, k, v = q.unbind(2)
        elif k is None or v is None:
            raise ValueError(f"{type(self).__name__}: pass either packed qkv, or all of q, k and v")
        causal = self.causal if causal is None else bool(causal)
        if causal and mask is not None:
            raise ValueError(
                f"{type(self).__name__}: pass either causal=True or a mask, not both (a combined mask "
                "is a boolean mask: mask | causal_mask)"
            )
        return q, k, v, causal, self.dropout_p if self.training else 0.0

    def _with_window(self, mask, sq, sk, causal, device):
        """``mask`` (True = masked out) with the keys outside the window (and, causally, ahead of the query) added;
        None where nothing is masked."""
        band = window_mask(sq, sk, causal, self.window, device=device)
        return band if mask is None else mask | band if band is not None else mask

    def extra_repr(self) -> str:
        window = f", window={self.window}" if self.window else ""
        return f"causal={self.causal}, softmax_scale={self.softmax_scale}, attention_dropout={self.dropout_p}{window}"


class FlashSelfAttention(_Core):
    """Exact softmax attention with O(seqlen) memory (:func:`megakernels.ops.flash_attention`).

    Args:
        causal: bottom-right aligned causal mask by default (overridable per call).
        softmax_scale: defaults to ``1 / sqrt(head_dim)``.
        attention_dropout: dropout on the attention probabilities, applied in training mode only.
        window: sliding-window attention (``flash_attention``'s ``window``); None: every key.

    ``forward(qkv)`` with qkv ``[batch, seqlen, 3, heads, head_dim]`` (packed), or ``forward(q, k, v)`` with
    ``[batch, sq, heads, head_dim]`` and k/v ``[batch, sk, heads_kv, head_dim]`` (GQA/MQA); optional ``causal=``
    and ``mask=`` (bool, broadcastable to ``[batch, heads, sq, sk]``, True = masked out; goes through the fused
    masked softmax, see the module docstring), or ``documents=`` (packed sequences: ``flash_attention``'s), and
    ``sinks=`` (fp32 ``[heads]`` attention sinks, ``flash_attention``'s; not with a mask). Returns ``[batch, sq,
    heads, head_dim]``.

    Raises:
        ValueError: as :func:`megakernels.ops.flash_attention`; a packed input that is not ``[b, s, 3, h, d]``;
            only some of q, k, v; a mask together with causal or with sinks.
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        causal: bool | None = None,
        mask: torch.Tensor | None = None,
        documents=None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q, k, v, causal, p = self._args(q, k, v, causal, mask)
        if mask is None:
            return flash_attention(
                q,
                k,
                v,
                causal=causal,
                softmax_scale=self.softmax_scale,
                dropout_p=p,
                window=self.window,
                documents=documents,
                sinks=sinks,
            )
        if documents is not None:
            raise ValueError(f"{type(self).__name__}: pass either a mask or documents, not both")
        if sinks is not None:
            raise ValueError(f"{type(self).__name__}: sinks go through the FlashAttention kernels, not with a mask")
        if self.window:
            mask = self._with_window(mask, q.shape[1], k.shape[1], False, q.device)
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        heads = q.shape[2]
        qh, kh, vh = (t.transpose(1, 2) for t in (q, _expand_kv(k, heads), _expand_kv(v, heads)))
        probs = FusedScaleMaskSoftmax(scale)(qh @ kh.transpose(-1, -2), mask)
        if p > 0.0:
            probs = F.dropout(probs, p)
        return (probs @ vh).transpose(1, 2)


class TorchSelfAttention(_Core):
    """The same contract as :class:`FlashSelfAttention` on ``torch.nn.functional.scaled_dot_product_attention``
    (the baseline the fused core is measured against), causal bottom-right aligned as FlashAttention's. Sinks
    (``sinks=``, with or without a mask) are one more key and value of zero whose float mask entry is the sink: its
    score is ``sinks[h]``, its value adds nothing."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        causal: bool | None = None,
        mask: torch.Tensor | None = None,
        documents=None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q, k, v, causal, p = self._args(q, k, v, causal, mask)
        sinks = check_sinks(type(self).__name__, sinks, q)
        heads = q.shape[2]
        k, v = _expand_kv(k, heads), _expand_kv(v, heads)
        sq, sk = q.shape[1], k.shape[1]
        if self.window and self.window < max(sq, sk):  # the band as a boolean mask (SDPA has no window)
            mask = self._with_window(mask, sq, sk, causal, q.device)
            causal = False
        elif causal and (sq != sk or documents is not None):  # PyTorch aligns is_causal top-left, ours bottom-right
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(sk - sq + 1)  # and no is_causal + mask
            causal = False
        if documents is not None:  # keys of other documents, [b, 1, sq, sk]
            q_ids, k_ids = check_documents(type(self).__name__, documents, q, k)  # flash_attention's rules
            other = q_ids[:, None, :, None] != k_ids[:, None, None, :]
            mask = other if mask is None else mask | other
        if sinks is not None:
            q, k, v, mask = _with_sink_key(q, k, v, mask, causal, sinks)
            causal = False
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=None if mask is None else mask if mask.is_floating_point() else ~mask,
            dropout_p=p,
            is_causal=causal,
            scale=self.softmax_scale,
        )
        return out.transpose(1, 2)


def _with_sink_key(q, k, v, mask, causal, sinks):
    """SDPA's inputs with the sinks as one more key: k and v get a zero row (so its score is 0 and its value adds
    nothing), and the mask (bool, True = hidden, broadcastable to ``[b, h, sq, sk]``) becomes a float bias
    ``[b or 1, h, sq, sk + 1]``: 0 where seen, -inf where not, and ``sinks[h]`` in the sink's column."""
    sq, h = q.shape[1], q.shape[2]
    sk = k.shape[1]
    if mask is None and causal:  # bottom-right aligned, as FlashAttention's
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(sk - sq + 1)
    zeros = k.new_zeros(k.shape[0], 1, *k.shape[2:])
    k, v = torch.cat((k, zeros), 1), torch.cat((v, zeros), 1)
    hidden = torch.zeros(1, 1, sq, sk, dtype=torch.bool, device=q.device) if mask is None else mask
    hidden = hidden.reshape((1,) * (4 - hidden.dim()) + tuple(hidden.shape))
    hidden = hidden.expand(hidden.shape[0], h, sq, sk)
    bias = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill(hidden, float("-inf"))
    sink = sinks.to(q.dtype)[None, :, None, None].expand(bias.shape[0], h, sq, 1)
    return q, k, v, torch.cat((bias, sink), -1)


ATTENTION_CORES = {"flash": FlashSelfAttention, "torch": TorchSelfAttention}


def attention_core(
    name: str,
    causal: bool = False,
    softmax_scale: float | None = None,
    attention_dropout: float = 0.0,
    window: int | None = None,
) -> nn.Module:
    """The attention core called ``name`` (``"flash"`` or ``"torch"``), with a sliding ``window`` if given.

    Raises:
        ValueError: an unknown name, attention_dropout outside [0, 1), or a window that is not a positive int.
    """
    if name not in ATTENTION_CORES:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_CORES)}, got {name!r}")
    return ATTENTION_CORES[name](causal, softmax_scale, attention_dropout, window)
