"""MuonClip (Kimi K2's qk-clip): after an optimizer step, every attention head whose largest attention logit of the
step exceeded ``tau`` has its query and key projections scaled down so that the logit would have been ``tau``.

Measurement. ``track(model)`` gives every self-attention block of ``model`` (``megakernels.parallel``'s
``ParallelSelfAttention`` and ``ParallelGroupedQueryAttention``) a running maximum per local head, ``max_logits``
(fp32 ``[heads]``), which each training forward raises to ``max_{i, j} scale * q_i · k_j`` over the pairs the
attention lets through (causality, the sliding window, packed documents, padding). It is a separate pass of its own
(``max_logits``: one ``q kᵀ`` in fp32, a chunk of queries at a time, without gradients) beside the attention core,
which never materialises the logits: about the cost of the core's first product, paid only with clipping on.

Clipping. With ``gamma_h = min(1, tau / max_logit_h)`` per head: a head of multi-head attention scales its query
and key rows (and biases) by ``sqrt(gamma_h)`` (Kimi K2's split); under grouped-query attention a key head serves
several query heads, so the query rows take the whole ``gamma_h`` and the shared keys stay. Both scale the head's
logits by ``gamma_h`` exactly (the rotary embedding is linear). A head normalised by a q/k RMSNorm (Qwen 3) is
scale-invariant and cannot be clipped this way (``check``). The optimizer state is left as it is.

``clip_(model, tau)`` applies it to the parameters themselves (one process); ``ParallelOptimizer`` applies
``row_scales`` to its fp32 masters after taking the maxima over the data- and context-parallel ranks.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def _attention_types() -> tuple[type, ...]:
    from megakernels.parallel.blocks import ParallelGroupedQueryAttention, ParallelSelfAttention

    return (ParallelSelfAttention, ParallelGroupedQueryAttention)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention blocks of ``model`` that clipping covers, in module order."""
    return [m for m in model.modules() if isinstance(m, _attention_types())]


def check(model: nn.Module) -> None:
    """Raises ValueError when ``model`` has an attention block clipping cannot act on (per-head q/k RMSNorm)."""
    for m in attention_modules(model):
        if getattr(m, "q_norm", None) is not None:
            raise ValueError(
                "qk-clip: an attention block normalises its queries and keys per head (qk_norm): the logits do not "
                "depend on the projections' scale, so they cannot be clipped by it"
            )


def track(model: nn.Module) -> list[nn.Module]:
    """Start measuring: each attention block of ``model`` gets ``max_logits`` (zeros, its local heads); returns
    the blocks."""
    mods = attention_modules(model)
    for m in mods:
        m.max_logits = torch.zeros(m.local_heads, dtype=torch.float32, device=m.proj.weight.device)
    return mods


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


def observe(module: nn.Module, q, k, mask) -> None:
    """Raise ``module.max_logits`` by this forward's logits (called by the attention blocks; ``mask``: None, a
    boolean mask or a ``DocumentMask``)."""
    from megakernels.nn.attention import DocumentMask

    core = module.core
    documents = mask.ids if isinstance(mask, DocumentMask) else None
    with torch.no_grad():
        got = max_logits(
            q,
            k,
            getattr(core, "softmax_scale", None),
            getattr(core, "causal", module.causal),
            getattr(module, "window", None),
            None if documents is not None else mask,
            documents,
        )
        module.max_logits = torch.maximum(module.max_logits, got)


def gammas(max_logit: torch.Tensor, tau: float) -> torch.Tensor:
    """``min(1, tau / max_logit)`` per head (1 where the maximum is not above ``tau``)."""
    return torch.where(max_logit > tau, tau / max_logit.clamp(min=1e-30), torch.ones_like(max_logit))


def row_scales(module: nn.Module, gamma: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(param, scale of each of its rows)]`` for the query and key projections (weights and biases) of
    ``module``'s local heads, ``gamma`` fp32 ``[heads]`` (module docstring)."""
    from megakernels.parallel.blocks import ParallelSelfAttention

    d = module.head_dim
    root = gamma.sqrt()
    out = []
    if isinstance(module, ParallelSelfAttention):  # rows (head, {q, k, v}, d)
        ones = torch.ones_like(root)
        per = torch.stack([root, root, ones], dim=1)[:, :, None].expand(-1, -1, d).reshape(-1)
        out += [(p, per) for p in (module.qkv.weight, module.qkv.bias) if p is not None]
        return out
    mha = module.num_heads == module.num_kv_heads
    q_scale = (root if mha else gamma)[:, None].expand(-1, d).reshape(-1)
    out += [(p, q_scale) for p in (module.q.weight, module.q.bias) if p is not None]
    if mha:  # rows (part {k, v}, head, d)
        kv = torch.cat([root[:, None].expand(-1, d).reshape(-1), torch.ones(root.numel() * d, device=root.device)])
        out += [(p, kv) for p in (module.kv.weight, module.kv.bias) if p is not None]
    return out


def scale_rows_(flat: torch.Tensor, scale: torch.Tensor, lo: int, row_size: int) -> None:
    """Multiply each element of ``flat`` — the 1-D range from element ``lo`` of a parameter whose rows have
    ``row_size`` elements (a piece of it) — by its row's ``scale``, in place."""
    rows = torch.arange(lo, lo + flat.numel(), device=flat.device) // row_size
    flat.mul_(scale.to(device=flat.device, dtype=flat.dtype)[rows])


def clip_(model: nn.Module, tau: float) -> float:
    """Clip every tracked attention block of ``model`` (one process) and reset the maxima; returns the largest
    logit seen (-inf for none)."""
    best = float("-inf")
    for m in attention_modules(model):
        logits = getattr(m, "max_logits", None)
        if logits is None:
            continue
        best = max(best, float(logits.max()))
        with torch.no_grad():
            for p, s in row_scales(m, gammas(logits, tau)):
                p.mul_(s.to(p.dtype).view(-1, *([1] * (p.dim() - 1))))
        m.max_logits = torch.zeros_like(logits)
    return best
