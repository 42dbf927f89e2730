"""Comparison helpers: kernels are checked against an independent plain-PyTorch reference run in fp64."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Backend:
    """What an op test runs on: the backend name and the device its tensors live on."""

    name: str
    device: str

    @property
    def emulated(self) -> bool:
        return self.name == "cuda_emu"


# Tolerances against an fp64 reference, relative to the reference's largest magnitude (so a bf16 result is
# allowed its storage rounding, ~2^-8 relative, plus fp32-accumulation noise; fp32 gets 2e-5 of headroom).
TOLERANCE = {
    torch.float64: 1e-9,
    torch.float32: 2e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def assert_close_to_reference(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str, factor: float = 1.0
) -> None:
    """``|actual - expected| <= tol(dtype) * factor * max(1, max|expected|)`` elementwise, with a clear message."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    assert torch.isfinite(a).all() == torch.isfinite(e).all(), f"{what}: non-finite values differ"
    scale = max(1.0, e.abs().max().item()) if e.numel() else 1.0
    tol = TOLERANCE[dtype] * factor * scale
    err = (a - e).abs().max().item() if e.numel() else 0.0
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g} ({dtype}, scale {scale:.3g})"


def reference_grads(fn, inputs, dy):
    """Gradients of ``sum(fn(*inputs) * dy)`` computed in fp64 by autograd on detached fp64 copies."""
    leaves = [t.detach().to(torch.float64).requires_grad_(True) if t is not None else None for t in inputs]
    out = fn(*leaves)
    out.backward(dy.to(torch.float64))
    return out.detach(), [t.grad if t is not None else None for t in leaves]


def kernel_grads(fn, inputs, dy):
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in inputs]
    out = fn(*leaves)
    out.backward(dy)
    return out.detach(), [t.grad if t is not None else None for t in leaves]


def make(shape, dtype, device, scale=1.0, shift=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float32) * scale + shift).to(dtype=dtype, device=device)
