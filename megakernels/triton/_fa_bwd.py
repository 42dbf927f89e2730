"""The FlashAttention-2 backward kernels (launched by megakernels.triton.flash_attention).

``P = exp(S - lse)`` is recomputed from the saved lse. ``fa_bwd_delta_kernel`` runs first (one read of dO and O,
instead of a chain of fp32 copies through torch) and writes, per query row, ``scale * rowsum(dO * O)`` and the lse
in base 2 (``-inf``, a row that saw no key, as ``+inf`` so its P is 0): the score loops then compute
``dS = P * (scale * dP - scale * delta)`` with one FFMA and add ``dS K`` and ``dS^T Q`` already scaled, and take the
exponent with one FFMA, instead of scaling dQ, converting the lse and testing it for ``-inf`` in every step.
With attention sinks (``SINK``) the lse includes them, so nothing else changes but this kernel, which also sums
``-exp(sink - lse) * rowsum(dO * O)`` over its rows into one partial sum of the head's ``dsinks`` (the launcher adds
the partials in a fixed order: the same bits every run).

``fa_bwd_kernel``: one program per BLOCK_N keys of one *k/v* head loops over the query blocks of every query head of
its group (GQA/MQA sum there): ``S^T = K Q^T``, ``P^T``, ``dV += P^T dO``, ``dP^T = V dO^T``,
``dS^T = P^T * (dP^T - delta)``, ``dK += dS^T Q`` — and, in the same pass, ``dQ += dS K`` added with fp32 atomics
into a zeroed fp32 buffer (``DQ_ATOMIC``): five matmuls and one exponential per score. With
``deterministic=True`` the launcher leaves dQ out of this kernel and runs ``fa_bwd_dq_kernel`` (one program per
BLOCK_M queries looping over the keys), which recomputes S and dP: seven matmuls and two exponentials, but the
same bits on every run.

``DQ_TMA`` (Hopper, and the interpreter): dQ tiles are added through a tensor descriptor (a TMA reduce: the tile
goes to shared memory in any layout and one thread issues the add), instead of fp32 atomics, which need the tile
converted through shared memory into 16-byte rows and a 64-bit address per vector in registers.

With query blocks under 64 rows (the d128 default on sm_90: 32 queries x 128 keys, 8 warps) dQ is computed
transposed, ``dQ^T = K^T dS^T``: a wgmma's M is 64 rows per warpgroup, so ``dS K`` with 32 rows would fall back
to mma.sync, and Triton would keep K as its register operand (32 registers a thread). 128 keys over two
warpgroups give each its own 64 rows of S^T, dP^T, dK and dV; 64 keys over 8 warps (the previous default) had
both warpgroups compute the same S^T and dP^T (seven matmuls' worth of wgmma per step instead of five).

``DQ_CHUNKS = 2`` (head dim 256 with 64-row query blocks): dS K is computed and added in two column halves of
K, so only half of the 64 x 256 fp32 tile is live at once (the whole tile, with dK, dV, K and V, spilled on sm_90).

Query blocks that see every key of the program's block and lie inside SQ take a loop without masks; only the
diagonal band of a causal mask, the query tail and a key block that runs past SK pay for them. The scale is folded
with log2(e) into the exponent (one FFMA).
"""

from __future__ import annotations

import triton
import triton.language as tl

from megakernels.triton._common import (
    band_diag,
    dropout_keep,
    dropout_row_hash,
    in_band,
    key_bounds,
    query_bounds,
)


