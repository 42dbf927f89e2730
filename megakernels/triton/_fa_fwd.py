"""The FlashAttention-2 forward kernel (launched by megakernels.triton.flash_attention).

One program per BLOCK_M queries of one (batch, head): stream the keys in BLOCK_N blocks, keeping a running row
maximum ``m``, normaliser ``l`` and un-normalised output ``acc`` in fp32 (online softmax); the ``[sq, sk]`` score
matrix never exists. The lse ``(m + log2 l) * ln 2`` is stored for the backward. With attention sinks (``SINK``:
one fp32 logit per query head) the sink joins the softmax after the last key block, as one more term of ``m`` and
``l`` whose value is zero: its rescale of ``acc`` folds into the final ``1 / l``, so the loops are those without it.
V, and so ``acc`` and O, have a head dim of their own (``HEAD_DIM_V`` padded to ``BLOCK_DV``; multi-head latent
attention's 192 / 128), the same as q/k's for ordinary attention.

Design (why; the static cost model beside the package has the model it is judged by):
- Tiles come through TMA tensor descriptors where the Triton and the tensors allow it (``TMA``: a 4-D descriptor
  over ``[b, s, h, d]``, out-of-range rows and head-dim columns zero-filled by the hardware), so the loads cost one
  instruction per tile instead of an address and a cp.async per 16 bytes, and the pipeliner's stages are
  mbarrier-synchronised; otherwise pointer loads with masks. The query tile comes through a 2-D descriptor over
  ``[b * s, h * d]`` where the layout allows (``Q_ROWS``: batches packed, heads adjacent, d a power of two): a
  loaded 4-D tile must be reshaped, and Triton then keeps Q as wgmma's A operand in registers (32 per thread at
  128 x 128 over 8 warps), which keeps a 128-row, 8-warp CTA from sharing its SM with a second one. The query
  rows past SQ of the last block read the next batch's rows; only their own output rows see them, and those are
  not stored (O's 4-D descriptor clips them).
- Scores stay in raw units; the scale is folded with log2(e) into the exponent: ``p = exp2(s * qk_scale - m)``
  is one FFMA and one MUFU.EX2 per score.
- Key blocks that every row of the query block sees entirely (all of them without causality, those left of the
  diagonal band with it) take a loop with no masks; only the diagonal band and the last partial block pay.
- Causal grids run heaviest first across all heads: the grid is ``(b * h, query blocks)``, so the block scheduler
  (x fastest) hands out the last query block (the one that sees the most keys) of every head before the
  second-to-last of any, and the short blocks fill the tail of the grid instead of the long ones.
- One loop: the key bounds of the block come from ``key_bounds`` (the band rule, _common.py) and one
  ``_fwd_step`` call in a static loop over the three ranges (masked edge, unmasked middle, masked edge) serves
  every variant; the step takes its runtime values in groups (``kv``, ``band``, ``drop``: Triton tuples) and its
  switches as constexpr keywords.
- No warp specialisation: Triton's automatic one (``tl.range(..., warp_specialize=True)`` on the unmasked loop:
  producer warps load, consumer warpgroups compute) was tried; Triton 3.8's Hopper pass (NVGPUWarpSpecialization)
  fails on this kernel at 4 warps and leaves it unchanged at 8 (no ``ttg.warp_specialize`` in the TTGIR), and a
  hand-pipelined loop (QK^T of the next block issued before the softmax of this one) gets a wait after every
  wgmma from Triton's pipeliner, no overlap. Overlap comes from a second resident CTA: the d128 default (128 x 32,
  8 warps, Q in shared memory) takes 114 registers and 96 KiB, so two CTAs share an SM and one's softmax runs
  under the other's wgmma.
"""

from __future__ import annotations

import triton
import triton.language as tl

from megakernels.triton._common import band_diag, dropout_keep, dropout_row_hash, in_band, key_bounds


