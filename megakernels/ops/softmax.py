"""Fused scaled (masked / causal) softmax over the last dimension: Megatron's attention softmaxes, with no cap on
the sequence length.

Algorithm (csrc/softmax): per row, ``z = x * scale`` with masked positions at ``-inf``, then
``y = exp(z - max z) / sum exp(z - max z)``, all in fp32 (fp64 for fp64 input) and stored in x's dtype. The CPU
kernel makes three vectorised passes over one cached row (scale+mask+max, exp+sum, normalise); the CUDA kernel
makes an online (max, sum) pass and a write pass, with a warp per short row and a block per long row. The causal
kernels touch only the valid prefix of each row: masked elements are neither read nor exponentiated. Only ``y`` is
saved for backward::

    dx = scale * y * (dy - sum(dy * y))            (per row; y is 0 at masked positions)

Semantics of a row, exactly those of ``masked_fill(mask, -inf)`` followed by ``torch.softmax`` except that a
**fully masked row gives zeros** (and a zero gradient) instead of NaN:

- masked positions have -inf semantics (not Megatron's -10000): they get exactly 0 probability, and whatever x
  holds there (NaN included) is ignored;
- NaN or inf in the *unmasked* part of x propagate as in ``torch.softmax``: a NaN or ``+inf``, or unmasked values
  that are all ``-inf``, turn the whole row into NaN (masked positions included); a ``-inf`` among finite values
  just gets probability 0.

Dtypes: fp32/fp16/bf16 (and fp64, for gradcheck); output and gradients in x's dtype.
"""

from __future__ import annotations

import torch

import megakernels._lib  # noqa: F401  (registers torch.ops.megakernels.*)
from megakernels._backend import emulate_for
from megakernels.ops import _checks
from megakernels.ops._autograd import eager_autograd


@torch.library.register_fake("megakernels::softmax_fwd")
def _softmax_fwd_fake(x, mask, scale, causal, emulate):
    _checks.same_device("scaled_masked_softmax", "x", x, ("mask", mask))
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.register_fake("megakernels::softmax_bwd")
def _softmax_bwd_fake(grad_output, y, scale, causal, emulate):
    _checks.same_device("scaled_softmax_backward", "y", y, ("grad_output", grad_output))
    return torch.empty(y.shape, dtype=y.dtype, device=y.device)


def _setup_context(ctx, inputs, output):
    _x, _mask, scale, causal, emulate = inputs
    ctx.save_for_backward(output)  # backward needs y only
    ctx.scale, ctx.causal, ctx.emulate = scale, causal, emulate


def _backward(ctx, dy):
    (y,) = ctx.saved_tensors
    dx = torch.ops.megakernels.softmax_bwd(dy, y, ctx.scale, ctx.causal, ctx.emulate)
    return dx, None, None, None, None


torch.library.register_autograd("megakernels::softmax_fwd", _backward, setup_context=_setup_context)
_softmax_fwd = eager_autograd("softmax_fwd_eager", torch.ops.megakernels.softmax_fwd.default, _setup_context, _backward)


