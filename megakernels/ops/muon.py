"""The Newton-Schulz iteration of Muon: a batch of matrices mapped to (approximately) their orthogonal factors.

For each matrix ``G`` ``[m, n]`` of the batch (transposed first when ``m > n``, so that the Gram matrix is the
smaller one)::

    X = G / max(||G||_F, eps)
    repeat steps times:
        A = X Xᵀ                       symmetric
        B = b A + c A A                symmetric (A A = A Aᵀ)
        X = a X + B X

with the quintic coefficients ``(a, b, c)`` (default ``(3.4445, -4.7750, 2.0315)``): the singular values of ``X``
are driven towards [0.7, 1.2] while its singular vectors stay those of ``G`` (``U Vᵀ`` up to that spread).

``newton_schulz`` runs the fused kernels, which compute the symmetric products' lower triangle only (about 2/3 of
the plain iteration's FLOPs for a square X) and fold the polynomial's additions into the products' epilogues:
Triton on CUDA (``megakernels.triton.muon``; on CPU tensors under backend ``cuda_emu`` through Triton's
interpreter), the C++ kernel on the CPU (``csrc/muon``: fp32; other dtypes take the plain iteration).
``newton_schulz_reference`` is the plain ``torch`` iteration, the reference the kernels are tested against.
"""

from __future__ import annotations

import torch

import megakernels._lib  # noqa: F401  (registers torch.ops.megakernels.*)
from megakernels._backend import emulate_for, runs_triton
from megakernels.ops import _checks

COEFFICIENTS = (3.4445, -4.7750, 2.0315)
EPS = 1e-7
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_input(op: str, x, steps, coefficients, eps) -> tuple[int, tuple[float, float, float], float]:
    """Checks of the iteration's arguments; returns ``(steps, coefficients, eps)`` as Python numbers.

    Raises:
        TypeError: ``x`` not a floating tensor of a supported dtype, a non-integer ``steps``, non-real
            coefficients or eps. ValueError: ``x`` of fewer than 2 dims, ``steps < 0``, not three coefficients,
            ``eps <= 0``.
    """
    _checks.tensor(op, "x", x)
    if x.dtype not in _DTYPES:
        raise TypeError(f"{op}: x has dtype {x.dtype}; expected float32, float16, bfloat16 or float64")
    if x.dim() < 2:
        raise ValueError(f"{op}: x must be a matrix or a batch of matrices [..., m, n], got shape {tuple(x.shape)}")
    steps = _checks.integer(op, "steps", steps, minimum=0)
    if not isinstance(coefficients, (tuple, list)) or len(coefficients) != 3:
        raise ValueError(f"{op}: coefficients must be three numbers (a, b, c), got {coefficients!r}")
    coefficients = tuple(_checks.real(op, f"coefficients[{i}]", c) for i, c in enumerate(coefficients))
    eps = _checks.real(op, "eps", eps)
    if eps <= 0.0:
        raise ValueError(f"{op}: eps must be > 0, got {eps}")
    return steps, coefficients, eps


def newton_schulz_reference(
    x: torch.Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = COEFFICIENTS,
    eps: float = EPS,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The iteration (module docstring) as plain ``torch`` matrix products, in ``dtype`` (default: x's).

    Args:
        x: ``[..., m, n]`` (any leading batch dims), floating.
        steps: iterations (>= 0). coefficients: ``(a, b, c)``. eps: the norm's floor (> 0).
        dtype: the dtype of the arithmetic and of the result.

    Returns:
        ``[..., m, n]`` in ``dtype``.

    Raises:
        TypeError / ValueError: as ``check_input``.
    """
    steps, (a, b, c), eps = check_input("newton_schulz_reference", x, steps, coefficients, eps)
    tall = x.shape[-2] > x.shape[-1]
    X = x.to(dtype or x.dtype)
    X = X.mT if tall else X
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return (X.mT if tall else X).contiguous()


@torch.library.register_fake("megakernels::newton_schulz_cpu")
def _newton_schulz_cpu_fake(x, steps, a, b, c, eps):
    return torch.empty_like(x)


@torch.library.custom_op("megakernels::newton_schulz", mutates_args=())
def _newton_schulz(
    x: torch.Tensor, steps: int, a: float, b: float, c: float, eps: float, emulate: bool
) -> torch.Tensor:
    """The iteration on ``x`` ``[batch, rows, cols]`` in x's dtype (the dispatch of the module docstring)."""
    if runs_triton("newton_schulz", x, emulate):
        from megakernels.triton import muon as kernels

        return kernels.newton_schulz(x, steps, (a, b, c), eps)
    if x.dtype == torch.float32:
        return torch.ops.megakernels.newton_schulz_cpu(x.contiguous(), steps, a, b, c, eps)
    return newton_schulz_reference(x, steps, (a, b, c), eps)


@_newton_schulz.register_fake
def _(x, steps, a, b, c, eps, emulate):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def newton_schulz(
    x: torch.Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = COEFFICIENTS,
    eps: float = EPS,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Muon's orthogonalisation of a batch of matrices (module docstring), by the fused kernels.

    Args:
        x: ``[..., m, n]`` (any leading batch dims), float32/float16/bfloat16/float64, CPU or CUDA.
        steps: iterations (>= 0). coefficients: ``(a, b, c)``. eps: the norm's floor (> 0).
        dtype: the iteration's dtype (default x's): bfloat16 on the GPU is Muon's usual choice.

    Returns:
        ``[..., m, n]`` in ``dtype``, contiguous.

    Raises:
        TypeError / ValueError: naming the argument (``check_input``); ValueError: a backend that cannot take x.
    """
    steps, (a, b, c), eps = check_input("newton_schulz", x, steps, coefficients, eps)
    dtype = dtype or x.dtype
    if dtype not in _DTYPES:
        raise TypeError(f"newton_schulz: dtype must be float32, float16, bfloat16 or float64, got {dtype}")
    emulate = emulate_for("newton_schulz", x)
    shape = x.shape
    if x.numel() == 0:
        return torch.empty(shape, dtype=dtype, device=x.device)
    flat = x.to(dtype).reshape(-1, shape[-2], shape[-1])
    if runs_triton("newton_schulz", flat, emulate) and dtype == torch.float64:
        return newton_schulz_reference(x, steps, (a, b, c), eps, dtype)  # the GPU kernels take no fp64
    return _newton_schulz(flat, steps, a, b, c, eps, emulate).reshape(shape)
