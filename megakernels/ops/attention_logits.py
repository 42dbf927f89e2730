"""The largest attention logit per head, computed beside an attention core that never holds the logits (what
MuonClip's qk-clip measures: ``megakernels.optim.qk_clip``)."""

from __future__ import annotations

import math

import torch


def max_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float | None = None,
    causal: bool = False,
    window: int | None = None,
    mask: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
    chunk: int = 256,
) -> torch.Tensor:
    """The largest attention logit per head: ``max scale * q_i · k_j`` over the batch and the (query, key) pairs the
    attention lets through (-inf for a head whose queries see no key).

    Args:
        q: ``[b, sq, heads, d]``; k: ``[b, sk, kv_heads, d]`` (kv_heads dividing heads: each serves a group).
        scale: the softmax scale (default ``1 / sqrt(d)``). causal, window: as ``ops.flash_attention``'s
            (bottom-right aligned). mask: bool, True = masked out, broadcastable to ``[b, heads, sq, sk]``.
            documents: int ``[b, s]`` document ids (a query sees keys of its own document only).
        chunk: queries per product (bounds the ``[b, heads, chunk, sk]`` fp32 buffer).

    Returns:
        fp32 ``[heads]``.
    """
    from megakernels.ops.attention import window_mask

    b, sq, heads, d = q.shape
    sk, kv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    kf = k.detach().float().repeat_interleave(heads // kv, dim=2) if kv != heads else k.detach().float()
    hidden = window_mask(sq, sk, causal, window, device=q.device)
    best = torch.full((heads,), float("-inf"), dtype=torch.float32, device=q.device)
    for i0 in range(0, sq, chunk):
        i1 = min(sq, i0 + chunk)
        s = torch.einsum("bqhd,bkhd->bhqk", q[:, i0:i1].detach().float(), kf) * scale
        off = torch.zeros((), dtype=torch.bool, device=q.device)
        if hidden is not None:
            off = off | hidden[i0:i1]
        if mask is not None:
            m = mask.expand(b, heads, sq, sk) if mask.dim() == 4 else mask
            off = off | m[..., i0:i1, :]
        if documents is not None:
            ids = documents.to(q.device)
            off = off | (ids[:, None, i0:i1, None] != ids[:, None, None, :])
        s = s.masked_fill(off, float("-inf"))
        best = torch.maximum(best, s.amax(dim=(0, 2, 3)))
    return best
