"""Triton kernels (FlashAttention, cross-entropy). Imported lazily by megakernels.ops, so that the CPU paths work
without Triton. On a machine without a GPU they run under Triton's interpreter when ``TRITON_INTERPRET=1`` was set
before this package was imported (``interpreting()`` tells).

Triton's interpreter lacks the tensor-descriptor add (``desc.atomic_add``) that the FlashAttention backward uses on
the TMA path; importing this package leaves Triton alone, and ``install_interpreter_descriptor_reduce()`` adds it
to the interpreter, once, for a process that runs the backward under it (the test suite calls it in
tests/conftest.py)."""

from megakernels.triton._common import install_interpreter_descriptor_reduce, interpreting

__all__ = ["install_interpreter_descriptor_reduce", "interpreting"]
