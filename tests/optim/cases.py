"""Shared pieces of the optimizer tests: parameter sets, deterministic gradients and a lock-step runner that
feeds the same gradients to FusedAdamW and to torch.optim.AdamW."""

from __future__ import annotations

import torch

# Shapes: scalars, an empty tensor, odd sizes (scalar tails after 4-wide packs), and a tensor crossing several
# 1000-element chunks.
SHAPES = [(), (1,), (3, 5), (0, 4), (7, 9), (130,), (2, 1031)]
SMALL_CHUNK = 1000  # a non-default chunk size so that small tests cross chunk boundaries (default is 65536)


def make_params(shapes, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype).requires_grad_(True) for s in shapes]


def clone_params(params, dtype=None):
    return [p.detach().clone().to(dtype or p.dtype).requires_grad_(True) for p in params]


def grads_for(params, step, scale=1.0):
    """Gradients for `step`, independent of the optimizer (seeded by the step), in each param's dtype."""
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(p.shape, generator=g) * scale).to(device=p.device, dtype=p.dtype) for p in params]


def set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()


def max_rel_error(actual, expected):
    """max |a - e| / max(1e-30, max |e|) over one tensor, in fp64."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert a.shape == e.shape
    if e.numel() == 0:
        return 0.0
    return ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()
