"""FlashAttention-2 in Triton: the launchers and configs of the forward (_fa_fwd.py) and backward (_fa_bwd.py)
kernels.

Causal masking is bottom-right aligned (query i sees key j iff ``j <= i + sk - sq``, flash-attn's convention); a
query that sees no key gets output 0 and lse ``-inf``. Dropout keeps element (row, col) iff a counter hash of
(seed, row, col) clears the threshold (_common.py), so the backward regenerates the forward's mask exactly and the
CPU path reproduces it.

Every launch is a ``Launch`` (megakernels.triton.launch) built by ``forward_launch`` / ``backward_launches``, so
compile_check and ``megakernels bench --static`` compile exactly what runs. The tile loops each program of a launch
runs (``SCHEDULES``: ``forward_schedule``, ``backward_schedule``, ``dq_schedule``) come from the band rule's Python
copy (megakernels.ops.attention_band, which the PyTorch path uses too) for the static model; the kernels compute the
same bounds on the device (``key_bounds`` / ``query_bounds`` of _common.py), tests/ops/test_attention_band.py holds
the copies together and tests/triton/test_schedules.py runs the kernels under Triton's interpreter against the
schedules.
"""

from __future__ import annotations

import torch
import triton

from megakernels.ops._attention_out import empty_out
from megakernels.ops.attention_band import key_bounds, query_bounds
from megakernels.triton._common import (
    arch_of,
    dropout_threshold,
    pick_config,
    seq_bucket,
)
from megakernels.triton._fa_bwd import fa_bwd_delta_kernel, fa_bwd_dq_kernel, fa_bwd_kernel
from megakernels.triton._fa_fwd import fa_fwd_kernel, supports_tma
from megakernels.triton.launch import Launch, Schedule

LOG2E = 1.4426950408889634

