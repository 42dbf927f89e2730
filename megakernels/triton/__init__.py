"""Triton kernels (FlashAttention, cross-entropy, the grouped GEMM, FP8 quantisation and GEMMs). Imported lazily by
megakernels.ops, so that the CPU paths work without Triton. On a machine without a GPU they run under Triton's
interpreter when ``TRITON_INTERPRET=1`` was set before this package was imported (``interpreting()`` tells).

Triton's interpreter lacks the tensor-descriptor add (``desc.atomic_add``) that the FlashAttention backward uses on
the TMA path; importing this package leaves Triton alone, and ``install_interpreter_descriptor_reduce()`` adds it
to the interpreter, once, for a process that runs the backward under it (the test suite calls it in
tests/conftest.py). Its FP8 casts round wrongly; ``install_interpreter_fp8_casts()`` makes them exact (the FP8
kernels refuse to run under the interpreter without it; tests/triton/test_fp8.py calls it). A process that ran
kernels under the interpreter can still compile kernels for a GPU target (``launch.compile_launch``: the static
model, the peer calibration) in the same process."""

from megakernels.triton import launch as _launch  # noqa: F401 - notes Triton's language before any kernel runs
from megakernels.triton._common import (
    install_interpreter_descriptor_reduce,
    install_interpreter_fp8_casts,
    interpreter_fp8_casts_installed,
    interpreting,
)

__all__ = [
    "install_interpreter_descriptor_reduce",
    "install_interpreter_fp8_casts",
    "interpreter_fp8_casts_installed",
    "interpreting",
]