@triton.jit
def _load_kv(
    kv,
    start_n,
    offs_n,
    offs_d,
    offs_dv,
    SK,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    MASKED: tl.constexpr,
    TMA: tl.constexpr,
):
    K, V, b, hk, stride_ks, stride_vs = kv
    if TMA:
        k = K.load([b, start_n, hk, 0]).reshape(BLOCK_N, BLOCK_D)
        v = V.load([b, start_n, hk, 0]).reshape(BLOCK_N, BLOCK_DV)
    else:
        k_mask = offs_d[None, :] < HEAD_DIM
        v_mask = offs_dv[None, :] < HEAD_DIM_V
        if MASKED:
            k_mask = k_mask & (offs_n[:, None] < SK)
            v_mask = v_mask & (offs_n[:, None] < SK)
        k = tl.load(K + offs_n[:, None] * stride_ks + offs_d[None, :], mask=k_mask, other=0.0)
        v = tl.load(V + offs_n[:, None] * stride_vs + offs_dv[None, :], mask=v_mask, other=0.0)
    return k, v


@triton.jit
def _fwd_step(
    acc,
    m_i,
    l_i,
    q,
    kv,
    start_n,
    offs_d,
    offs_dv,
    band,
    drop,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    PRECISION: tl.constexpr,
    TMA: tl.constexpr,
    WINDOWED: tl.constexpr,
    DOCS: tl.constexpr,
):
    """One key block of the online softmax. ``kv``: (K, V, batch, k/v head, K's and V's token strides) with K and V
    descriptors under ``TMA``, else pointers at the (batch, head); ``band``: (query rows, SQ, SK, the window's
    shift, the window, the rows' document key spans lo and hi); ``drop``: (the rows' dropout hashes, the keep
    threshold)."""
    offs_m, SQ, SK, SHIFT, window, doc_lo, doc_hi = band
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k, v = _load_kv(
        kv, start_n, offs_n, offs_d, offs_dv, SK, HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, MASKED, TMA
    )
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if MASKED:
        valid = offs_n[None, :] < SK
        diag = band_diag(SQ, SK, SHIFT, WINDOWED)
        if WINDOWED:
            valid = valid & in_band(offs_m[:, None], offs_n[None, :], diag, window, CAUSAL)
        elif CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None] + diag)
        if DOCS:  # the row's document: keys [doc_lo, doc_hi)
            valid = valid & (offs_n[None, :] >= doc_lo[:, None]) & (offs_n[None, :] < doc_hi[:, None])
        s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
    p = tl.math.exp2(s * qk_scale - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DROPOUT:
        row_hash, threshold = drop
        p = tl.where(dropout_keep(row_hash[:, None], offs_n[None, :], threshold), p, 0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def fa_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    SEED,
    DOC_SPANS,
    SINKS,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_os,
    stride_oh,
    H,
    GROUP,
    SQ,
    SK,
    qk_scale,
    threshold,
    keep_scale,
    WINDOW,
    SHIFT,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    PRECISION: tl.constexpr,
    TMA: tl.constexpr,
    Q_ROWS: tl.constexpr,
    WINDOWED: tl.constexpr,
    DOCS: tl.constexpr,
    SINK: tl.constexpr = False,
    HEAD_DIM_V: tl.constexpr = 0,
    BLOCK_DV: tl.constexpr = 0,
):
    if CAUSAL:  # grid (b * h, query blocks): the heaviest query block of every head first, the lightest last
        bh = tl.program_id(0)
        pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    else:  # grid (query blocks, b * h): the blocks of one head side by side share its keys in L2
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_mask = (offs_m[:, None] < SQ) & (offs_d[None, :] < HEAD_DIM)
    if TMA:
        if Q_ROWS:  # a 2-D descriptor over [b * s, h * d]: the tile lands in shared memory as wgmma's A operand
            q = Q.load([b * SQ + pid_m * BLOCK_M, h * HEAD_DIM])
        else:
            q = Q.load([b, pid_m * BLOCK_M, h, 0]).reshape(BLOCK_M, BLOCK_D)
    else:
        q = tl.load(
            Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
            mask=q_mask,
            other=0.0,
        )
        K += b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
        V += b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh

    row_hash = offs_m.to(tl.uint32)
    if DROPOUT:
        seed = tl.load(SEED)
        row_hash = dropout_row_hash(
            (seed & 0xFFFFFFFF).to(tl.uint32), ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32), bh * SQ + offs_m
        )

    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)  # the loops carry (acc, m_i, l_i) in this order
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    spans = DOC_SPANS + b.to(tl.int64) * SQ * 2  # the rows' document key spans (DOCS only)
    # Key blocks [lo, full_lo) and [full_hi, hi) meet the band's edges (masks), [full_lo, full_hi) lie inside every
    # row's band and SK (no masks); blocks outside the band are never visited. Without a window or documents
    # lo = full_lo = 0 and the first loop does not exist.
    bounds = key_bounds(pid_m, SQ, SK, SHIFT, WINDOW, spans, BLOCK_M, BLOCK_N, CAUSAL, WINDOWED, DOCS)
    doc_lo = offs_m
    doc_hi = offs_m
    if DOCS:
        doc_lo = tl.load(spans + offs_m * 2, mask=offs_m < SQ, other=0)
        doc_hi = tl.load(spans + offs_m * 2 + 1, mask=offs_m < SQ, other=0)
    kv = (K, V, b, hk, stride_ks, stride_vs)
    band = (offs_m, SQ, SK, SHIFT, WINDOW, doc_lo, doc_hi)
    drop = (row_hash, threshold)
    for phase in tl.static_range(3):
        if phase > 0 or WINDOWED or DOCS:
            for start_n in range(bounds[phase], bounds[phase + 1], BLOCK_N):
                acc, m_i, l_i = _fwd_step(
                    acc,
                    m_i,
                    l_i,
                    q,
                    kv,
                    start_n,
                    offs_d,
                    offs_dv,
                    band,
                    drop,
                    qk_scale,
                    HEAD_DIM=HEAD_DIM,
                    HEAD_DIM_V=HEAD_DIM_V,
                    BLOCK_N=BLOCK_N,
                    BLOCK_D=BLOCK_D,
                    BLOCK_DV=BLOCK_DV,
                    MASKED=phase != 1,
                    CAUSAL=CAUSAL,
                    DROPOUT=DROPOUT,
                    PRECISION=PRECISION,
                    TMA=TMA,
                    WINDOWED=WINDOWED,
                    DOCS=DOCS,
                )
    if SINK:  # the sink column: logit SINKS[h] (in base 2 like m_i), value zero
        sink = tl.load(SINKS + h) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a -inf sink and no key: as without a sink
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.math.exp2(sink - m_safe)
        m_i = m_new
        keep_scale = keep_scale * alpha  # acc's rescale, folded into 1 / l
    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, keep_scale / tl.where(empty, 1.0, l_i))
    out = (acc * inv_l[:, None]).to(O.dtype.element_ty if not TMA else O.dtype)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    if TMA:
        O.store([b, pid_m * BLOCK_M, h, 0], out.reshape(1, BLOCK_M, 1, BLOCK_DV))
    else:
        tl.store(
            O
            + b.to(tl.int64) * stride_ob
            + h.to(tl.int64) * stride_oh
            + offs_m[:, None] * stride_os
            + offs_dv[None, :],
            out,
            mask=(offs_m[:, None] < SQ) & (offs_dv[None, :] < HEAD_DIM_V),
        )
    tl.store(LSE + bh.to(tl.int64) * SQ + offs_m, lse, mask=offs_m < SQ)


def supports_tma() -> bool:
    """Whether this Triton has host-side tensor descriptors (triton.tools.tensor_descriptor)."""
    import importlib.util

    return importlib.util.find_spec("triton.tools.tensor_descriptor") is not None


__all__ = ["fa_fwd_kernel", "supports_tma", "triton"]