@triton.jit
def fa_bwd_delta_kernel(
    O,
    DO,
    LSE,
    DELTA,
    LSE2,
    SINKS,
    DSINKS,
    stride_ob,
    stride_os,
    stride_oh,
    stride_dob,
    stride_dos,
    stride_doh,
    H,
    SQ,
    scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SINK: tl.constexpr = False,
):
    # O and dO: HEAD_DIM and BLOCK_D are v's head dim here
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < SQ) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(
        O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :], mask=mask, other=0.0
    ).to(tl.float32)
    do = tl.load(
        DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_d[None, :], mask=mask, other=0.0
    ).to(tl.float32)
    rows = bh.to(tl.int64) * SQ + offs_m
    delta = tl.sum(o * do, 1)
    tl.store(DELTA + rows, delta * scale, mask=offs_m < SQ)
    lse = tl.load(LSE + rows, mask=offs_m < SQ, other=0.0)
    tl.store(LSE2 + rows, tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634), mask=offs_m < SQ)
    if SINK:  # this block's share of dsinks[h]: -sum P_sink * delta (rows past SQ have delta 0)
        p_sink = tl.where(lse == float("-inf"), 0.0, tl.exp(tl.load(SINKS + h) - lse))
        tl.store(DSINKS + bh.to(tl.int64) * tl.num_programs(0) + pid_m, -tl.sum(p_sink * delta, 0))


