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