# Candidate (BLOCK_M, BLOCK_N, num_warps, num_stages[, maxnreg]) per architecture and padded head dim; the first is
# the default, autotuning picks among them on a GPU. The lists are plain data: the configs that do not spill, fit the
# shared memory and (sm_90) run on wgmma, ordered by the static cost model's prediction for that architecture
# (`megakernels bench --static --ops flash_attention` prints every candidate; rerun it after changing a kernel and
# reorder; the static report test holds the sm_90 lists to those rules). The d128 forward's second sm_90
# candidate caps registers at 128 so that 128x64 tiles run two CTAs an SM, halving the shared-memory pressure of
# the default's 128x32 tiles at the price of a wait on every wgmma; it stays second because its document-masked
# variant spills at that cap. The first GPU run's autotuning checks the order.
FWD_CONFIGS = {
    90: {
        32: [(128, 64, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3)],
        64: [(128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 4)],
        128: [(128, 32, 8, 4), (128, 64, 8, 2, 128), (64, 64, 4, 3)],
        256: [(128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2)],
    },
    80: {
        32: [(128, 64, 4, 3), (64, 64, 4, 4)],
        64: [(128, 64, 4, 3), (64, 64, 4, 4), (128, 128, 8, 2)],
        128: [(128, 32, 4, 3), (128, 64, 8, 2), (64, 64, 4, 3)],
        256: [(64, 32, 4, 2), (64, 64, 8, 1)],
    },
}
# Backward: (BLOCK_M query rows per step, BLOCK_N keys per program, num_warps, num_stages). At d256 on sm_90 the
# default adds dS K in two column halves (DQ_CHUNKS) so the 64 x 256 fp32 tile does not spill, but its dK and dV
# products, 32 keys a program, run on mma.sync: a wgmma's M is 64 rows a warpgroup, and 64 keys' fp32 dK and dV of
# 256 columns do not fit one warpgroup's registers. On wgmma it would need the head dim of dK/dV split across
# programs or warp-specialised register budgets (setmaxnreg), which Triton does not expose (the cost model's README
# describes the split, tried). Its 2 stages keep the dropout variant from spilling. A pair (q/k, v) of padded head
# dims keys its own list where the larger dim's configs do not serve it: multi-head latent attention's 192 / 128 on
# sm_90, whose causal backward spilled at d256's 2 stages and does not at 1 (64 x 64 tiles and 4 warps spill more).
# The dropout variants of three defaults still spill a few bytes, kept because the spill-free configs are far slower
# in the model: sm_90 d64 and d128 causal, sm_80 d128; and sm_80's d64 forward with a causal mask (128x32 tiles
# would not spill, a little slower); sm_80's 192 / 128 non-causal backward on d256's default spills 8 bytes (the
# other 64-row configs tried spill more). The compile check of the development tools beside the package reports them.
# On sm_80, configs whose query blocks are under 64 rows (a transposed dQ) compile to 32 registers and kilobytes of
# spills a thread; 64 query rows and 16 keys on 8 warps add dS K in column halves instead and do not spill.
BWD_CONFIGS = {
    90: {
        32: [(64, 64, 4, 2), (64, 128, 8, 2)],
        64: [(64, 128, 8, 2)],
        128: [(32, 128, 8, 2), (64, 64, 8, 3)],
        256: [(64, 32, 8, 2)],
        (256, 128): [(64, 32, 8, 1)],
    },
    80: {
        32: [(64, 128, 8, 1), (64, 128, 8, 2), (64, 64, 4, 3)],
        64: [(32, 64, 4, 3), (32, 128, 8, 2)],
        128: [(64, 64, 8, 1), (64, 32, 8, 2)],
        256: [(64, 16, 8, 1)],
    },
}
# The deterministic backward's dQ kernel (BLOCK_M queries per program, BLOCK_N keys per step, num_warps[,
# num_stages], the backward's stages by default) where it differs from the backward's own config: on sm_90 64 query
# rows keep its dS K on wgmma (32 rows fall back to mma.sync) and 4 warps let two to four programs share an SM. On
# sm_80 the backward's own configs made the d32 dQ kernel spill; these do not (the d128 and d256 picks keep register
# margin for the dropout variants; d32's needs 2 stages); elsewhere the backward's config.
DQ_CONFIGS = {
    90: {32: (64, 64, 4), 64: (64, 64, 4), 128: (64, 64, 4), 256: (64, 32, 4)},
    80: {32: (128, 64, 8, 2), 64: (64, 64, 4), 128: (128, 32, 8), 256: (64, 32, 8)},
}
INTERPRETER_CONFIG = (32, 32, 4, 1)  # small blocks: many partial-block edges in the tests, fast under numpy


def padded_head_dim(d: int) -> int:
    return max(32, triton.next_power_of_2(d))


def _for_arch(table: dict, arch: int):
    """``table``'s entry for the newest architecture at or below ``arch``, or None."""
    known = [a for a in table if a <= arch]
    return table[max(known)] if known else None


def candidates(table: dict, arch: int, head_dim: int, head_dim_v: int | None = None) -> list[tuple]:
    """Configs for ``arch`` (newest table at or below it) and head dim (padded to its power of two); with v's own
    head dim ``head_dim_v``, the pair's entry (both padded) where the table has one, else the larger dim's."""
    if arch == 0:
        return [INTERPRETER_CONFIG]
    entries = _for_arch(table, arch) or table[min(table)]
    dv = head_dim if head_dim_v is None else head_dim_v
    pair = (padded_head_dim(head_dim), padded_head_dim(dv))
    if pair[0] != pair[1] and pair in entries:
        return entries[pair]
    return entries[padded_head_dim(max(head_dim, dv))]


def _launch_arch(t: torch.Tensor) -> int:
    """The target a launch on ``t`` compiles for: its GPU's, 0 under the interpreter, sm_90 for meta tensors (the
    static report)."""
    return arch_of(t.device) if t.device.type != "meta" else 90


def _has_tma(arch: int) -> bool:
    """Whether tensor descriptors are used on ``arch``: Hopper and newer, and the interpreter."""
    return arch == 0 or arch >= 90


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


# ----------------------------------------------------------------------------------------------------------------
# Launchers (tensors already validated by megakernels.ops.attention; last dim contiguous)


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _dropout_args(dropout_p: float) -> tuple[bool, int, float]:
    return dropout_p > 0.0, dropout_threshold(dropout_p), 1.0 / (1.0 - dropout_p)


