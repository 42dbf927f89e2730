"""Small Triton kernels that expose internals of megakernels.triton to the tests (module level: Triton resolves
a kernel's helpers through its module globals)."""

import triton
import triton.language as tl

from megakernels.triton._common import dropout_keep, dropout_row_hash


@triton.jit
def dropout_mask_kernel(OUT, seed_lo, seed_hi, threshold, SK: tl.constexpr):
    row = tl.program_id(0)
    row_hash = dropout_row_hash(seed_lo.to(tl.uint32), seed_hi.to(tl.uint32), row + tl.zeros([1], tl.int32))
    cols = tl.arange(0, SK)
    keep = dropout_keep(row_hash[:, None], cols[None, :], threshold)
    tl.store(OUT + row * SK + cols[None, :], keep.to(tl.int8))


@triton.jit
def row_max_kernel(X, OUT, N: tl.constexpr):
    """``tl.max`` is a device-function call (a ``@jit`` function of Triton's standard library)."""
    cols = tl.arange(0, N)
    tl.store(OUT + tl.program_id(0), tl.max(tl.load(X + tl.program_id(0) * N + cols), 0))


def row_sum_kernel_source():
    """A kernel built as a compiled (not interpreted) ``@triton.jit`` function whatever ``TRITON_INTERPRET`` says:
    ``tl.sum`` and ``tl.sigmoid`` from the standard library, a loop over ``tl.range``."""
    from megakernels.triton.launch import without_interpreter

    with without_interpreter():

        @triton.jit
        def row_sum_kernel(X, OUT, ROWS, N: tl.constexpr):
            acc = tl.zeros([N], tl.float32)
            for r in tl.range(0, ROWS):
                acc += tl.sigmoid(tl.load(X + r * N + tl.arange(0, N)))
            tl.store(OUT + tl.program_id(0), tl.sum(acc, 0))

    return row_sum_kernel
