"""Triton kernels (FlashAttention, cross-entropy). Imported lazily by megakernels.ops, so that the CPU paths work
without Triton. On a machine without a GPU they run under Triton's interpreter when ``TRITON_INTERPRET=1`` was set
before this package was imported (``interpreting()`` tells)."""

from megakernels.triton._common import interpreting

__all__ = ["interpreting"]
