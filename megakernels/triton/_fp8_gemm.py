"""The FP8 GEMM kernels (launched by megakernels/triton/fp8.py; semantics: megakernels/ops/fp8.py).

``C = A @ Bᵀ`` for FP8 ``A`` ``[M, K]`` and ``B`` ``[N, K]``, both K-contiguous: the layout sm_90's FP8 wgmma
takes for both operands (it has no transposed form for 8-bit types), so a ``[BLOCK_N, BLOCK_K]`` tile of ``B``
goes to ``tl.dot`` as ``tl.trans(b)`` — a K-major ``[BLOCK_K, BLOCK_N]`` view of the same shared-memory tile, no
data movement (QGMMA in the SASS).

The K loop runs in chunks of ``BLOCK_K = 128``, the scales' tile width. Each chunk's product starts from zero
(the tensor cores' limited-precision accumulation never sees more than 128 products) and is added to the fp32
accumulator in the CUDA cores, multiplied by the chunk's scales where they vary along K (the "promotion"):
``A_ROW`` — ``a_scale[m, chunk]``, a column vector; ``B_GRAN`` 1 ("row") — ``b_scale[n, chunk]``, a row vector,
read from the scales transposed to ``[chunks, N]`` (the launcher's copy) so that a chunk's are contiguous; 2
("block") — ``b_scale[n // 128, chunk]``, one scalar per tile when ``BLOCK_N`` divides 128. Scales that are one per
tensor multiply the accumulator once, in the epilogue. ``stride_as``, ``stride_bs``: the row strides of the scale
matrices as passed.

Operands come through TMA tensor descriptors (``TMA``: built by the launcher, which pads K to a multiple of 16 so
each row is 16-byte aligned; out-of-range rows and the K tail read as zeros) or, on a Triton without descriptors,
through masked pointer loads.

- ``fp8_gemm_kernel``: one program per ``[BLOCK_M, BLOCK_N]`` tile of C, grouped ``GROUP_M`` row tiles at a time
  along N so consecutive programs share B tiles in L2.
- ``fp8_grouped_kernel``: the experts' GEMM, ``C[rows of e] = A[rows of e] @ B[e]ᵀ``; the row tile of each program
  and its group come from the group sizes on the device (``grouped_gemm.group_of_tile``), as in the 16-bit
  grouped GEMM; rows of the next group that a tile's loads touch are never stored.
"""

from __future__ import annotations

import triton
import triton.language as tl

from megakernels.triton.grouped_gemm import group_of_tile


