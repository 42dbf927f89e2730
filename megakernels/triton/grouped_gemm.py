"""Grouped GEMM in Triton: one launch per product over every group, no host synchronisation.

Rows of ``x`` ``[T, k]`` are sorted by group; group ``e`` owns ``group_sizes[e]`` consecutive rows and its weight
``W[e]`` ``[n, k]``. The three products of a mixture-of-experts layer are two kernels:

- ``_rows_kernel`` computes ``C[rows of e] = A[rows of e] @ B_e`` for every group at once: the forward
  (``A = x``, ``B_e = W[e]ᵀ``) and the input gradient (``A = dout``, ``B_e = W[e]``, the same kernel with the
  weight's strides swapped). The grid is an upper bound on the number of row tiles, ``cdiv(T, BLOCK_M) + E``
  (each group adds at most one partial tile), times the column tiles. Each program finds its tile from the group
  sizes alone: it loads all ``E`` sizes as one vector, takes the in-register cumulative sum of their row-tile
  counts, and its group is the number of groups whose tiles end at or before its index. Programs past the last
  tile return at once. So the schedule is computed on the device, per program, from a tensor the host never reads.
- ``_wgrad_kernel`` computes ``dW[e] = dout[rows of e]ᵀ @ x[rows of e]``: one program per (``[BLOCK_N, BLOCK_K]``
  tile of ``dW[e]``, group), reducing over that group's rows in ``BLOCK_T`` chunks (an empty group writes zeros).

The tile loops each program runs (``rows_schedule``, ``wgrad_schedule``: what the static model prices) are written
once, beside the launchers; the kernels compute the same bounds on the device, and tests/triton/test_schedules.py
runs them under Triton's interpreter to hold the two together.

Accumulation is fp32; inputs fp16/bf16 (tensor cores) or fp32 (IEEE products, as ATen's default fp32 matmul).
Rows past ``T`` are never touched even if the group sizes do not sum to ``T`` (their values are checked on the
CPU; on CUDA asynchronously, see megakernels/ops/grouped_gemm.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megakernels.triton._common import arch_of, pick_config
from megakernels.triton.launch import Launch, Schedule

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per architecture and element size; the first is the default.
# 16-bit tiles of 128x128 with 64-deep k slices are wgmma-shaped on sm_90 (3 stages: 96 KiB of shared memory).
# fp32 runs IEEE FMAs (no tensor cores, as ATen's default fp32 matmul): 64x64 tiles, since 128x128 needs all 255
# registers per thread (megakernels bench --static --ops grouped_gemm and tests/triton/grouped_gemm_sm90.py).
ROWS_CONFIGS = {
    90: {
        2: [(128, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 256, 64, 8, 3), (64, 64, 64, 4, 4)],
        4: [(64, 64, 32, 4, 4), (128, 128, 32, 8, 3)],
    },
    80: {
        2: [(128, 128, 32, 4, 4), (64, 128, 32, 4, 4), (64, 64, 32, 4, 4)],
        4: [(128, 64, 32, 4, 3), (64, 64, 32, 4, 3)],
    },
}
# (BLOCK_N, BLOCK_K, BLOCK_T, num_warps, num_stages): a [BLOCK_N, BLOCK_K] tile of dW[e], BLOCK_T rows per step.
WGRAD_CONFIGS = {
    90: {
        2: [(128, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4)],
        4: [(128, 64, 32, 8, 3), (64, 64, 32, 4, 3)],
    },
    80: {2: [(128, 128, 32, 8, 3), (64, 64, 32, 4, 4)], 4: [(64, 64, 32, 4, 3)]},
}
INTERPRETER_ROWS = (16, 16, 16, 4, 1)  # small tiles: the tests' odd sizes cross many tile edges
INTERPRETER_WGRAD = (16, 16, 16, 4, 1)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def candidates(table: dict, arch: int, dtype: torch.dtype, interpreter) -> list[tuple]:
    """The configs for ``arch`` (the newest table at or below it) and ``dtype``'s element size."""
    if arch == 0:
        return [interpreter]
    known = sorted(a for a in table if a <= arch) or [min(table)]
    return table[known[-1]][2 if dtype.itemsize <= 2 else 4]


@triton.jit
def group_of_tile(SIZES, E, tile, BLOCK_E: tl.constexpr, TILE: tl.constexpr):
    """(group, first row of this tile, end row of its group) of row tile ``tile``; group == E past the last."""
    idx = tl.arange(0, BLOCK_E)
    sizes = tl.load(SIZES + idx, mask=idx < E, other=0).to(tl.int32)
    tiles = (sizes + TILE - 1) // TILE
    tile_end = tl.cumsum(tiles, 0)
    g = tl.sum((tile_end <= tile).to(tl.int32), 0)
    before = idx < g
    first_tile = tl.sum(tl.where(before, tiles, 0), 0)
    start = tl.sum(tl.where(before, sizes, 0), 0) + (tile - first_tile) * TILE
    end = tl.sum(tl.where(idx <= g, sizes, 0), 0)
    return g, start, end


