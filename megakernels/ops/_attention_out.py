"""The attention output's allocation, shared by the op (megakernels/ops/attention.py), its CPU paths and the Triton
launcher; a leaf module, so none of them imports another for it."""

from __future__ import annotations

import torch


def empty_out(q: torch.Tensor, dv: int) -> torch.Tensor:
    """An uninitialised output ``[b, sq, h, dv]`` in q's memory order (as ``empty_like(q)``, which it is when ``dv``
    is q's head dim; a token-major q gives a token-major output), dv contiguous."""
    if dv == q.shape[-1]:
        return torch.empty_like(q)
    order = torch.empty_like(q[..., :1]).stride()  # q's order of the batch, token and head dims, made dense
    strides = tuple(st * dv for st in order[:3]) + (1,)
    return torch.empty_strided(q.shape[:3] + (dv,), strides, dtype=q.dtype, device=q.device)