@triton.jit
def _promote(
    acc,
    part,
    AS,
    BS,
    rows,
    cols,
    row_ok,
    col_ok,
    kc,
    b_block0,
    stride_as,
    stride_bs,
    A_ROW: tl.constexpr,
    B_GRAN: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``acc + part`` times chunk ``kc``'s scales where they vary along K (module docstring)."""
    if A_ROW:
        sa = tl.load(AS + rows.to(tl.int64) * stride_as + kc, mask=row_ok, other=0.0)
        if B_GRAN == 0:
            acc += part * sa[:, None]
        elif B_GRAN == 1:
            sb = tl.load(BS + kc * stride_bs + cols, mask=col_ok, other=0.0)
            acc += part * (sa[:, None] * sb[None, :])
        elif BLOCK_N <= 128:
            acc += part * (sa * tl.load(BS + b_block0 + kc))[:, None]
        else:
            blocks_n = tl.arange(0, BLOCK_N) // 128  # a wide tile's 128-column blocks of B
            sb = tl.load(BS + b_block0 + blocks_n * stride_bs + kc, mask=col_ok, other=0.0)
            acc += part * (sa[:, None] * sb[None, :])
    else:
        if B_GRAN == 0:
            acc += part
        elif B_GRAN == 1:
            acc += part * tl.load(BS + kc * stride_bs + cols, mask=col_ok, other=0.0)[None, :]
        elif BLOCK_N <= 128:
            acc += part * tl.load(BS + b_block0 + kc)
        else:
            blocks_n = tl.arange(0, BLOCK_N) // 128
            sb = tl.load(BS + b_block0 + blocks_n * stride_bs + kc, mask=col_ok, other=0.0)
            acc += part * sb[None, :]
    return acc


@triton.jit
def _mainloop(
    A,
    B,
    AS,
    BS,
    rows,
    cols,
    row_ok,
    col_ok,
    a_row0,
    b_row0,
    b_block0,
    K,
    stride_am,
    stride_bn,
    stride_as,
    stride_bs,
    A_ROW: tl.constexpr,
    B_GRAN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    TMA: tl.constexpr,
):
    """The fp32 accumulator of one tile: every 128-wide K chunk's FP8 product, promoted (module docstring).
    ``rows``/``cols``: the tile's row and column indices into A's and B's rows (pointer loads, scales);
    ``a_row0``/``b_row0``: the first of them (descriptor loads); ``b_block0``: offset of the tile's first scale of B
    (block scales: ``BS + b_block0 + chunk``)."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if not TMA:
        a_ptrs = A + rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
        b_ptrs = B + cols.to(tl.int64)[:, None] * stride_bn + offs_k[None, :]
    for k0 in range(0, K, BLOCK_K):
        kc = k0 // BLOCK_K
        if TMA:
            a = A.load([a_row0, k0])
            b = B.load([b_row0, k0])
        elif EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[:, None], other=0.0)
        else:
            k_ok = k0 + offs_k < K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        part = tl.dot(a, tl.trans(b))
        acc = _promote(
            acc, part, AS, BS, rows, cols, row_ok, col_ok, kc, b_block0, stride_as, stride_bs, A_ROW, B_GRAN, BLOCK_N
        )
        if not TMA:
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
    return acc


@triton.jit
def fp8_gemm_kernel(
    A,
    B,
    C,
    AS,
    BS,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_as,
    stride_bs,
    A_ROW: tl.constexpr,
    B_GRAN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    TMA: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = pid // per_group * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    b_block0 = (pid_n * BLOCK_N // 128) * stride_bs
    acc = _mainloop(
        A,
        B,
        AS,
        BS,
        rows,
        cols,
        row_ok,
        col_ok,
        pid_m * BLOCK_M,
        pid_n * BLOCK_N,
        b_block0,
        K,
        stride_am,
        stride_bn,
        stride_as,
        stride_bs,
        A_ROW,
        B_GRAN,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        EVEN_K,
        TMA,
    )
    if not A_ROW:
        acc = acc * tl.load(AS)
    if B_GRAN == 0:
        acc = acc * tl.load(BS)
    c_ptrs = C + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def fp8_grouped_kernel(
    A,
    B,
    C,
    AS,
    BS,
    SIZES,
    T,
    N,
    K,
    E,
    stride_am,
    stride_bn,
    stride_cm,
    stride_as,
    stride_bs,
    stride_be,
    BLOCK_E: tl.constexpr,
    A_ROW: tl.constexpr,
    B_GRAN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    TMA: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g, start, end = group_of_tile(SIZES, E, pid_m, BLOCK_E, BLOCK_M)
    if g >= E:
        return
    end = tl.minimum(end, T)
    rows = start + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < end
    col_ok = cols < N
    # B[e] as rows g * N .. g * N + N - 1 of B seen as [E * N, K]; scales of B[e] from BS + g * stride_be
    b_rows = g * N + cols
    bs = BS + g.to(tl.int64) * stride_be
    acc = _mainloop(
        A,
        B,
        AS,
        bs,
        rows,
        b_rows,
        row_ok,
        col_ok,
        start,
        g * N + pid_n * BLOCK_N,
        (pid_n * BLOCK_N // 128) * stride_bs,
        K,
        stride_am,
        stride_bn,
        stride_as,
        stride_bs,
        A_ROW,
        B_GRAN,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        EVEN_K,
        TMA,
    )
    if not A_ROW:
        acc = acc * tl.load(AS)
    if B_GRAN == 0:
        acc = acc * tl.load(bs)
    c_ptrs = C + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


__all__ = ["fp8_gemm_kernel", "fp8_grouped_kernel", "triton"]
