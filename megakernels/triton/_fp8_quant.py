"""The FP8 quantiser's kernels (launched by megakernels/triton/fp8.py; semantics: megakernels/ops/fp8.py).

Every kernel walks the 128 x 128 tiles of a 2-D ``x`` ``[M, K]`` in a grid-stride loop (tile ``t`` is row block
``t // tiles_k``, column block ``t % tiles_k``; program ``p`` of ``P`` takes tiles ``p, p + P, ...``), loading each
tile once:

- ``fp8_quant_kernel`` writes the tile's FP8 copy and, with ``TRANSPOSE``, the FP8 copy of its transpose into ``xᵀ``
  ``[K, M]``. Scales by granularity (``GRAN``): ``1`` ("row", 1x128 tiles) the 128 row maxima of the tile give
  ``q``'s scales and, transposed, the 128 column maxima give ``qᵀ``'s (1x128 tiles of ``xᵀ``); ``2`` ("block") one
  maximum for the tile, shared by ``q`` and ``qᵀ``; ``0`` ("tensor") the whole tensor's maximum, reduced before by
  ``fp8_amax_kernel``, or a given scale. With ``GIVEN`` the scales come from ``SCALE_IN`` (``qᵀ``'s row scales are
  still computed: ops/fp8.py quantises ``xᵀ`` afresh).
- ``fp8_amax_kernel`` reduces ``max |x|`` over its tiles and folds it into one int32 with an atomic max.

Maxima are taken on the bits of ``|x|`` as int32: for non-negative floats the integer order is the float order,
and a NaN (exponent all ones, mantissa non-zero, sign cleared) is larger than infinity, so a NaN anywhere in a tile
makes its maximum NaN, as ``torch.amax`` does. A scale is the power of two of ``ops.fp8.pow2_scale``, built from the
maximum's exponent and mantissa bits (``_scale_bits``); ``x / s`` is computed as ``x · (1/s)``, exact for a power
of two (a product whose result is subnormal in fp32 rounds as the quotient would, and is far below the smallest
FP8 subnormal anyway). A given scale that is not a power of two in the normal range is divided by (IEEE
round-to-nearest ``div_rn``, the CPU's division), tile by tile, so any scale gives the CPU's bits.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _abs_bits(x):
    """The bits of ``|x|`` (fp32) as int32."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _scale_bits(amax_bits, MAX_EXP: tl.constexpr):
    """(scale, 1 / scale) fp32 of ``pow2_scale`` from the int32 bits of a non-negative (or NaN) amax: the smallest
    power of two ``s = 2**k`` with ``amax / s <= 0.875 * 2**MAX_EXP`` (``k`` from amax's frexp exponent ``e - 126``
    and whether its frexp mantissa exceeds 0.875, clamped to [-126, 127]); 1 for 0; amax itself (and 0 or NaN) for
    inf or NaN. A subnormal amax gives ``k = -126`` through the clamp."""
    e = amax_bits >> 23
    k = e - 126 - MAX_EXP + ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    k = tl.minimum(tl.maximum(k, -126), 127)
    s = ((k + 127) << 23).to(tl.float32, bitcast=True)
    r = ((127 - k) << 23).to(tl.float32, bitcast=True)  # k <= 120 for a finite amax: 1/s is a normal number
    amax = amax_bits.to(tl.float32, bitcast=True)
    finite = e < 255
    s = tl.where(amax_bits == 0, 1.0, tl.where(finite, s, amax))
    r = tl.where(amax_bits == 0, 1.0, tl.where(finite, r, tl.where(amax_bits == 0x7F800000, 0.0, amax)))
    return s, r


@triton.jit
def _pow2_reciprocal(s):
    """(1/s exactly, whether ``s`` is a power of two whose reciprocal is a normal fp32) of fp32 scales ``s``."""
    bits = s.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF
    exact = ((bits & 0x7FFFFF) == 0) & (bits > 0) & (e <= 253)  # positive, mantissa 0 (so e >= 1)
    r = ((254 - e) << 23).to(tl.float32, bitcast=True)
    return r, exact


@triton.jit
def _to_fp8(y, DTYPE: tl.constexpr):
    """``y`` clamped to the format's largest finite value (NaN kept) and rounded to nearest even into the FP8
    ``DTYPE``: on the GPU one ``cvt.rn.satfinite`` does both (Triton's conversion to FP8 on sm_89+;
    tests/triton/test_fp8.py checks the PTX), and the interpreter's casts of ``install_interpreter_fp8_casts``
    saturate the same way."""
    return y.to(DTYPE)


