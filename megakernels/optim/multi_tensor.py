"""Multi-tensor helpers for whole models: the gradient norm for clipping, and grouping by (device, dtype).

The kernels (megakernels.ops.multi_tensor) take one device and one dtype per call; these functions accept any
mix and make one fused call per (device, dtype) group.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megakernels.ops import multi_tensor as _mt

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def group_by_device_dtype(tensors: Iterable[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """Indices of ``tensors`` grouped by (device, dtype), groups in order of first appearance."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return groups


def _check_list(op: str, tensors) -> list[torch.Tensor]:
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise ValueError(f"{op}: tensors[{i}] is {t.layout}; sparse tensors are not supported")
        if t.is_complex():
            raise TypeError(f"{op}: tensors[{i}] is complex ({t.dtype}); not supported")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{op}: tensors[{i}] has dtype {t.dtype}; expected float32, float16 or bfloat16")
    # Devices may mix (one fused call per device), but meta tensors hold no values to combine with real ones.
    metas = [t.device.type == "meta" for t in tensors]
    if any(metas) and not all(metas):
        i = metas.index(not metas[0])
        raise ValueError(
            f"{op}: tensors[{i}] is on {tensors[i].device} but tensors[0] is on {tensors[0].device}; "
            "meta tensors cannot be mixed with tensors that hold values"
        )
    return tensors


def multi_tensor_l2norm(tensors: Iterable[torch.Tensor], *, chunk_size: int = 0) -> torch.Tensor:
    """The 2-norm of all elements of ``tensors`` taken together: ``||cat([t.flatten() for t in tensors])||_2``.

    One fused pass per (device, dtype) group with fp32 accumulation; deterministic (fixed chunking and fixed-order
    sums, independent of thread count and run). No host synchronisation on CUDA.

    Args:
        tensors: float32/float16/bfloat16 tensors of any shapes and strides (non-contiguous ones are copied).
    Returns:
        A float32 scalar tensor on the first tensor's device (0.0 for an empty list or only empty tensors).
    Raises:
        TypeError: a non-tensor, a complex or other non-float dtype. ValueError: a sparse tensor.
    """
    op = "multi_tensor_l2norm"
    tensors = _check_list(op, tensors)
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    groups = group_by_device_dtype(tensors)
    out_device = tensors[0].device
    norms = [_mt.l2norm([tensors[i] for i in idx], chunk_size).to(out_device) for idx in groups.values()]
    if len(norms) == 1:
        return norms[0]
    return torch.linalg.vector_norm(torch.stack(norms))


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """Scales the grads of ``parameters`` in place so that their total 2-norm is at most ``max_norm``; returns the
    norm before clipping (float32 scalar). Like torch.nn.utils.clip_grad_norm_ (norm_type 2) with the norm from
    :func:`multi_tensor_l2norm`; the scaling is a device-side multiply, no host synchronisation."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    total = multi_tensor_l2norm(grads)
    coef = torch.clamp(float(max_norm) / (total + eps), max=1.0)
    for (device, _dtype), idx in group_by_device_dtype(grads).items():
        torch._foreach_mul_([grads[i] for i in idx], coef.to(device))
    return total
