"""FlashAttention-2 in Triton: forward and backward kernels and their launchers.

Forward (one program per BLOCK_M queries of one (batch, head)): stream the keys in BLOCK_N blocks, keeping a
running row maximum ``m``, normaliser ``l`` and un-normalised output ``acc`` in fp32 (online softmax); the
``[sq, sk]`` score matrix never exists. Scores are kept in log2 units (``qk_scale = scale * log2(e)``) so that the
exponential is one ``exp2``. The log-sum-exp ``lse = (m + log2 l) * ln 2`` is stored for the backward. Blocks
that every row sees entirely (all of them without causality, those below the diagonal band with it) take a loop
with no masking; only the last partial block and the diagonal band pay for the masks.

Backward recomputes ``P = exp(S - lse)`` from the saved lse in two atomics-free passes:

- dk/dv: one program per BLOCK_N keys of one *k/v* head loops over the query blocks of every query head of its
  group (GQA/MQA sum there, without atomics): ``dv += P^T dO``, ``dS = P * (dO V^T - delta)``, ``dk += dS^T Q``.
- dq: one program per BLOCK_M queries loops over the keys: ``dq += dS K``,

with ``delta = rowsum(dO * O)`` computed once. Causal masking is bottom-right aligned (query i sees key j iff
``j <= i + sk - sq``, flash-attn's convention); a query that sees no key gets output 0 and lse ``-inf``.

Dropout keeps element (row, col) iff a counter hash of (seed, row, col) clears the threshold (_common.py), so the
backward regenerates the forward's mask exactly and the CPU path reproduces it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megakernels.triton._common import (arch_of, dropout_keep, dropout_row_hash, dropout_threshold, pick_config,
                                        seq_bucket)
from megakernels.triton.launch import Launch

LOG2E = 1.4426950408889634

# Candidate (BLOCK_M, BLOCK_N, num_warps, num_stages) per architecture and padded head dim; the first is the
# default. Every candidate is compiled for its architecture in tests/triton/test_compile.py (shared memory must
# fit: 227 KiB on sm_90, 163 KiB on sm_80).
FWD_CONFIGS = {
    90: {32: [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4)],
         64: [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4)],
         128: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3)],
         256: [(64, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2)]},
    80: {32: [(128, 64, 4, 3), (64, 64, 4, 4)],
         64: [(128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 4)],
         128: [(128, 64, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3)],
         256: [(64, 32, 4, 2), (64, 64, 8, 1)]},
}
# Backward: (BLOCK_M, BLOCK_N, num_warps, num_stages), shared by the dk/dv and dq kernels.
BWD_CONFIGS = {
    90: {32: [(64, 128, 8, 2), (64, 64, 4, 3)],
         64: [(64, 128, 8, 2), (64, 64, 4, 3), (32, 128, 4, 3)],
         128: [(64, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 3)],
         256: [(32, 64, 4, 1), (32, 32, 4, 2)]},
    80: {32: [(64, 128, 8, 2), (64, 64, 4, 3)],
         64: [(64, 64, 4, 2), (64, 128, 8, 1), (32, 64, 4, 3)],
         128: [(64, 64, 8, 1), (32, 64, 4, 2), (32, 32, 4, 2)],
         256: [(32, 32, 4, 1), (16, 32, 4, 1)]},
}
INTERPRETER_CONFIG = (32, 32, 4, 1)  # small blocks: many partial-block edges in the tests, fast under numpy


def padded_head_dim(d: int) -> int:
    return max(32, triton.next_power_of_2(d))


def candidates(table: dict, arch: int, head_dim: int) -> list[tuple]:
    """Configs for ``arch`` (newest table at or below it) and head dim (padded to its power of two)."""
    if arch == 0:
        return [INTERPRETER_CONFIG]
    known = sorted(a for a in table if a <= arch) or [min(table)]
    return table[known[-1]][padded_head_dim(head_dim)]


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


# ----------------------------------------------------------------------------------------------------------------
# Forward


@triton.jit
def _fwd_block(acc, m_i, l_i, q, K, V, offs_m, offs_d, start, stop, SQ, SK, stride_ks, stride_vs, qk_scale,
               row_hash, threshold,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               DROPOUT: tl.constexpr, PRECISION: tl.constexpr):
    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = offs_d[None, :] < HEAD_DIM
        if MASKED:
            kv_mask = kv_mask & (offs_n[:, None] < SK)
        k = tl.load(K + offs_n[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + offs_n[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if MASKED:
            valid = offs_n[None, :] < SK
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None] + (SK - SQ))
            s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            p = tl.where(dropout_keep(row_hash[:, None], offs_n[None, :], threshold), p, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, SEED,
                stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
                H, GROUP, SQ, SK, qk_scale, threshold, keep_scale,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hk = (h // GROUP).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = (offs_m[:, None] < SQ) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + b * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                mask=q_mask, other=0.0)
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh

    row_hash = offs_m.to(tl.uint32)
    if DROPOUT:
        seed = tl.load(SEED)
        row_hash = dropout_row_hash((seed & 0xFFFFFFFF).to(tl.uint32), ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32),
                                    bh * SQ + offs_m)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys [0, full) are visible to every row of this block and lie inside SK: no masks there.
    if CAUSAL:
        hi = tl.minimum(SK, tl.maximum((pid_m + 1) * BLOCK_M + SK - SQ, 0))
        full = tl.minimum(tl.maximum(pid_m * BLOCK_M + SK - SQ + 1, 0), SK) // BLOCK_N * BLOCK_N
    else:
        hi = SK
        full = SK // BLOCK_N * BLOCK_N
    acc, m_i, l_i = _fwd_block(acc, m_i, l_i, q, K, V, offs_m, offs_d, 0, full, SQ, SK, stride_ks, stride_vs,
                               qk_scale, row_hash, threshold, HEAD_DIM, BLOCK_N, False, CAUSAL, DROPOUT, PRECISION)
    acc, m_i, l_i = _fwd_block(acc, m_i, l_i, q, K, V, offs_m, offs_d, full, hi, SQ, SK, stride_ks, stride_vs,
                               qk_scale, row_hash, threshold, HEAD_DIM, BLOCK_N, True, CAUSAL, DROPOUT, PRECISION)
    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, keep_scale / tl.where(empty, 1.0, l_i))
    out = acc * inv_l[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    tl.store(O + b * stride_ob + h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=q_mask)
    tl.store(LSE + bh.to(tl.int64) * SQ + offs_m, lse, mask=offs_m < SQ)


# ----------------------------------------------------------------------------------------------------------------
# Backward


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, SEED,
                     stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                     stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
                     stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
                     H, HK, GROUP, SQ, SK, qk_scale, scale, threshold, keep_scale,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = (bhk // HK).to(tl.int64)
    hk = (bhk % HK).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n[:, None] < SK) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :], mask=kv_mask,
                other=0.0)
    v = tl.load(V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :], mask=kv_mask,
                other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    if CAUSAL:  # the first query that sees key pid_n * BLOCK_N is pid_n * BLOCK_N - (SK - SQ)
        lo = tl.maximum(pid_n * BLOCK_N + SQ - SK, 0) // BLOCK_M * BLOCK_M
    else:
        lo = 0
    seed_lo = tl.full([], 0, tl.uint32)
    seed_hi = tl.full([], 0, tl.uint32)
    if DROPOUT:
        seed = tl.load(SEED)
        seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
        seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        bh = b * H + h
        Qh = Q + b * stride_qb + h * stride_qh
        DOh = DO + b * stride_dob + h * stride_doh
        for start_m in range(lo, SQ, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q_mask = (offs_m[:, None] < SQ) & (offs_d[None, :] < HEAD_DIM)
            q = tl.load(Qh + offs_m[:, None] * stride_qs + offs_d[None, :], mask=q_mask, other=0.0)
            do = tl.load(DOh + offs_m[:, None] * stride_dos + offs_d[None, :], mask=q_mask, other=0.0)
            lse = tl.load(LSE + bh * SQ + offs_m, mask=offs_m < SQ, other=float("inf")) * 1.4426950408889634
            lse = tl.where(lse == float("-inf"), float("inf"), lse)  # rows that saw no key: P = 0
            delta = tl.load(DELTA + bh * SQ + offs_m, mask=offs_m < SQ, other=0.0)
            # Transposed scores [BLOCK_N, BLOCK_M] so that dk, dv accumulate without transposing them.
            s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale
            valid = (offs_n[:, None] < SK) & (offs_m[None, :] < SQ)
            if CAUSAL:
                valid = valid & (offs_n[:, None] <= offs_m[None, :] + (SK - SQ))
            p_t = tl.where(valid, tl.math.exp2(s_t - lse[None, :]), 0.0)
            dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            if DROPOUT:
                keep = dropout_keep(dropout_row_hash(seed_lo, seed_hi, (bh * SQ + offs_m).to(tl.int32))[None, :],
                                    offs_n[:, None], threshold)
                dv += tl.dot(tl.where(keep, p_t * keep_scale, 0.0).to(do.dtype), do, input_precision=PRECISION)
                dp_t = tl.where(keep, dp_t * keep_scale, 0.0)
            else:
                dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
    dk *= scale
    tl.store(DK + b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b * stride_dvb + hk * stride_dvh + offs_n[:, None] * stride_dvs + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, SEED,
                   stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                   stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
                   stride_dqb, stride_dqs, stride_dqh,
                   H, GROUP, SQ, SK, qk_scale, scale, threshold, keep_scale,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = (offs_m[:, None] < SQ) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :], mask=q_mask,
                other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_d[None, :],
                 mask=q_mask, other=0.0)
    lse = tl.load(LSE + bh.to(tl.int64) * SQ + offs_m, mask=offs_m < SQ, other=float("inf")) * 1.4426950408889634
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    delta = tl.load(DELTA + bh.to(tl.int64) * SQ + offs_m, mask=offs_m < SQ, other=0.0)
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh
    row_hash = offs_m.to(tl.uint32)
    if DROPOUT:
        seed = tl.load(SEED)
        row_hash = dropout_row_hash((seed & 0xFFFFFFFF).to(tl.uint32), ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32),
                                    bh * SQ + offs_m)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if CAUSAL:
        hi = tl.minimum(SK, tl.maximum((pid_m + 1) * BLOCK_M + SK - SQ, 0))
    else:
        hi = SK
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < SK) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(K + offs_n[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + offs_n[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        valid = offs_n[None, :] < SK
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None] + (SK - SQ))
        p = tl.where(valid, tl.math.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        if DROPOUT:
            dp = tl.where(dropout_keep(row_hash[:, None], offs_n[None, :], threshold), dp * keep_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    dq *= scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=q_mask)


# ----------------------------------------------------------------------------------------------------------------
# Launchers (tensors already validated by megakernels.ops.attention; last dim contiguous)


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _dropout_args(dropout_p: float) -> tuple[bool, int, float]:
    return dropout_p > 0.0, dropout_threshold(dropout_p), 1.0 / (1.0 - dropout_p)


def forward_launch(q, k, v, out, lse, seed, causal: bool, scale: float, dropout_p: float, cfg) -> Launch:
    """The forward kernel's launch for config ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    dropout, threshold, keep_scale = _dropout_args(dropout_p)
    block_m, block_n, warps, stages = cfg
    return Launch(_fwd_kernel, (triton.cdiv(sq, block_m), b * h),
                  (q, k, v, out, lse, seed, *_strides(q), *_strides(k), *_strides(v), *_strides(out),
                   h, h // hk, sq, sk, scale * LOG2E, threshold, keep_scale),
                  dict(HEAD_DIM=d, BLOCK_D=padded_head_dim(d), BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
                       DROPOUT=dropout, PRECISION=_dot_precision(q.dtype), num_warps=warps, num_stages=stages))


def forward(q, k, v, causal: bool, scale: float, dropout_p: float, seed: torch.Tensor | None):
    """Returns (out ``[b, sq, h, d]`` in q's dtype, lse ``[b, h, sq]`` fp32)."""
    b, sq, h, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    seed = lse if seed is None else seed  # SEED is read only with dropout; any pointer stands in
    arch = arch_of(q.device)

    def launch(cfg):
        forward_launch(q, k, v, out, lse, seed, causal, scale, dropout_p, cfg)()

    key = ("fwd", arch, d, q.dtype, causal, dropout_p > 0.0, seq_bucket(sq), seq_bucket(k.shape[1]))
    launch(pick_config(key, candidates(FWD_CONFIGS, arch, d), launch))
    return out, lse


def backward_launches(do, q, k, v, lse, delta, dq, dk, dv, seed, causal: bool, scale: float, dropout_p: float,
                      cfg) -> list[Launch]:
    """The backward kernels' launches, in order, for config ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    dropout, threshold, keep_scale = _dropout_args(dropout_p)
    block_m, block_n, warps, stages = cfg
    common = dict(HEAD_DIM=d, BLOCK_D=padded_head_dim(d), CAUSAL=causal, DROPOUT=dropout,
                  PRECISION=_dot_precision(q.dtype), BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
                  num_stages=stages)
    return [
        Launch(_bwd_dkdv_kernel, (triton.cdiv(sk, block_n), b * hk),
               (q, k, v, do, lse, delta, dk, dv, seed, *_strides(q), *_strides(k), *_strides(v), *_strides(do),
                *_strides(dk), *_strides(dv), h, hk, h // hk, sq, sk, scale * LOG2E, scale, threshold, keep_scale),
               dict(common)),
        Launch(_bwd_dq_kernel, (triton.cdiv(sq, block_m), b * h),
               (q, k, v, do, lse, delta, dq, seed, *_strides(q), *_strides(k), *_strides(v), *_strides(do),
                *_strides(dq), h, h // hk, sq, sk, scale * LOG2E, scale, threshold, keep_scale),
               dict(common)),
    ]


def backward(do, q, k, v, out, lse, causal: bool, scale: float, dropout_p: float, seed: torch.Tensor | None):
    """Returns (dq, dk, dv) shaped and typed like q, k, v."""
    b, sq, h, d = q.shape
    do = do if do.stride(-1) == 1 else do.contiguous()
    delta = (do.float() * out.float()).sum(-1).transpose(1, 2).contiguous()  # [b, h, sq]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    seed = lse if seed is None else seed
    arch = arch_of(q.device)

    def launch(cfg):
        for ln in backward_launches(do, q, k, v, lse, delta, dq, dk, dv, seed, causal, scale, dropout_p, cfg):
            ln()

    key = ("bwd", arch, d, q.dtype, causal, dropout_p > 0.0, seq_bucket(sq), seq_bucket(k.shape[1]))
    launch(pick_config(key, candidates(BWD_CONFIGS, arch, d), launch))
    return dq, dk, dv