@triton.jit
def fp8_amax_kernel(X, AMAX, M, K, stride_xm, tiles_k, n_tiles, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    best = tl.zeros([BLOCK_M, BLOCK_K], tl.int32)
    for t in range(pid, n_tiles, tl.num_programs(0)):
        rows = (t // tiles_k) * BLOCK_M + offs_m
        cols = (t % tiles_k) * BLOCK_K + offs_k
        mask = (rows < M)[:, None] & (cols < K)[None, :]
        x = tl.load(X + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        best = tl.maximum(best, _abs_bits(x.to(tl.float32)))
    tl.atomic_max(AMAX, tl.max(tl.max(best, 1), 0))


@triton.jit
def fp8_quant_kernel(
    X,
    Q,
    S,
    QT,
    ST,
    SCALE_IN,
    AMAX,
    M,
    K,
    stride_xm,
    tiles_m,
    tiles_k,
    n_tiles,
    GRAN: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    GIVEN: tl.constexpr,
    MAX_EXP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    dtype = Q.dtype.element_ty
    if GRAN == 0:  # one scale: reduced by fp8_amax_kernel, or given
        if GIVEN:
            s_all = tl.load(SCALE_IN)
            r_all, exact_all = _pow2_reciprocal(s_all)
        else:
            s_all, r_all = _scale_bits(tl.load(AMAX), MAX_EXP)
            exact_all = True
        if pid == 0:
            tl.store(S, s_all)
            if TRANSPOSE:
                tl.store(ST, s_all)
    for t in range(pid, n_tiles, tl.num_programs(0)):
        tm = t // tiles_k
        tk = t % tiles_k
        rows = tm * BLOCK_M + offs_m
        cols = tk * BLOCK_K + offs_k
        row_ok = rows < M
        col_ok = cols < K
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        bits = _abs_bits(x)
        # q: x over its own tiles' scales
        if GRAN == 0:
            if exact_all:
                q = _to_fp8(x * r_all, dtype)
            else:
                q = _to_fp8(tl.div_rn(x, s_all), dtype)
        elif GRAN == 1:
            if GIVEN:
                s_row = tl.load(SCALE_IN + rows.to(tl.int64) * tiles_k + tk, mask=row_ok, other=1.0)
                tl.store(S + rows.to(tl.int64) * tiles_k + tk, s_row, mask=row_ok)
                r_row, exact = _pow2_reciprocal(s_row)
                if tl.min(exact.to(tl.int32), 0) == 1:
                    q = _to_fp8(x * r_row[:, None], dtype)
                else:
                    q = _to_fp8(tl.div_rn(x, s_row[:, None]), dtype)
            else:
                s_row, r_row = _scale_bits(tl.max(bits, 1), MAX_EXP)
                tl.store(S + rows.to(tl.int64) * tiles_k + tk, s_row, mask=row_ok)
                q = _to_fp8(x * r_row[:, None], dtype)
        else:
            if GIVEN:
                s_blk = tl.load(SCALE_IN + tm * tiles_k + tk)
                tl.store(S + tm * tiles_k + tk, s_blk)
                r_blk, exact_blk = _pow2_reciprocal(s_blk)
                if exact_blk:
                    q = _to_fp8(x * r_blk, dtype)
                else:
                    q = _to_fp8(tl.div_rn(x, s_blk), dtype)
            else:
                s_blk, r_blk = _scale_bits(tl.max(tl.max(bits, 1), 0), MAX_EXP)
                tl.store(S + tm * tiles_k + tk, s_blk)
            if TRANSPOSE:
                tl.store(ST + tk * tiles_m + tm, s_blk)
            if not GIVEN:
                q = _to_fp8(x * r_blk, dtype)
        tl.store(Q + rows.to(tl.int64)[:, None] * K + cols[None, :], q, mask=mask)
        if TRANSPOSE:
            # qᵀ [K, M]: the tile's columns are its rows
            if GRAN == 1:  # 1x128 tiles of xᵀ: the column maxima, scales of xᵀ's row ``col`` at column block tm
                s_col, r_col = _scale_bits(tl.max(bits, 0), MAX_EXP)
                tl.store(ST + cols.to(tl.int64) * tiles_m + tm, s_col, mask=col_ok)
                qt = _to_fp8(x * r_col[None, :], dtype)
            else:  # one scale for the tile: xᵀ's tile is q's transposed
                qt = q
            tl.store(
                QT + cols.to(tl.int64)[:, None] * M + rows[None, :],
                tl.trans(qt),
                mask=col_ok[:, None] & row_ok[None, :],
            )


__all__ = ["fp8_amax_kernel", "fp8_quant_kernel", "triton"]
