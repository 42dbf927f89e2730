"""fp32 GEMMs on the CPU through oneDNN: ``mm``, ``linear`` (autograd) and ``linear_nograd``.

PyTorch runs an fp32 ``mm`` / ``F.linear`` on the CPU through MKL's sgemm; on AMD CPUs MKL takes its AVX2 path
(about 190-210 GF/s on the two-core AVX-512 development machine, against about 450 GF/s for oneDNN's AVX-512 kernel
at the same shapes, fp32 products and sums either way: benchmarks/results/2026-12-03-cpu-epyc-fp32-gemm.md). The
layers of this package (the trainer's column/row-parallel linears, the tied LM head, the patched transformers
linears) call these functions instead of ``torch.mm`` / ``F.linear``; they route a product to oneDNN
(``torch.ops.mkldnn._linear_pointwise``, the op Inductor's CPU backend uses) when all of these hold, and to PyTorch
otherwise (nothing changes):

- nothing is being compiled, and every operand is a plain ``torch.Tensor`` or ``nn.Parameter`` (no fake,
  functional or DTensor subclass: compiling and tracing see PyTorch's ops) on the CPU, in fp32;
- the product is at least ``MIN_FLOPS`` multiply-adds (oneDNN's call costs ~12 us, MKL's ~2 us: below this size
  MKL is as fast);
- oneDNN is built in (``torch.backends.mkldnn.is_available()``) and ``MEGAKERNELS_CPU_GEMM`` is not ``torch``.

``mm`` and ``linear_nograd`` record no autograd history (for use inside autograd functions); ``linear`` is
differentiable (its backward's two products routed the same way, ``db`` a column sum).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

MIN_FLOPS = 1 << 21  # multiply-adds (m n k) from which oneDNN's fp32 GEMM is ahead on the CPU (measured: ~1.15x)


_BUILT_IN = torch.backends.mkldnn.is_available()
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def enabled() -> bool:
    """oneDNN is built in and not turned off (``MEGAKERNELS_CPU_GEMM=torch``)."""
    return _BUILT_IN and os.environ.get("MEGAKERNELS_CPU_GEMM", "onednn") != "torch"


def routed(a: torch.Tensor, b: torch.Tensor, m: int, n: int, k: int) -> bool:
    """Whether the product of ``a`` and ``b`` (``m x k`` by ``k x n``) goes to oneDNN (module docstring): never where
    autograd would record it (oneDNN's op has no derivative: a backward with ``create_graph`` runs PyTorch's)."""
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return False
    return _eligible(a, b, m, n, k)


def _eligible(a: torch.Tensor, b: torch.Tensor, m: int, n: int, k: int) -> bool:
    if m * n * k < MIN_FLOPS or torch.compiler.is_compiling():  # a compiled graph holds PyTorch's ops
        return False
    return (
        type(a) in _PLAIN
        and type(b) in _PLAIN
        and a.device.type == "cpu"
        and b.device.type == "cpu"
        and a.dtype == torch.float32
        and b.dtype == torch.float32
        and enabled()
    )


def _onednn(x2: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x2 wᵀ (+ bias)``: ``x2`` ``[m, k]``, ``w`` ``[n, k]`` (either may be a transposed view)."""
    if bias is not None and (type(bias) is not torch.Tensor or bias.dtype != torch.float32):
        return _onednn(x2, w, None) + bias
    return torch.ops.mkldnn._linear_pointwise(x2, w, bias, "none", [], "")


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-D ``a`` ``[m, k]`` and ``b`` ``[k, n]`` (no autograd history when routed)."""
    if a.dim() == 2 and b.dim() == 2 and routed(a, b, a.shape[0], b.shape[1], a.shape[1]):
        return _onednn(a, b.t(), None)
    return torch.mm(a, b)


def linear_nograd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` ``[..., k]``, ``weight`` ``[n, k]`` (no autograd history when
    routed)."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if weight.dim() == 2 and routed(x, weight, rows, weight.shape[0], k):
        return _onednn(x.reshape(rows, k), weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


class _Linear(torch.autograd.Function):
    """``y = x Wᵀ + b`` with the three products through ``mm`` / ``linear_nograd``."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return linear_nograd(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = mm(dy2, weight).view(x.shape)
        if ctx.needs_input_grad[1]:
            dw = mm(dy2.t(), x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, differentiable; routed to oneDNN (forward and backward) where ``routed`` says
    so for the forward's product, and ``F.linear`` itself otherwise (its autograd, create_graph included)."""
    if x.dtype != torch.float32 or not x.is_cpu:  # the common cases first: a GPU, 16-bit training
        return F.linear(x, weight, bias)
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if weight.dim() == 2 and _eligible(x, weight, rows, weight.shape[0], k):
        return _Linear.apply(x, weight, bias)
    return F.linear(x, weight, bias)
