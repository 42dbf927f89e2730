"""Grouped GEMM: one matrix product per group of consecutive rows, each group with its own weight — the experts of
a mixture-of-experts layer, whose tokens were permuted so each expert's rows are contiguous.

    out[rows of group e] = x[rows of group e] @ weight[e]ᵀ          x [T, k], weight [E, n, k], out [T, n]

``group_sizes`` ``[E]`` (int64, summing to T) says how many rows each group has; empty groups are fine. Backward:
``dx[rows of e] = dout[rows of e] @ weight[e]`` and ``dweight[e] = dout[rows of e]ᵀ @ x[rows of e]`` (zero for an
empty group). The weight is ``[E, n, k]`` like E stacked ``nn.Linear`` weights.

Dispatch (docs/design.md §2): CUDA tensors run the Triton kernels (megakernels/triton/grouped_gemm.py: one launch
per product over every group; the tile schedule is computed on the device from ``group_sizes``, so nothing waits
for the host). CPU tensors multiply each group's rows with ATen's GEMM (the sizes are read on the host, which
costs nothing there); under ``megakernels.backend("cuda_emu")`` CPU tensors run the Triton kernels through
Triton's interpreter (``TRITON_INTERPRET=1`` before import). fp64 has no Triton path: on CUDA it takes the ATen
loop (one host synchronisation per call), under ``cuda_emu`` it is refused. All math in the input dtype with fp32
accumulation, as ATen's GEMMs.

The values of ``group_sizes`` (non-negative, summing to T) are checked on the host when they are on the CPU or x
is; for CUDA sizes with CUDA x the check is queued on the device (``torch._assert_async``: a violation fails the
next synchronisation with a device-side assert instead of synchronising every call), and the kernels never touch
rows past T either way.
"""

from __future__ import annotations

import torch

from megakernels._backend import emulate_for, runs_triton
from megakernels.ops import _checks

OP = "grouped_gemm"
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check(x, weight, group_sizes) -> None:
    for name, t in (("x", x), ("weight", weight), ("group_sizes", group_sizes)):
        _checks.tensor(OP, name, t)
    if x.dim() != 2:
        raise ValueError(f"{OP}: x must be 2-D [tokens, k], got shape {tuple(x.shape)}")
    if weight.dim() != 3:
        raise ValueError(f"{OP}: weight must be 3-D [groups, n, k], got shape {tuple(weight.shape)}")
    if weight.shape[2] != x.shape[1]:
        raise ValueError(f"{OP}: weight has k={weight.shape[2]}, expected x's {x.shape[1]}")
    if group_sizes.dim() != 1 or group_sizes.shape[0] != weight.shape[0]:
        raise ValueError(
            f"{OP}: group_sizes must be 1-D with one entry per group ({weight.shape[0]}), got shape "
            f"{tuple(group_sizes.shape)}"
        )
    if group_sizes.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{OP}: group_sizes must be int32 or int64, got {group_sizes.dtype}")
    if weight.dtype != x.dtype:
        raise ValueError(f"{OP}: weight has dtype {weight.dtype}, expected x's {x.dtype}")
    _checks.same_device(OP, "x", x, ("weight", weight))
    if group_sizes.device.type == "meta" and x.device.type != "meta":  # a meta call computes nothing: no values
        raise ValueError(
            f"{OP}: group_sizes is on meta but x is on {x.device}; meta group sizes hold no values "
            "(any other device is fine)"
        )
    if x.device.type == "cuda" and group_sizes.device.type == "cuda":
        torch._assert_async(
            (group_sizes >= 0).all() & (group_sizes.sum() == x.shape[0]),
            f"{OP}: group_sizes must be >= 0 and sum to x's {x.shape[0]} rows",
        )
    # Sizes read on the host are checked inside the op (check_host_sizes), which runs eagerly even when compiled.


def check_host_sizes(x: torch.Tensor, group_sizes: torch.Tensor, op: str = OP, arg: str = "x") -> None:
    """Sizes that are not on x's GPU: their values on the host (the op reads them there anyway). ``op`` and
    ``arg`` name the op and its rows' argument in the message (``ops.fp8``'s grouped GEMM shares the rule)."""
    if x.device.type == "cuda" and group_sizes.device.type == "cuda":
        return
    sizes = group_sizes.cpu()
    if (sizes < 0).any() or int(sizes.sum()) != x.shape[0]:
        raise ValueError(f"{op}: group_sizes must be >= 0 and sum to {arg}'s {x.shape[0]} rows, got {sizes.tolist()}")


