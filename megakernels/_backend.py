"""Backend selection for the compiled ops (docs/design.md §2-3).

Backends:
- ``auto`` (default): CUDA tensors run the CUDA kernels, CPU tensors the C++ CPU kernels.
- ``cpu``: the C++ CPU kernels; a CUDA tensor is an error.
- ``cuda``: the CUDA kernels; a CPU tensor is an error.
- ``cuda_emu``: CPU tensors run the *CUDA* kernels through the CPU emulation of the CUDA execution model
  (csrc/emu). Slow; meant for testing the .cu kernels without a GPU. Asking for it when the emulated kernels
  were not built is an error, never a silent fallback.

Chosen by the ``MEGAKERNELS_BACKEND`` environment variable or, taking precedence, the
``megakernels.backend(name)`` context manager.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

import torch

BACKENDS = ("auto", "cpu", "cuda", "cuda_emu")
_FLAG_CUDA, _FLAG_EMU = 1, 2

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("megakernels_backend", default=None)


def _check_name(name: str, where: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{where}: unknown backend {name!r}; expected one of {', '.join(BACKENDS)}")
    return name


def current_backend() -> str:
    """The backend in force: the innermost ``backend()`` context, else ``$MEGAKERNELS_BACKEND``, else ``auto``."""
    name = _override.get()
    if name is not None:
        return name
    return _check_name(os.environ.get("MEGAKERNELS_BACKEND", "auto") or "auto", "MEGAKERNELS_BACKEND")


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Run the enclosed ops on backend ``name`` (one of ``auto``, ``cpu``, ``cuda``, ``cuda_emu``).

    Raises ValueError for an unknown name and RuntimeError when ``cuda_emu``/``cuda`` were not built.
    """
    _check_name(name, "megakernels.backend")
    if name == "cuda_emu" and not has_backend("cuda_emu"):
        raise RuntimeError(
            "megakernels.backend('cuda_emu'): the emulated CUDA kernels were not built "
            "(they need the CUDA headers at build time: set CUDA_HOME and reinstall)"
        )
    token = _override.set(name)
    try:
        yield
    finally:
        _override.reset(token)


def _build_flags() -> int:
    import megakernels._lib  # noqa: F401  (loads the library, registers torch.ops.megakernels)

    return int(torch.ops.megakernels.build_flags())


def cpu_isa() -> str:
    """The instruction set the CPU kernels run: ``"avx512"``, ``"avx2"`` or ``"baseline"`` (x86-64-v2) in a
    portable build (the default: all three are built and the best this CPU has is chosen at run time, once per
    process; ``MEGAKERNELS_CPU_ISA=baseline|avx2|avx512`` picks a narrower one), or ``"native"`` for a build with
    ``MEGAKERNELS_NATIVE=1`` (one ``-march=native`` target, no choice).

    Raises:
        ValueError: ``MEGAKERNELS_CPU_ISA`` names no ISA, or one this CPU lacks (the message names the variable);
            every CPU kernel call raises it too, so nothing runs instructions the CPU does not have.
    """
    import megakernels._lib  # noqa: F401  (loads the library, registers torch.ops.megakernels)

    return str(torch.ops.megakernels.cpu_isa())


def has_backend(name: str) -> bool:
    """Whether the compiled library contains backend ``name`` (``cpu`` always; ``cuda``/``cuda_emu`` if built)."""
    _check_name(name, "has_backend")
    if name in ("auto", "cpu"):
        return True
    flag = _FLAG_CUDA if name == "cuda" else _FLAG_EMU
    return bool(_build_flags() & flag)


def emulate_for(op: str, x: torch.Tensor, arg: str = "x") -> bool:
    """Whether ``op`` on tensor ``x`` (the argument ``arg``, which decides the device) runs the emulated CUDA
    kernels; raises, naming the argument, if the backend cannot take ``x``."""
    name = current_backend()
    if name == "auto":
        return False
    if name == "cuda_emu":
        if x.device.type != "cpu":
            raise ValueError(f"{op}: backend cuda_emu runs CPU tensors, but {arg} is on {x.device}")
        if not has_backend("cuda_emu"):
            raise RuntimeError(f"{op}: backend cuda_emu requested but the emulated CUDA kernels were not built")
        return True
    if name == "cuda" and x.device.type != "cuda":
        raise ValueError(f"{op}: backend cuda requested, but {arg} is on {x.device}")
    if name == "cpu" and x.device.type != "cpu":
        raise ValueError(f"{op}: backend cpu requested, but {arg} is on {x.device}")
    return False


def runs_triton(op: str, x: torch.Tensor, emulate: bool) -> bool:
    """Whether an op with Triton kernels runs them for ``x``: always for CUDA tensors; for CPU tensors under
    ``cuda_emu`` (``emulate``), through Triton's interpreter — which must have been chosen (TRITON_INTERPRET=1)
    before megakernels.triton was imported, else RuntimeError (never a silent fallback to the CPU path)."""
    if x.device.type == "cuda":
        return True
    if emulate:
        from megakernels.triton import interpreting

        if not interpreting():
            raise RuntimeError(
                f"{op}: backend cuda_emu runs the Triton kernels on the CPU, which needs "
                "TRITON_INTERPRET=1 in the environment before megakernels is imported"
            )
        return True
    return False
