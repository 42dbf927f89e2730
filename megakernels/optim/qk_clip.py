"""MuonClip (Kimi K2's qk-clip): after an optimizer step, every attention head whose largest attention logit of the
step exceeded ``tau`` has its query and key projections scaled down so that the logit would have been ``tau``.

Measurement. ``track(model)`` gives every self-attention block of ``model`` (``megakernels.parallel``'s
``ParallelSelfAttention`` and ``ParallelGroupedQueryAttention``) a running maximum per local head, ``max_logits``
(fp32 ``[heads]``), which each training forward raises to ``max_{i, j} scale * q_i · k_j`` over the pairs the
attention lets through (causality, the sliding window, packed documents, padding). It is a separate pass of its own
(``megakernels.ops.attention_logits.max_logits``: one ``q kᵀ`` in fp32, a chunk of queries at a time, without
gradients) beside the attention core, which never materialises the logits: about the cost of the core's first
product, paid only with clipping on.

Clipping. With ``gamma_h = min(1, tau / max_logit_h)`` per head: a head of multi-head attention scales its query
and key rows (and biases) by ``sqrt(gamma_h)`` (Kimi K2's split); under grouped-query attention a key head serves
several query heads, so the query rows take the whole ``gamma_h`` and the shared keys stay. Both scale the head's
logits by ``gamma_h`` exactly (the rotary embedding is linear). A head normalised by a q/k RMSNorm (Qwen 3) is
scale-invariant and cannot be clipped this way (``check``). The optimizer state is left as it is.

``clip_(model, tau)`` applies it to the parameters themselves (one process); ``ParallelOptimizer`` applies
``row_scales`` to its fp32 masters after taking the maxima over the data- and context-parallel ranks.
"""

from __future__ import annotations

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
