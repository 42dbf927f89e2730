"""The attention sinks' gradient where no kernel sums it (the blocked CPU path of megakernels/ops/_attention_cpu.py and
ring attention, megakernels/parallel/context.py), and the backward ops' empty one without sinks. The softmax rule is
megakernels/ops/attention.py's."""

from __future__ import annotations

import torch


def no_sinks_grad(q: torch.Tensor) -> torch.Tensor:
    """The backward ops' ``dsinks`` where there are no sinks: an empty fp32 tensor on q's device."""
    return q.new_empty((0,), dtype=torch.float32)


def sinks_grad(grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``dsinks[h] = -sum_{b, i} exp(sinks[h] - lse[b, h, i]) * (grad_out . out)[b, i, h]``: the sinks' gradient
    from the forward's ``out`` ``[b, sq, h, d]`` and its lse ``[b, h, sq]`` (which includes the sinks), summed in fp32
    (fp64 for fp64 sinks); a row whose lse is ``-inf`` adds nothing. Returns ``[h]`` in the sinks' dtype."""
    ct = torch.float64 if sinks.dtype == torch.float64 else torch.float32
    delta = (grad_out.to(ct) * out.to(ct)).sum(-1).transpose(1, 2)  # [b, h, sq]
    lse = lse.to(ct)
    p_sink = torch.where(torch.isneginf(lse), 0.0, torch.exp(sinks.to(ct)[:, None] - lse))
    return (-(p_sink * delta).sum((0, 2))).to(sinks.dtype)