def scaled_softmax(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``softmax(x * scale)`` over the last dimension.

    Args:
        x: ``[..., sk]``, any leading shape, fp32/fp16/bf16/fp64, CPU or CUDA (non-contiguous input is copied).
        scale: a finite real number (e.g. ``1/sqrt(head_dim)``).

    Returns:
        ``[..., sk]`` in x's dtype; differentiable w.r.t. x. NaN/inf in x propagate as in ``torch.softmax``.

    Raises:
        TypeError: x not a floating tensor, scale not a real number. ValueError: a 0-dim or sparse x, a non-finite
        scale, a backend that cannot take x.
    """
    op = "scaled_softmax"
    _checks.tensor(op, "x", x)
    s = _checks.real(op, "scale", scale)
    return _softmax_fwd(x, None, s, False, emulate_for(op, x))


def scaled_masked_softmax(x: torch.Tensor, mask: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``softmax(masked_fill(x * scale, mask, -inf))`` over the last dimension; fully masked rows give zeros.

    Args:
        x: ``[b, heads, sq, sk]``, fp32/fp16/bf16/fp64.
        mask: bool, ``True`` = masked out; broadcastable to x as ``[b or 1, heads or 1, sq or 1, sk]`` (2 or 3 dims
            are right-aligned, as in PyTorch broadcasting). Broadcasting happens through strides in the kernel;
            the mask is never expanded in memory.
        scale: a finite real number.

    Returns:
        ``[b, heads, sq, sk]`` in x's dtype; differentiable w.r.t. x (masked positions get zero gradient).

    Raises:
        TypeError: x not floating, mask not a bool tensor, scale not a real number. ValueError: x not 4-D, a mask
        shape that does not broadcast, mask and x on different devices (meta included), a sparse x or mask, a
        non-finite scale.
    """
    op = "scaled_masked_softmax"
    _checks.tensor(op, "x", x)
    _checks.tensor(op, "mask", mask)
    s = _checks.real(op, "scale", scale)
    return _softmax_fwd(x, mask, s, False, emulate_for(op, x))


def scaled_causal_softmax(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Softmax of ``x * scale`` under the causal mask, over the last dimension.

    Element ``(i, j)`` of the last two dims ``[sq, sk]`` is masked when ``j > i + (sk - sq)``: the diagonal is
    aligned to the bottom-right corner (flash-attention's convention), so with ``sq < sk`` the queries are the last
    ``sq`` positions of the keys; with ``sq > sk`` the first ``sq - sk`` rows are fully masked and give zeros. The
    kernel never reads x in the masked triangle (NaN there is harmless).

    Args:
        x: ``[..., sq, sk]`` (at least 2-D), fp32/fp16/bf16/fp64.
        scale: a finite real number.

    Returns:
        ``[..., sq, sk]`` in x's dtype; differentiable w.r.t. x.

    Raises:
        TypeError / ValueError as :func:`scaled_softmax`, and ValueError for an x with fewer than 2 dims.
    """
    op = "scaled_causal_softmax"
    _checks.tensor(op, "x", x)
    s = _checks.real(op, "scale", scale)
    return _softmax_fwd(x, None, s, True, emulate_for(op, x))


# ----------------------------------------------------------------------------------------------------------------
# Reference semantics in plain PyTorch (used by the tests and as documentation).


def causal_mask(sq: int, sk: int, device=None) -> torch.Tensor:
    """``[sq, sk]`` bool, True where ``j > i + (sk - sq)`` (bottom-right aligned causal mask)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(sk - sq + 1)


def scaled_masked_softmax_reference(x, mask=None, scale=1.0, compute_dtype=torch.float64):
    """The eager composition ``softmax(masked_fill(x * scale, mask, -inf))`` in ``compute_dtype``, with fully
    masked rows set to 0 (and given a zero gradient); returns compute_dtype."""
    z = x.to(compute_dtype) * scale
    if mask is None:
        return torch.softmax(z, -1)
    z = z.masked_fill(mask, float("-inf"))
    dead = mask.all(-1, keepdim=True).expand_as(z)
    # Softmax of a dead row would be NaN (and poison the gradient through it): give it finite inputs, then zero it.
    y = torch.softmax(z.masked_fill(dead, 0.0), -1)
    return y.masked_fill(dead, 0.0)


def scaled_softmax_reference(x, scale=1.0, compute_dtype=torch.float64):
    """``torch.softmax(x * scale, -1)`` in ``compute_dtype``."""
    return scaled_masked_softmax_reference(x, None, scale, compute_dtype)


def scaled_causal_softmax_reference(x, scale=1.0, compute_dtype=torch.float64):
    """The masked reference with :func:`causal_mask` of x's last two dims (rows that see no key give zeros)."""
    sq, sk = x.shape[-2], x.shape[-1]
    return scaled_masked_softmax_reference(x, causal_mask(sq, sk, x.device), scale, compute_dtype)