@triton.jit
def _bwd_step(
    dk,
    dv,
    k,
    v,
    qdo,
    dqt,
    rows,
    start_m,
    offs_n,
    offs_d,
    offs_dv,
    band,
    drop,
    qk_scale,
    scale,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    PRECISION: tl.constexpr,
    DQ_ATOMIC: tl.constexpr,
    DQ_TMA: tl.constexpr,
    WINDOWED: tl.constexpr,
    DOCS: tl.constexpr,
    DQ_CHUNKS: tl.constexpr,
):
    """One query block against the program's keys. ``qdo``: (q and dO pointers at the (batch, head), their token
    strides); ``dqt``: (dQ's descriptor or pointer at the (batch, head), its token stride, the 32-bit batch and
    head of the descriptor's coordinates); ``rows``: (the base-2 lse, the scaled delta, the flat (batch, head));
    ``band``: (SQ, SK, the window's shift, the window, the keys' document query spans lo and hi); ``drop``: (the
    seed's low and high halves, the keep threshold, 1 / (1 - p))."""
    Qh, DOh, stride_qs, stride_dos = qdo
    DQh, stride_dqs, b, h = dqt
    LSE2, DELTA, bh = rows
    SQ, SK, SHIFT, window, doc_lo, doc_hi = band
    offs_m = start_m + tl.arange(0, BLOCK_M)
    if MASKED:
        q_mask = (offs_m[:, None] < SQ) & (offs_d[None, :] < HEAD_DIM)
        do_mask = (offs_m[:, None] < SQ) & (offs_dv[None, :] < HEAD_DIM_V)
        q = tl.load(Qh + offs_m[:, None] * stride_qs + offs_d[None, :], mask=q_mask, other=0.0)
        do = tl.load(DOh + offs_m[:, None] * stride_dos + offs_dv[None, :], mask=do_mask, other=0.0)
        lse2 = tl.load(LSE2 + bh * SQ + offs_m, mask=offs_m < SQ, other=float("inf"))
        delta = tl.load(DELTA + bh * SQ + offs_m, mask=offs_m < SQ, other=0.0)
    else:
        d_mask = offs_d[None, :] < HEAD_DIM
        dv_mask = offs_dv[None, :] < HEAD_DIM_V
        q = tl.load(Qh + offs_m[:, None] * stride_qs + offs_d[None, :], mask=d_mask, other=0.0)
        do = tl.load(DOh + offs_m[:, None] * stride_dos + offs_dv[None, :], mask=dv_mask, other=0.0)
        lse2 = tl.load(LSE2 + bh * SQ + offs_m)
        delta = tl.load(DELTA + bh * SQ + offs_m)
    # Transposed scores [BLOCK_N, BLOCK_M], so dk and dv accumulate without transposing them.
    s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)
    p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])
    if MASKED:
        valid = (offs_n[:, None] < SK) & (offs_m[None, :] < SQ)
        diag = band_diag(SQ, SK, SHIFT, WINDOWED)
        if WINDOWED:
            valid = valid & in_band(offs_m[None, :], offs_n[:, None], diag, window, CAUSAL)
        elif CAUSAL:
            valid = valid & (offs_n[:, None] <= offs_m[None, :] + diag)
        if DOCS:  # the key's document: queries [doc_lo, doc_hi)
            valid = valid & (offs_m[None, :] >= doc_lo[:, None]) & (offs_m[None, :] < doc_hi[:, None])
        p_t = tl.where(valid, p_t, 0.0)
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    if DROPOUT:
        seed_lo, seed_hi, threshold, keep_scale = drop
        keep = dropout_keep(
            dropout_row_hash(seed_lo, seed_hi, (bh * SQ + offs_m).to(tl.int32))[None, :], offs_n[:, None], threshold
        )
        dv += tl.dot(tl.where(keep, p_t * keep_scale, 0.0).to(do.dtype), do, input_precision=PRECISION)
        dp_t = tl.where(keep, dp_t * keep_scale, 0.0)
    else:
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
    ds_t = p_t * (dp_t * scale - delta[None, :])  # delta is scaled already: dS carries the softmax scale
    dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
    if DQ_ATOMIC:
        if BLOCK_M < 64:  # a wgmma's M is 64 rows a warpgroup: dQ^T = K^T dS^T has BLOCK_D of them, dS K too few
            dq_t = tl.dot(tl.trans(k), ds_t.to(k.dtype), input_precision=PRECISION)
            if DQ_TMA:  # rows past SQ and columns past HEAD_DIM fall outside the descriptor: clipped
                DQh.atomic_add([b, start_m, h, 0], tl.trans(dq_t).reshape(1, BLOCK_M, 1, BLOCK_D))
            else:
                dq_ptrs = DQh + offs_m[None, :] * stride_dqs + offs_d[:, None]
                dq_mask = offs_d[:, None] < HEAD_DIM
                if MASKED:
                    dq_mask = dq_mask & (offs_m[None, :] < SQ)
                tl.atomic_add(dq_ptrs, dq_t, mask=dq_mask, sem="relaxed")
        elif DQ_CHUNKS == 2:
            # d256: dS K in two column halves, each added before the next is computed (a 64 x 256 fp32 tile is 64
            # registers a thread at 8 warps: with dK, dV, K and V it spilled; a half is 32)
            ds = tl.trans(ds_t.to(k.dtype))
            k0, k1 = tl.split(tl.permute(tl.reshape(k, [k.shape[0], 2, BLOCK_D // 2]), [0, 2, 1]))
            for c in tl.static_range(2):
                kc = k0 if c == 0 else k1
                dqc = tl.dot(ds, kc, input_precision=PRECISION)
                col0 = c * (BLOCK_D // 2)
                _add_dq(
                    DQh,
                    dqc,
                    b,
                    h,
                    start_m,
                    offs_m,
                    col0,
                    SQ,
                    stride_dqs,
                    HEAD_DIM,
                    BLOCK_M,
                    BLOCK_D // 2,
                    MASKED,
                    DQ_TMA,
                )
        else:
            dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k, input_precision=PRECISION)
            _add_dq(DQh, dq, b, h, start_m, offs_m, 0, SQ, stride_dqs, HEAD_DIM, BLOCK_M, BLOCK_D, MASKED, DQ_TMA)
    return dk, dv


@triton.jit
def _add_dq(
    DQh,
    dq,
    b,
    h,
    start_m,
    offs_m,
    col0,
    SQ,
    stride_dqs,
    HEAD_DIM,
    BLOCK_M: tl.constexpr,
    COLS: tl.constexpr,
    MASKED: tl.constexpr,
    DQ_TMA: tl.constexpr,
):
    """Adds a [BLOCK_M, COLS] dQ tile at column ``col0``: through the descriptor (its block is COLS wide) or with
    fp32 atomics (columns past HEAD_DIM and, masked, rows past SQ left out)."""
    if DQ_TMA:
        DQh.atomic_add([b, start_m, h, col0], dq.reshape(1, BLOCK_M, 1, COLS))
    else:
        offs_c = col0 + tl.arange(0, COLS)
        dq_mask = offs_c[None, :] < HEAD_DIM
        if MASKED:
            dq_mask = dq_mask & (offs_m[:, None] < SQ)
        tl.atomic_add(DQh + offs_m[:, None] * stride_dqs + offs_c[None, :], dq, mask=dq_mask, sem="relaxed")


@triton.jit
def fa_bwd_kernel(
    Q,
    K,
    V,
    DO,
    LSE2,
    DELTA,
    DK,
    DV,
    DQ,
    SEED,
    DOC_SPANS,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_dob,
    stride_dos,
    stride_doh,
    stride_dkb,
    stride_dks,
    stride_dkh,
    stride_dvb,
    stride_dvs,
    stride_dvh,
    stride_dqb,
    stride_dqs,
    stride_dqh,
    H,
    HK,
    GROUP,
    SQ,
    SK,
    qk_scale,
    scale,
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
    DQ_ATOMIC: tl.constexpr,
    DQ_TMA: tl.constexpr,
    WINDOWED: tl.constexpr,
    DOCS: tl.constexpr,
    DQ_CHUNKS: tl.constexpr = 1,
    HEAD_DIM_V: tl.constexpr = 0,
    BLOCK_DV: tl.constexpr = 0,
):
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = (bhk // HK).to(tl.int64)
    hk = (bhk % HK).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    kv_mask = (offs_n[:, None] < SK) & (offs_d[None, :] < HEAD_DIM)
    v_mask = (offs_n[:, None] < SK) & (offs_dv[None, :] < HEAD_DIM_V)
    k = tl.load(
        K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0
    )
    v = tl.load(
        V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vs + offs_dv[None, :], mask=v_mask, other=0.0
    )
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    # Query blocks [lo, mid) and [full_end, hi) meet the band's edges, the query tail or a key block that runs past
    # SK (masks); [mid, full_end) see every key of this block (no masks); blocks outside the band are never visited.
    spans = DOC_SPANS + b * SK * 2  # the keys' document query spans (DOCS only)
    bounds = query_bounds(pid_n, SQ, SK, SHIFT, WINDOW, spans, BLOCK_M, BLOCK_N, CAUSAL, WINDOWED, DOCS)
    doc_lo = offs_n
    doc_hi = offs_n
    if DOCS:
        doc_lo = tl.load(spans + offs_n * 2, mask=offs_n < SK, other=0)
        doc_hi = tl.load(spans + offs_n * 2 + 1, mask=offs_n < SK, other=0)
    seed_lo = tl.full([], 0, tl.uint32)
    seed_hi = tl.full([], 0, tl.uint32)
    if DROPOUT:
        seed = tl.load(SEED)
        seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
        seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    band = (SQ, SK, SHIFT, WINDOW, doc_lo, doc_hi)
    drop = (seed_lo, seed_hi, threshold, keep_scale)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        bh = b * H + h
        b32 = b.to(tl.int32)  # descriptor coordinates are 32-bit
        h32 = h.to(tl.int32)
        if DQ_TMA:  # a 4-D descriptor over the fp32 dQ buffer, indexed by (b, row, h, 0)
            DQh = DQ
        else:
            DQh = DQ + b * stride_dqb + h * stride_dqh
        qdo = (Q + b * stride_qb + h * stride_qh, DO + b * stride_dob + h * stride_doh, stride_qs, stride_dos)
        dqt = (DQh, stride_dqs, b32, h32)
        for phase in tl.static_range(3):
            start = bounds[phase]
            if phase == 2:
                start = tl.maximum(bounds[2], bounds[1])
            for start_m in range(start, bounds[phase + 1], BLOCK_M):
                dk, dv = _bwd_step(
                    dk,
                    dv,
                    k,
                    v,
                    qdo,
                    dqt,
                    (LSE2, DELTA, bh),
                    start_m,
                    offs_n,
                    offs_d,
                    offs_dv,
                    band,
                    drop,
                    qk_scale,
                    scale,
                    HEAD_DIM=HEAD_DIM,
                    HEAD_DIM_V=HEAD_DIM_V,
                    BLOCK_M=BLOCK_M,
                    BLOCK_D=BLOCK_D,
                    MASKED=phase != 1,
                    CAUSAL=CAUSAL,
                    DROPOUT=DROPOUT,
                    PRECISION=PRECISION,
                    DQ_ATOMIC=DQ_ATOMIC,
                    DQ_TMA=DQ_TMA,
                    WINDOWED=WINDOWED,
                    DOCS=DOCS,
                    DQ_CHUNKS=DQ_CHUNKS,
                )
    tl.store(
        DK + b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :],
        dk.to(DK.dtype.element_ty),
        mask=kv_mask,
    )
    tl.store(
        DV + b * stride_dvb + hk * stride_dvh + offs_n[:, None] * stride_dvs + offs_dv[None, :],
        dv.to(DV.dtype.element_ty),
        mask=v_mask,
    )


@triton.jit
def fa_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE2,
    DELTA,
    DQ,
    SEED,
    DOC_SPANS,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_dob,
    stride_dos,
    stride_doh,
    stride_dqb,
    stride_dqs,
    stride_dqh,
    H,
    GROUP,
    SQ,
    SK,
    qk_scale,
    scale,
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
    WINDOWED: tl.constexpr,
    DOCS: tl.constexpr,
    HEAD_DIM_V: tl.constexpr = 0,
    BLOCK_DV: tl.constexpr = 0,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_mask = (offs_m[:, None] < SQ) & (offs_d[None, :] < HEAD_DIM)
    do_mask = (offs_m[:, None] < SQ) & (offs_dv[None, :] < HEAD_DIM_V)
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :], mask=q_mask, other=0.0
    )
    do = tl.load(
        DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_dv[None, :], mask=do_mask, other=0.0
    )
    lse2 = tl.load(LSE2 + bh.to(tl.int64) * SQ + offs_m, mask=offs_m < SQ, other=float("inf"))
    delta = tl.load(DELTA + bh.to(tl.int64) * SQ + offs_m, mask=offs_m < SQ, other=0.0)
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh
    row_hash = offs_m.to(tl.uint32)
    if DROPOUT:
        seed = tl.load(SEED)
        row_hash = dropout_row_hash(
            (seed & 0xFFFFFFFF).to(tl.uint32), ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32), bh * SQ + offs_m
        )
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # the key blocks that meet the band of some row of this block (the forward's bounds, every block masked)
    spans = DOC_SPANS + b * SQ * 2  # the rows' document key spans (DOCS only)
    lo, _, _, hi = key_bounds(pid_m, SQ, SK, SHIFT, WINDOW, spans, BLOCK_M, BLOCK_N, CAUSAL, WINDOWED, DOCS)
    doc_lo = offs_m
    doc_hi = offs_m
    if DOCS:
        doc_lo = tl.load(spans + offs_m * 2, mask=offs_m < SQ, other=0)
        doc_hi = tl.load(spans + offs_m * 2 + 1, mask=offs_m < SQ, other=0)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < SK) & (offs_d[None, :] < HEAD_DIM)
        v_mask = (offs_n[:, None] < SK) & (offs_dv[None, :] < HEAD_DIM_V)
        k = tl.load(K + offs_n[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + offs_n[:, None] * stride_vs + offs_dv[None, :], mask=v_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        valid = offs_n[None, :] < SK
        diag = band_diag(SQ, SK, SHIFT, WINDOWED)
        if WINDOWED:
            valid = valid & in_band(offs_m[:, None], offs_n[None, :], diag, WINDOW, CAUSAL)
        elif CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None] + diag)
        if DOCS:
            valid = valid & (offs_n[None, :] >= doc_lo[:, None]) & (offs_n[None, :] < doc_hi[:, None])
        p = tl.where(valid, tl.math.exp2(s * qk_scale - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        if DROPOUT:
            dp = tl.where(dropout_keep(row_hash[:, None], offs_n[None, :], threshold), dp * keep_scale, 0.0)
        ds = p * (dp * scale - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(
        DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :],
        dq.to(DQ.dtype.element_ty),
        mask=q_mask,
    )


__all__ = ["fa_bwd_delta_kernel", "fa_bwd_kernel", "fa_bwd_dq_kernel", "triton"]