@triton.jit
def _rows_kernel(
    A,
    B,
    C,
    SIZES,
    T,
    N,
    K,
    E,
    stride_am,
    stride_be,
    stride_bk,
    stride_bn,
    stride_cm,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g, start, end = group_of_tile(SIZES, E, pid_m, BLOCK_E, BLOCK_M)
    if g >= E:
        return
    end = tl.minimum(end, T)
    rows = start + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = rows < end
    col_ok = cols < N
    a_ptrs = A + rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = B + g.to(tl.int64) * stride_be + offs_k[:, None] * stride_bk + cols.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = offs_k + k0 < K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = C + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _wgrad_kernel(
    DOUT,
    X,
    DW,
    SIZES,
    T,
    N,
    K,
    E,
    stride_dm,
    stride_xm,
    stride_we,
    BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    g = tl.program_id(1)
    tiles_k = tl.cdiv(K, BLOCK_K)
    pid_n = pid // tiles_k
    pid_k = pid % tiles_k
    idx = tl.arange(0, BLOCK_E)
    sizes = tl.load(SIZES + idx, mask=idx < E, other=0).to(tl.int32)
    start = tl.sum(tl.where(idx < g, sizes, 0), 0)
    end = tl.minimum(start + tl.sum(tl.where(idx == g, sizes, 0), 0), T)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    k_ok = offs_k < K
    offs_t = tl.arange(0, BLOCK_T)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for t0 in range(start, end, BLOCK_T):
        rows = t0 + offs_t
        t_ok = rows < end
        d = tl.load(
            DOUT + rows.to(tl.int64)[:, None] * stride_dm + offs_n[None, :],
            mask=t_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        x = tl.load(
            X + rows.to(tl.int64)[:, None] * stride_xm + offs_k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0
        )
        acc = tl.dot(tl.trans(d), x, acc, input_precision=PRECISION)
    dw_ptrs = DW + g.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    tl.store(dw_ptrs, acc.to(DW.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])


# ----------------------------------------------------------------------------------------------------------------
# Launches as data (megakernels.triton.launch): what the launchers below run and what the static report compiles.


def block_e(num_groups: int) -> int:
    return max(2, triton.next_power_of_2(num_groups))


def rows_launch(
    a: torch.Tensor, w: torch.Tensor, sizes: torch.Tensor, out: torch.Tensor, transpose_w: bool, cfg: tuple
):
    """``out[rows of e] = a[rows of e] @ (w[e]ᵀ if transpose_w else w[e])``; ``a`` ``[T, K]`` and ``w``
    ``[E, R, C]`` contiguous, ``sizes`` ``[E]`` int32/int64 on a's device."""
    bm, bn, bk, warps, stages = cfg
    t, kdim = a.shape
    e = w.shape[0]
    if transpose_w:  # B_e = W[e]ᵀ: element (kk, nn) at W[e, nn, kk]
        n = w.shape[1]
        stride_bk, stride_bn = 1, w.shape[2]
    else:  # B_e = W[e]: element (kk, nn) at W[e, kk, nn]
        n = w.shape[2]
        stride_bk, stride_bn = w.shape[2], 1
    grid = (triton.cdiv(t, bm) + e, triton.cdiv(n, bn))
    args = (a, w, out, sizes, t, n, kdim, e, a.stride(0), w.stride(0), stride_bk, stride_bn, out.stride(0))
    kwargs = dict(
        BLOCK_E=block_e(e),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        EVEN_K=kdim % bk == 0,
        PRECISION=_precision(a.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    return Launch(_rows_kernel, grid, args, kwargs)


def wgrad_launch(dout: torch.Tensor, x: torch.Tensor, sizes: torch.Tensor, dw: torch.Tensor, cfg: tuple):
    """``dw[e] = dout[rows of e]ᵀ @ x[rows of e]``; dout ``[T, N]``, x ``[T, K]``, dw ``[E, N, K]`` contiguous."""
    bn, bk, bt, warps, stages = cfg
    t, n = dout.shape
    kdim = x.shape[1]
    e = dw.shape[0]
    grid = (triton.cdiv(n, bn) * triton.cdiv(kdim, bk), e)
    args = (dout, x, dw, sizes, t, n, kdim, e, dout.stride(0), x.stride(0), dw.stride(0))
    kwargs = dict(
        BLOCK_E=block_e(e),
        BLOCK_N=bn,
        BLOCK_K=bk,
        BLOCK_T=bt,
        PRECISION=_precision(x.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    return Launch(_wgrad_kernel, grid, args, kwargs)


def group_sizes_of(launch: Launch, group_sizes) -> list[int]:
    sizes = [int(v) for v in group_sizes]
    if len(sizes) != launch.arg("E"):
        raise ValueError(f"{launch.name}: {len(sizes)} group sizes for a launch over {launch.arg('E')} groups")
    return sizes


def rows_schedule(launch: Launch, group_sizes) -> Schedule:
    """The schedule of ``_rows_kernel`` (a ``rows_launch``) for ``group_sizes``, which the kernel reads on the device
    and the host never does (the static model passes the sizes it assumes). Row tile ``i`` (grid axis 0) belongs to
    the group whose tiles, ``cdiv(size, BLOCK_M)`` of each group in order, cover it; a program past the last tile
    returns before its loop; every other runs ``range(0, K, BLOCK_K)`` ("k")."""
    bm, bk, k = launch.arg("BLOCK_M"), launch.arg("BLOCK_K"), launch.arg("K")
    tiles = sum(triton.cdiv(s, bm) for s in group_sizes_of(launch, group_sizes))
    loop = [("k", range(0, k, bk))]
    return Schedule(("k",), [loop if x < tiles else [] for x, _ in launch.program_ids()])


def wgrad_schedule(launch: Launch, group_sizes) -> Schedule:
    """The schedule of ``_wgrad_kernel`` (a ``wgrad_launch``) for ``group_sizes``, grid ``(dW tiles, groups)``: the
    program of group ``g`` runs its rows, ``range(start, min(start + size, T), BLOCK_T)`` ("t"), ``start`` the
    rows of the groups before it."""
    bt, t = launch.arg("BLOCK_T"), launch.arg("T")
    sizes = group_sizes_of(launch, group_sizes)
    starts = [sum(sizes[:g]) for g in range(len(sizes))]
    per_group = [[("t", range(starts[g], min(starts[g] + sizes[g], t), bt))] for g in range(len(sizes))]
    return Schedule(("t",), [per_group[g] for _, g in launch.program_ids()])


def _tuned(name: str, table: dict, interp: tuple, a: torch.Tensor, shape_key: tuple, make) -> None:
    arch = arch_of(a.device)
    cands = candidates(table, arch, a.dtype, interp)
    key = (name, arch, a.dtype, *shape_key)
    make(pick_config(key, cands, lambda cfg: make(cfg)()))()


def _device_sizes(group_sizes: torch.Tensor, device: torch.device) -> torch.Tensor:
    return group_sizes.to(device=device, non_blocking=True)


def forward(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """``[T, n]``: ``x[rows of e] @ weight[e]ᵀ`` (x ``[T, k]``, weight ``[E, n, k]``, both contiguous)."""
    out = x.new_empty((x.shape[0], weight.shape[1]))
    if out.numel() == 0:
        return out
    sizes = _device_sizes(group_sizes, x.device)
    _tuned(
        "grouped_gemm_fwd",
        ROWS_CONFIGS,
        INTERPRETER_ROWS,
        x,
        (weight.shape[1], weight.shape[2]),
        lambda cfg: rows_launch(x, weight, sizes, out, True, cfg),
    )
    return out


def backward(
    dout: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx [T, k], dweight [E, n, k])`` of ``forward`` for ``dout`` ``[T, n]`` (contiguous)."""
    sizes = _device_sizes(group_sizes, x.device)  # copied once; the halves find them on the device
    return dgrad(dout, x, weight, sizes), wgrad(dout, x, weight, sizes)


def dgrad(dout: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """``dx [T, k]`` of ``forward`` (``backward``'s first half; x gives the shape and dtype)."""
    sizes = _device_sizes(group_sizes, x.device)
    dx = torch.empty_like(x)
    if dx.numel():  # n == 0 runs too: an empty reduction writes zeros
        _tuned(
            "grouped_gemm_dx",
            ROWS_CONFIGS,
            INTERPRETER_ROWS,
            x,
            (weight.shape[1], weight.shape[2]),
            lambda cfg: rows_launch(dout, weight, sizes, dx, False, cfg),
        )
    return dx


def wgrad(dout: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """``dweight [E, n, k]`` of ``forward`` (``backward``'s second half; weight gives the shape and dtype)."""
    sizes = _device_sizes(group_sizes, x.device)
    dw = torch.empty_like(weight)
    if dw.numel():
        _tuned(
            "grouped_gemm_dw",
            WGRAD_CONFIGS,
            INTERPRETER_WGRAD,
            x,
            (weight.shape[1], weight.shape[2]),
            lambda cfg: wgrad_launch(dout, x, sizes, dw, cfg),
        )
    return dw