def segments(group_sizes: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(group, start, end)`` of every non-empty group (reads the sizes on the host)."""
    sizes = group_sizes.cpu().tolist()
    out, start = [], 0
    for e, n in enumerate(sizes):
        if n:
            out.append((e, start, start + n))
        start += n
    return out


def _triton_kernels():
    try:
        from megakernels.triton import grouped_gemm as kernels
    except ImportError as e:  # pragma: no cover - a torch without Triton
        raise RuntimeError(f"{OP}: CUDA tensors need Triton, which failed to import ({e})") from e
    return kernels


def _use_triton(x: torch.Tensor, emulate: bool) -> bool:
    return x.dtype in _TRITON_DTYPES and runs_triton(OP, x, emulate)


@torch.library.custom_op("megakernels::grouped_gemm", mutates_args=())
def _grouped_gemm(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor, emulate: bool) -> torch.Tensor:
    check_host_sizes(x, group_sizes)
    if _use_triton(x, emulate):
        return _triton_kernels().forward(x, weight, group_sizes)
    out = x.new_empty((x.shape[0], weight.shape[1]))
    for e, a, b in segments(group_sizes):
        torch.mm(x[a:b], weight[e].t(), out=out[a:b])
    return out


@_grouped_gemm.register_fake
def _(x, weight, group_sizes, emulate):
    _checks.same_device(OP, "x", x, ("weight", weight))
    return x.new_empty((x.shape[0], weight.shape[1]))


@torch.library.custom_op("megakernels::grouped_gemm_bwd", mutates_args=())
def grouped_gemm_backward(
    dout: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor, emulate: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if _use_triton(x, emulate):
        return _triton_kernels().backward(dout, x, weight, group_sizes)
    groups = segments(group_sizes)  # the sizes read on the host once for both halves
    return _dgrad_host(dout, x, weight, groups), _wgrad_host(dout, x, weight, groups)


def _dgrad_host(dout, x, weight, groups) -> torch.Tensor:
    # The groups (``segments``) cover every row of dx (the sizes sum to T).
    dx = torch.empty_like(x)
    for e, a, b in groups:
        torch.mm(dout[a:b], weight[e], out=dx[a:b])
    return dx


def _wgrad_host(dout, x, weight, groups) -> torch.Tensor:
    # dW needs zeros only where a group is empty.
    dw = torch.empty_like(weight) if len(groups) == weight.shape[0] else torch.zeros_like(weight)
    for e, a, b in groups:
        torch.mm(dout[a:b].t(), x[a:b], out=dw[e])
    return dw


def grouped_gemm_backward_parts(
    dout: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor, part: str
) -> torch.Tensor:
    """One half of ``grouped_gemm``'s backward, computed exactly as the whole backward computes it: ``part="dx"``
    (``[T, k]``) or ``"dw"`` (``[E, n, k]``), for a zero-bubble pipeline that runs the weight gradient later
    (``megakernels.parallel.moe.experts``). Takes what ``grouped_gemm``'s autograd saved (contiguous ``x`` and
    ``weight``) and a contiguous ``dout``; eager (not a custom op: nothing compiles it)."""
    emulate = emulate_for(OP, x)
    if part not in ("dx", "dw"):
        raise ValueError(f"grouped_gemm_backward_parts: part must be 'dx' or 'dw', got {part!r}")
    if _use_triton(x, emulate):
        kernels = _triton_kernels()
        return (kernels.dgrad if part == "dx" else kernels.wgrad)(dout, x, weight, group_sizes)
    return (_dgrad_host if part == "dx" else _wgrad_host)(dout, x, weight, segments(group_sizes))


@grouped_gemm_backward.register_fake
def _(dout, x, weight, group_sizes, emulate):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, weight, group_sizes, emulate = inputs
    ctx.save_for_backward(x, weight, group_sizes)
    ctx.emulate = emulate


def _backward(ctx, dout):
    x, weight, group_sizes = ctx.saved_tensors
    dx, dw = grouped_gemm_backward(dout.contiguous(), x, weight, group_sizes, ctx.emulate)
    return dx, dw, None, None


_grouped_gemm.register_autograd(_backward, setup_context=_setup_context)


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """``out[rows of group e] = x[rows of group e] @ weight[e]ᵀ`` for consecutive groups of rows.

    Args:
        x: ``[T, k]``, rows sorted by group.
        weight: ``[E, n, k]`` in x's dtype, on x's device.
        group_sizes: int32/int64 ``[E]``, non-negative, summing to ``T`` (any device; on x's device for CUDA
            runs without a host synchronisation).

    Returns:
        ``[T, n]`` in x's dtype; differentiable w.r.t. x and weight.

    Raises:
        TypeError / ValueError naming the argument for wrong types, ranks, shapes, dtypes, devices or group sizes
        (for CUDA sizes on a CUDA x, the sizes' values fail a device-side assert at the next synchronisation);
        ValueError for fp64 under backend cuda_emu.
    """
    _check(x, weight, group_sizes)
    emulate = emulate_for(OP, x)
    if emulate and x.dtype not in _TRITON_DTYPES:
        raise ValueError(
            f"{OP}: backend cuda_emu runs the Triton kernels, which take "
            f"{', '.join(str(t) for t in _TRITON_DTYPES)}; x has dtype {x.dtype}"
        )
    return _grouped_gemm(x.contiguous(), weight.contiguous(), group_sizes, emulate)


def grouped_gemm_reference(x, weight, group_sizes, compute_dtype=torch.float64):
    """A loop of per-group matrix products in ``compute_dtype`` (tests)."""
    out, start = [], 0
    for e, n in enumerate(group_sizes.tolist()):
        out.append(x[start : start + n].to(compute_dtype) @ weight[e].to(compute_dtype).t())
        start += n
    return torch.cat(out) if out else x.new_empty((0, weight.shape[1]), dtype=compute_dtype)