def tma_eligible(*tensors) -> bool:
    """Whether TMA descriptors can address these ``[b, s, h, d]`` tensors: the Triton has them, every base is
    16-byte aligned and every stride but the last is a multiple of 16 bytes (the hardware's rules)."""
    if not supports_tma():
        return False
    return all(
        t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1])
        for t in tensors
    )


def _descriptor(t, rows: int, block_d: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, rows, 1, block_d])


def _rows_descriptor(t, rows: int):
    """A 2-D descriptor over ``t`` ``[b, s, h, d]`` seen as ``[b * s, h * d]`` (``rows`` x d tiles), or None
    where that view does not exist (batches not packed, heads not adjacent) or a tile would reach into the next
    head (d not a power of two >= 32)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    b, s, h, d = t.shape
    if d != padded_head_dim(d) or t.stride(2) != d or (b > 1 and t.stride(0) != s * t.stride(1)):
        return None
    return TensorDescriptor(t, [b * s, h * d], [t.stride(1), 1], [rows, d])


def forward_launch(
    q,
    k,
    v,
    out,
    lse,
    seed,
    causal: bool,
    scale: float,
    dropout_p: float,
    cfg,
    tma: bool | None = None,
    window: int = 0,
    shift: int = 0,
    ranges: tuple | None = None,
    sinks: torch.Tensor | None = None,
) -> Launch:
    """The forward kernel's launch for config ``(BLOCK_M, BLOCK_N, num_warps, num_stages[, maxnreg])``. ``tma``: load
    through tensor descriptors (default: where ``tma_eligible`` and the target is Hopper or the interpreter).
    ``window`` > 0: sliding-window attention (the ``WINDOWED`` kernel; 0 compiles the kernel without it), with the
    query-key offset ``SK - SQ + shift`` (``shift`` != 0 only with a window: context-parallel chunks).
    ``ranges``: document masking (the ``DOCS`` kernel), ``(q_keys [b, sq, 2], k_queries [b, sk, 2])`` int32 of
    megakernels.ops.attention.document_ranges; the forward reads ``q_keys``. ``sinks``: fp32 ``[h]`` attention
    sinks (the ``SINK`` kernel; None compiles the kernel without them)."""
    b, sq, h, d = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    dropout, threshold, keep_scale = _dropout_args(dropout_p)
    block_m, block_n, warps, stages, *limit = cfg
    if tma is None:
        tma = _has_tma(_launch_arch(q)) and tma_eligible(q, k, v, out)
    bd, bdv = padded_head_dim(d), padded_head_dim(dv)
    q_rows = _rows_descriptor(q, block_m) if tma else None
    qa, ka, va, oa = (
        (
            q_rows if q_rows is not None else _descriptor(q, block_m, bd),
            _descriptor(k, block_n, bd),
            _descriptor(v, block_n, bdv),
            _descriptor(out, block_m, bdv),
        )
        if tma
        else (q, k, v, out)
    )
    blocks = triton.cdiv(sq, block_m)
    return Launch(
        fa_fwd_kernel,
        (b * h, blocks) if causal else (blocks, b * h),
        (
            qa,
            ka,
            va,
            oa,
            lse,
            seed,
            ranges[0] if ranges is not None else lse,
            sinks if sinks is not None else lse,
            *_strides(q),
            *_strides(k),
            *_strides(v),
            *_strides(out),
            h,
            h // hk,
            sq,
            sk,
            scale * LOG2E,
            threshold,
            keep_scale,
            window,
            shift,
        ),
        dict(
            HEAD_DIM=d,
            BLOCK_D=bd,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            CAUSAL=causal,
            DROPOUT=dropout,
            PRECISION=_dot_precision(q.dtype),
            TMA=tma,
            Q_ROWS=q_rows is not None,
            WINDOWED=window > 0,
            DOCS=ranges is not None,
            SINK=sinks is not None,
            HEAD_DIM_V=dv,
            BLOCK_DV=bdv,
            num_warps=warps,
            num_stages=stages,
            **({"maxnreg": limit[0]} if limit else {}),
        ),
    )


def forward(
    q,
    k,
    v,
    causal: bool,
    scale: float,
    dropout_p: float,
    seed: torch.Tensor | None,
    window: int = 0,
    shift: int = 0,
    ranges: tuple | None = None,
    sinks: torch.Tensor | None = None,
):
    """Returns (out ``[b, sq, h, d_v]`` in q's dtype (d_v: v's head dim), lse ``[b, h, sq]`` fp32, the sinks
    included). ``window``, ``shift``, ``ranges``, ``sinks``: as ``forward_launch``."""

    b, sq, h, d = q.shape
    dv = v.shape[3]
    out = empty_out(q, dv)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    seed = lse if seed is None else seed  # SEED is read only with dropout; any pointer stands in
    arch = arch_of(q.device)

    def launch(cfg):
        forward_launch(
            q,
            k,
            v,
            out,
            lse,
            seed,
            causal,
            scale,
            dropout_p,
            cfg,
            window=window,
            shift=shift,
            ranges=ranges,
            sinks=sinks,
        )()

    key = (
        "fwd",
        arch,
        d,
        dv,
        q.dtype,
        causal,
        dropout_p > 0.0,
        window > 0,
        ranges is not None,
        sinks is not None,
        seq_bucket(sq),
        seq_bucket(k.shape[1]),
    )
    launch(pick_config(key, candidates(FWD_CONFIGS, arch, d, dv), launch))
    return out, lse


def _delta_rows(head_dim: int) -> int:
    """Query rows per program of the delta launch."""
    return 64 if padded_head_dim(head_dim) <= 128 else 32


def dsinks_scratch(q: torch.Tensor, head_dim_v: int | None = None) -> torch.Tensor:
    """The fp32 ``[b * h, programs]`` buffer of the delta launch's partial sums of the sinks' gradient (one per
    program along the queries), for ``backward_launches`` on q ``[b, sq, h, d]`` and v's head dim ``head_dim_v``
    (default: q's)."""
    b, sq, h, d = q.shape
    rows = _delta_rows(d if head_dim_v is None else head_dim_v)
    return torch.empty((b * h, triton.cdiv(sq, rows)), dtype=torch.float32, device=q.device)


def backward_launches(
    do,
    q,
    k,
    v,
    out,
    lse,
    delta,
    dq,
    dk,
    dv,
    seed,
    causal: bool,
    scale: float,
    dropout_p: float,
    cfg,
    deterministic: bool = False,
    dq_tma: bool | None = None,
    arch: int | None = None,
    window: int = 0,
    shift: int = 0,
    ranges: tuple | None = None,
    sinks: torch.Tensor | None = None,
    dsinks: torch.Tensor | None = None,
) -> list[Launch]:
    """The backward kernels' launches, in order, for config ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``: delta,
    then the one-pass kernel (dQ by fp32 atomics into ``dq``, which must then be a zeroed fp32 buffer), or with
    ``deterministic`` the pass without dQ and the dQ kernel (``dq`` in q's dtype). ``delta`` is a [2, b, h, sq]
    fp32 scratch: the first launch writes the scaled delta into ``delta[0]`` and the base-2 lse into ``delta[1]``.
    ``dq_tma``: the one-pass kernel adds dQ tiles through a tensor descriptor (a TMA reduce) instead of fp32
    atomics (default: with atomics, where ``tma_eligible(dq)`` and the target is Hopper or the interpreter).
    ``arch``: the target (default: the tensors' device; sm_90 for meta tensors). ``window``, ``shift``, ``ranges``:
    as ``forward_launch`` (the one-pass kernel reads ``k_queries``, the dQ kernel ``q_keys``). ``sinks`` (fp32
    ``[h]``): the delta launch also writes each of its programs' share of the sinks' gradient into ``dsinks``, an
    fp32 ``[b * h, cdiv(sq, delta rows)]`` scratch (``dsinks_scratch``); the other launches are those without
    sinks."""
    b, sq, h, d = q.shape
    sk, hk, d_v = k.shape[1], k.shape[2], v.shape[3]
    dropout, threshold, keep_scale = _dropout_args(dropout_p)
    block_m, block_n, warps, stages = cfg
    bd, bdv = padded_head_dim(d), padded_head_dim(d_v)
    common = dict(
        HEAD_DIM=d,
        HEAD_DIM_V=d_v,
        BLOCK_D=bd,
        BLOCK_DV=bdv,
        CAUSAL=causal,
        DROPOUT=dropout,
        PRECISION=_dot_precision(q.dtype),
        WINDOWED=window > 0,
        DOCS=ranges is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=warps,
        num_stages=stages,
    )
    if arch is None:
        arch = _launch_arch(q)
    if dq_tma is None:
        dq_tma = not deterministic and _has_tma(arch) and tma_eligible(dq)
    # d256 with query blocks of 64 rows or more adds dS K in two column halves (registers: _fa_bwd's DQ_CHUNKS)
    dq_chunks = 2 if bd >= 256 and block_m >= 64 and not deterministic else 1
    dq_arg = _descriptor(dq, block_m, bd // dq_chunks) if dq_tma else dq
    delta_rows = _delta_rows(d_v)
    delta, lse2 = delta[0], delta[1]
    if sinks is not None and dsinks is None:
        raise ValueError("backward_launches: sinks need a dsinks scratch (dsinks_scratch)")
    launches = [
        Launch(
            fa_bwd_delta_kernel,
            (triton.cdiv(sq, delta_rows), b * h),
            (
                out,
                do,
                lse,
                delta,
                lse2,
                sinks if sinks is not None else lse,
                dsinks if sinks is not None else lse,
                *_strides(out),
                *_strides(do),
                h,
                sq,
                scale,
            ),
            dict(HEAD_DIM=d_v, BLOCK_D=bdv, BLOCK_M=delta_rows, SINK=sinks is not None, num_warps=4),
        ),
        Launch(
            fa_bwd_kernel,
            (triton.cdiv(sk, block_n), b * hk),
            (
                q,
                k,
                v,
                do,
                lse2,
                delta,
                dk,
                dv,
                dq_arg,
                seed,
                ranges[1] if ranges is not None else lse,
                *_strides(q),
                *_strides(k),
                *_strides(v),
                *_strides(do),
                *_strides(dk),
                *_strides(dv),
                *_strides(dq),
                h,
                hk,
                h // hk,
                sq,
                sk,
                scale * LOG2E,
                scale,
                threshold,
                keep_scale,
                window,
                shift,
            ),
            dict(common, DQ_ATOMIC=not deterministic, DQ_TMA=dq_tma, DQ_CHUNKS=dq_chunks),
        ),
    ]
    if deterministic:
        dq_table = _for_arch(DQ_CONFIGS, arch) if arch else None
        dq_m, dq_n, dq_warps, *dq_stages = dq_table[max(bd, bdv)] if dq_table else (block_m, block_n, warps)
        launches.append(
            Launch(
                fa_bwd_dq_kernel,
                (triton.cdiv(sq, dq_m), b * h),
                (
                    q,
                    k,
                    v,
                    do,
                    lse2,
                    delta,
                    dq,
                    seed,
                    ranges[0] if ranges is not None else lse,
                    *_strides(q),
                    *_strides(k),
                    *_strides(v),
                    *_strides(do),
                    *_strides(dq),
                    h,
                    h // hk,
                    sq,
                    sk,
                    scale * LOG2E,
                    scale,
                    threshold,
                    keep_scale,
                    window,
                    shift,
                ),
                dict(common, BLOCK_M=dq_m, BLOCK_N=dq_n, num_warps=dq_warps, num_stages=(dq_stages or [stages])[0]),
            )
        )
    return launches


# ----------------------------------------------------------------------------------------------------------------
# Schedules: the ranges of the kernels' tile loops, per program in launch order (the bounds each kernel computes from
# its program id; tests/triton/test_schedules.py compares them with the loops the kernels run).


def _band(launch: Launch) -> dict:
    """The band arguments of ``attention_band.key_bounds`` / ``query_bounds`` that a launch runs with."""
    return dict(causal=launch.arg("CAUSAL"), window=launch.arg("WINDOW"), shift=launch.arg("SHIFT"))


def _doc_spans(launch: Launch):
    """The host copy of a ``DOCS`` launch's span table (``DOC_SPANS``, [b, s, 2]) as nested lists, else None."""
    if not launch.arg("DOCS"):
        return None
    return launch.arg("DOC_SPANS").cpu().tolist()


def forward_schedule(launch: Launch) -> Schedule:
    """The schedule of ``fa_fwd_kernel`` (a ``forward_launch``). A program is one query block of one head (causal
    grids ``(b * h, blocks)`` run the last query block of every head first, the others are ``(blocks, b * h)``); it
    runs the key blocks that every row of it sees in full, ``range(0, full, BLOCK_N)`` without masks ("full"), then
    ``range(full, hi, BLOCK_N)`` with them ("masked"): up to the causal diagonal and SK's partial block. With a
    window (``WINDOWED``) it runs only the key blocks that meet its rows' band: the band's near edge with masks
    ("window"), the blocks inside every row's band without ("full"), then the far edge ("masked"). With documents
    (``DOCS``) the same three loops, cut to the key span of the block's documents: a program's work follows its
    document's length, not the packed sequence's."""
    sq, sk, bm, bn = launch.arg("SQ"), launch.arg("SK"), launch.arg("BLOCK_M"), launch.arg("BLOCK_N")
    windowed, h, causal = launch.arg("WINDOWED"), launch.arg("H"), launch.arg("CAUSAL")
    spans = _doc_spans(launch)

    def runs(pid_m: int, b: int) -> list[tuple[str, range]]:
        lo, full_lo, full_hi, hi = key_bounds(
            pid_m * bm, bm, sq, sk, bn, **_band(launch), spans=spans[b] if spans is not None else None
        )
        edge = [("window", range(lo, full_lo, bn))] if windowed or spans is not None else []
        return [*edge, ("full", range(full_lo, full_hi, bn)), ("masked", range(full_hi, hi, bn))]

    loops = ("window", "full", "masked") if windowed or spans is not None else ("full", "masked")
    blocks = launch.grid[1] if causal else launch.grid[0]
    per_block: dict = {}

    def program(pid_m: int, bh: int):
        b = bh // h if spans is not None else 0
        if (pid_m, b) not in per_block:
            per_block[pid_m, b] = runs(pid_m, b)
        return per_block[pid_m, b]

    if causal:
        return Schedule(loops, [program(blocks - 1 - y, x) for x, y in launch.program_ids()])
    return Schedule(loops, [program(x, y) for x, y in launch.program_ids()])


def backward_schedule(launch: Launch) -> Schedule:
    """The schedule of ``fa_bwd_kernel`` (the one-pass backward of ``backward_launches``), grid ``(key blocks,
    b * k/v heads)``. For each query head of its k/v head's group in turn, a program runs the query blocks of the
    causal diagonal band ``range(lo, mid, BLOCK_M)`` with masks ("diag"), the ones that see every key of its block
    ``range(mid, SQ // BLOCK_M * BLOCK_M, BLOCK_M)`` without ("full"), then the query tail with masks ("tail"); a
    key block that runs past SK takes every query block masked. With a window (``WINDOWED``) only the query blocks
    that meet its keys' band: the near edge ("diag"), those inside every key's band ("full"), then the far edge and
    the query tail ("tail"). With documents (``DOCS``) the same loops cut to the query span of the block's
    documents."""
    sq, sk, group = launch.arg("SQ"), launch.arg("SK"), launch.arg("GROUP")
    bm, bn, hk = launch.arg("BLOCK_M"), launch.arg("BLOCK_N"), launch.arg("HK")
    spans = _doc_spans(launch)

    def runs(pid_n: int, b: int) -> list[tuple[str, range]]:
        lo, mid, full_end, hi = query_bounds(
            pid_n * bn, bn, sq, sk, bm, **_band(launch), spans=spans[b] if spans is not None else None
        )
        one = [("diag", range(lo, mid, bm)), ("full", range(mid, full_end, bm)), ("tail", range(full_end, hi, bm))]
        return one * group

    per_block: dict = {}

    def program(pid_n: int, bhk: int):
        b = bhk // hk if spans is not None else 0
        if (pid_n, b) not in per_block:
            per_block[pid_n, b] = runs(pid_n, b)
        return per_block[pid_n, b]

    return Schedule(("diag", "full", "tail"), [program(x, y) for x, y in launch.program_ids()])


def dq_schedule(launch: Launch) -> Schedule:
    """The schedule of ``fa_bwd_dq_kernel`` (the deterministic backward's dQ), grid ``(query blocks, b * h)``: each
    program runs the key blocks its queries see, ``range(0, hi, BLOCK_N)`` ("all"); with a window, those that meet
    its rows' band, ``range(lo, hi, BLOCK_N)``; with documents, cut to its documents' key span."""
    sq, sk, h = launch.arg("SQ"), launch.arg("SK"), launch.arg("H")
    bm, bn = launch.arg("BLOCK_M"), launch.arg("BLOCK_N")
    spans = _doc_spans(launch)

    def keys(m: int, b: int) -> range:
        lo, _, _, hi = key_bounds(
            m * bm, bm, sq, sk, bn, **_band(launch), spans=spans[b] if spans is not None else None
        )
        return range(lo, hi, bn)

    per_block: dict = {}

    def program(m: int, bh: int):
        b = bh // h if spans is not None else 0
        if (m, b) not in per_block:
            per_block[m, b] = [("all", keys(m, b))]
        return per_block[m, b]

    return Schedule(("all",), [program(x, y) for x, y in launch.program_ids()])


# kernel name -> its schedule: every kernel of this module with tile loops (``fa_bwd_delta_kernel`` has none)
SCHEDULES = {
    k.fn.__name__: f
    for k, f in ((fa_fwd_kernel, forward_schedule), (fa_bwd_kernel, backward_schedule), (fa_bwd_dq_kernel, dq_schedule))
}


def backward(
    do,
    q,
    k,
    v,
    out,
    lse,
    causal: bool,
    scale: float,
    dropout_p: float,
    seed: torch.Tensor | None,
    deterministic: bool = False,
    window: int = 0,
    shift: int = 0,
    ranges: tuple | None = None,
    sinks: torch.Tensor | None = None,
):
    """Returns (dq, dk, dv, dsinks) with dq, dk, dv shaped and typed like q, k, v (dv in v's head dim, which ``do``
    and ``out`` have too) and dsinks like ``sinks`` (an empty fp32 tensor without them). ``deterministic``: the same
    bits on every run (dQ by a separate kernel instead of atomics; dsinks is deterministic either way). ``window``,
    ``shift``, ``ranges``, ``sinks``: as ``forward_launch``."""
    b, sq, h, d = q.shape
    d_v = v.shape[3]
    do = do if do.stride(-1) == 1 else do.contiguous()
    delta = torch.empty((2, b, h, sq), dtype=torch.float32, device=q.device)
    dsinks = dsinks_scratch(q, d_v) if sinks is not None else None
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    seed = lse if seed is None else seed
    arch = arch_of(q.device)

    def launch(cfg):
        dq = torch.empty_like(q) if deterministic else torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        for ln in backward_launches(
            do,
            q,
            k,
            v,
            out,
            lse,
            delta,
            dq,
            dk,
            dv,
            seed,
            causal,
            scale,
            dropout_p,
            cfg,
            deterministic,
            window=window,
            shift=shift,
            ranges=ranges,
            sinks=sinks,
            dsinks=dsinks,
        ):
            ln()
        return dq

    key = (
        "bwd",
        arch,
        d,
        d_v,
        q.dtype,
        causal,
        dropout_p > 0.0,
        deterministic,
        window > 0,
        ranges is not None,
        seq_bucket(sq),
        seq_bucket(k.shape[1]),
    )
    dq = launch(pick_config(key, candidates(BWD_CONFIGS, arch, d, d_v), launch))
    if sinks is not None:  # the partial sums in a fixed order: [b, h, programs] over batch and programs
        dsinks = dsinks.view(b, h, -1).sum((0, 2)).to(sinks.dtype)
    else:
        dsinks = torch.empty((0,), dtype=torch.float32, device=q.device)
    return (dq if deterministic else dq.to(q.dtype)), dk, dv, dsinks
