"""FP8 quantisation and GEMMs in Triton for sm_90: the kernels behind megakernels/ops/fp8.py, which documents what
they compute (formats, granularities, power-of-two scales, the fp32 promotion every 128 of K) and checks the
arguments; here inputs are taken as checked and contiguous.

- ``quantize``: one pass over ``x`` writing its FP8 copy, its scales and, with ``transpose``, the FP8 copy of
  ``xᵀ`` with its own scales ("row", "block": one read of x; "tensor": an amax reduction first unless a scale is
  given, then the pass, two reads). Bit-identical to ``ops.fp8.quantize_reference`` (kernels:
  megakernels/triton/_fp8_quant.py).
- ``gemm``: ``a @ bᵀ`` of FP8 operands on wgmma (QGMMA), fp32 promotion every 128 of K, in ``out_dtype``.
- ``grouped_gemm``: the experts' FP8 GEMM; the tile schedule comes from the group sizes on the device, no host
  synchronisation (kernels: megakernels/triton/_fp8_gemm.py).

Shapes: the kernels want rows of 16 elements (vector accesses, TMA). An operand of a GEMM whose K is not a multiple
of 16 is copied with K zero-padded; the quantiser quantises x zero-padded to 16-element rows (and, with the
transpose, a multiple of 16 rows) and copies the result out. Zeros change no maximum and add nothing to a product,
and the padding stays inside the last 128-wide tile, so results and scales are those of the unpadded input; the
copies cost only at such shapes.

Launches are data (``megakernels.triton.launch.Launch``): ``quantize_launches``, ``gemm_launch`` and
``grouped_launch`` build what the functions run and what ``megakernels bench --static`` compiles for sm_90 on meta
tensors; ``quantize_schedule``, ``gemm_schedule`` and ``grouped_schedule`` are the loops their programs run (the
static model's input; tests/triton/test_fp8.py holds them to the kernels under Triton's interpreter).

Under the interpreter (``TRITON_INTERPRET=1``, CPU tensors under backend cuda_emu) the kernels need the FP8 casts
of ``install_interpreter_fp8_casts()``: the interpreter's own round FP8 wrongly, so without them these functions
raise rather than return wrong bits.
"""

from __future__ import annotations

import torch
import triton

from megakernels.triton._common import arch_of, interpreter_fp8_casts_installed, interpreting, pick_config
from megakernels.triton._fa_fwd import supports_tma
from megakernels.triton._fp8_gemm import fp8_gemm_kernel, fp8_grouped_kernel
from megakernels.triton._fp8_quant import fp8_amax_kernel, fp8_quant_kernel
from megakernels.triton.grouped_gemm import block_e, group_sizes_of
from megakernels.triton.launch import Launch, Schedule

TILE = 128  # the scales' tile (ops.fp8.TILE); the GEMMs' K chunk
_TORCH_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_MAX_EXP = {"e4m3": 9, "e5m2": 16}  # the format's max is 0.875 * 2**MAX_EXP
_GRAN = {"tensor": 0, "row": 1, "block": 2}

# GEMM configs (BLOCK_M, BLOCK_N, num_warps, num_stages, GROUP_M) per architecture, BLOCK_K = 128; the first is
# the default. sm_90: two warpgroups on a 128x128 tile (each a 64x128 slice: QGMMA.64x128x32), three stages of
# 32 KiB; one warpgroup on 64x128 fits two CTAs an SM. A 128x256 tile needs the accumulator and a chunk's product,
# 2 x 128 fp32 registers a thread: it spills. megakernels bench --static --ops fp8_gemm prices them; a GPU run
# autotunes among them. sm_89 (FP8 mma.sync, no TMA: pointer loads) is compiled by hand only, not in the tests.
GEMM_CONFIGS = {
    90: [(128, 128, 8, 3, 8), (128, 128, 8, 4, 8), (64, 128, 4, 4, 8)],
    89: [(128, 128, 8, 3, 8), (64, 128, 4, 3, 8)],
}
GROUPED_CONFIGS = {
    90: [(128, 128, 8, 3), (128, 128, 8, 4), (64, 128, 4, 4)],
    89: [(128, 128, 8, 3), (64, 128, 4, 3)],
}
INTERPRETER_GEMM = (16, 32, 4, 1, 2)  # small tiles: the tests' odd sizes cross many tile edges
INTERPRETER_GROUPED = (16, 32, 4, 1)
MIN_FP8_ARCH = 89  # FP8 tensor cores (Ada, Hopper)
ALIGN = 16  # elements (bytes of FP8) a row must be a multiple of for vector accesses and TMA
QUANT_WARPS = 8
QUANT_PROGRAMS_PER_SM = 4
INTERPRETER_SMS = 2  # programs of the grid-stride quantiser under the interpreter: several tiles each


def _launch_arch(t: torch.Tensor) -> int:
    """The target a launch on ``t`` compiles for: its GPU's, 0 under the interpreter, sm_90 for meta tensors (the
    static report)."""
    return arch_of(t.device) if t.device.type != "meta" else 90


def _has_tma(t: torch.Tensor) -> bool:
    """Whether launches on ``t`` load through tensor descriptors: on Hopper and newer (sm_89 loads through
    pointers) and under the interpreter."""
    arch = _launch_arch(t)
    return arch == 0 or arch >= 90


def _sms(t: torch.Tensor) -> int:
    if t.device.type == "cuda":
        return torch.cuda.get_device_properties(t.device).multi_processor_count
    if t.device.type == "meta":  # planned for the static report's machine
        from megakernels.machines import H200

        return H200.sms
    return INTERPRETER_SMS


def _check_runnable(op: str, t: torch.Tensor) -> None:
    if t.device.type == "cpu":
        if not interpreting():
            raise RuntimeError(f"{op}: CPU tensors run the Triton kernels only under TRITON_INTERPRET=1")
        if not interpreter_fp8_casts_installed():
            raise RuntimeError(
                f"{op}: Triton's interpreter rounds FP8 casts wrongly; call "
                "megakernels.triton.install_interpreter_fp8_casts() first (tests/triton/test_fp8.py does)"
            )
    elif t.device.type == "cuda" and arch_of(t.device) < MIN_FP8_ARCH:
        raise RuntimeError(f"{op}: FP8 kernels need sm_{MIN_FP8_ARCH} or newer, this GPU is sm_{arch_of(t.device)}")


def candidates(table: dict, arch: int, interpreter: tuple) -> list[tuple]:
    """The configs for ``arch`` (the newest table at or below it)."""
    if arch == 0:
        return [interpreter]
    known = sorted(a for a in table if a <= arch) or [min(table)]
    return table[known[-1]]


# ----------------------------------------------------------------------------------------------------------------
# quantisation


def quantize_outputs(x: torch.Tensor, fmt: str, granularity: str, transpose: bool) -> tuple:
    """Empty ``(q, scale, qt, scale_t)`` for ``quantize`` (``(0,)``-shaped qt and scale_t without transpose)."""
    m, k = x.shape
    dtype = _TORCH_FORMATS[fmt]
    tm, tk = triton.cdiv(m, TILE), triton.cdiv(k, TILE)
    shapes = {"tensor": ((), ()), "row": ((m, tk), (k, tm)), "block": ((tm, tk), (tk, tm))}[granularity]
    q = x.new_empty((m, k), dtype=dtype)
    s = x.new_empty(shapes[0], dtype=torch.float32)
    if not transpose:
        return q, s, x.new_empty((0,), dtype=dtype), x.new_empty((0,), dtype=torch.float32)
    return q, s, x.new_empty((k, m), dtype=dtype), x.new_empty(shapes[1], dtype=torch.float32)


def quantize_launches(
    x: torch.Tensor,
    fmt: str,
    granularity: str,
    scale: torch.Tensor | None,
    outputs: tuple,
    amax: torch.Tensor | None = None,
    sms: int | None = None,
) -> list[Launch]:
    """The launches of ``quantize`` writing ``outputs`` (``quantize_outputs``): for "tensor" without a scale the
    amax reduction into ``amax`` (int32 ``[1]``, zeroed) first. Grids: ``min(tiles, QUANT_PROGRAMS_PER_SM x
    sms)`` programs over the 128 x 128 tiles."""
    q, s, qt, st = outputs
    transpose = qt.dim() == 2
    m, k = x.shape
    tm, tk = triton.cdiv(m, TILE), triton.cdiv(k, TILE)
    tiles = tm * tk
    grid = (max(1, min(tiles, QUANT_PROGRAMS_PER_SM * (sms or _sms(x)))),)
    gran = _GRAN[granularity]
    given = scale is not None
    launches = []
    if gran == 0 and not given:
        launches.append(
            Launch(
                fp8_amax_kernel,
                grid,
                (x, amax, m, k, x.stride(0), tk, tiles),
                dict(BLOCK_M=TILE, BLOCK_K=TILE, num_warps=QUANT_WARPS),
            )
        )
    args = (x, q, s, qt, st, scale if given else s, amax if amax is not None else s, m, k, x.stride(0), tm, tk, tiles)
    kwargs = dict(
        GRAN=gran,
        TRANSPOSE=transpose,
        GIVEN=given,
        MAX_EXP=_MAX_EXP[fmt],
        BLOCK_M=TILE,
        BLOCK_K=TILE,
        num_warps=QUANT_WARPS,
    )
    launches.append(Launch(fp8_quant_kernel, grid, args, kwargs))
    return launches


def quantize_schedule(launch: Launch) -> Schedule:
    """The tiles each program of a quantiser launch visits: program ``p`` of ``P`` runs ``range(p, tiles, P)``
    ("tiles")."""
    tiles, n = launch.arg("n_tiles"), launch.num_ctas
    return Schedule(("tiles",), [[("tiles", range(p, tiles, n))] for p in range(n)])


def quantize(x: torch.Tensor, fmt: str, granularity: str, scale: torch.Tensor | None, transpose: bool):
    """``(q, scale, qt, scale_t)`` of a 2-D contiguous ``x`` (``ops.fp8.fp8_quantize``; empty ``(0,)`` qt and
    scale_t without transpose)."""
    _check_runnable("fp8_quantize", x)
    outputs = quantize_outputs(x, fmt, granularity, transpose)
    q, s, qt, st = outputs
    if x.numel() == 0:  # no tiles: a tensor scale is the given one or that of amax 0
        if granularity == "tensor":
            s.copy_(scale if scale is not None else torch.ones((), device=x.device))
            if transpose:
                st.copy_(s)
        return outputs
    amax = x.new_zeros((1,), dtype=torch.int32) if granularity == "tensor" and scale is None else None
    if scale is not None:
        scale = scale.contiguous()
    m, k = x.shape
    rows, cols = (-(-m // ALIGN) * ALIGN if transpose else m), -(-k // ALIGN) * ALIGN
    if (rows, cols) != (m, k):
        # The kernel's tiles need 16-element rows in x (K) and, with the transpose, in qᵀ (M): otherwise every
        # element of a thread's 64 needs its own address (no vector access) and registers spill. Quantise x zero-
        # padded to such a shape instead (zeros change no tile's maximum, and the padding stays inside the last
        # 128-wide tile, so the scales keep their shape), then copy out the unpadded parts.
        xp = torch.nn.functional.pad(x, (0, cols - k, 0, rows - m))
        if scale is not None and granularity == "row":
            scale = torch.nn.functional.pad(scale, (0, 0, 0, rows - m), value=1.0)
        padded = quantize_outputs(xp, fmt, granularity, transpose)
        for launch in quantize_launches(xp, fmt, granularity, scale, padded, amax):
            launch()
        qp, sp, qtp, stp = padded
        q.copy_(qp[:m, :k])
        s.copy_(sp[:m] if granularity == "row" else sp)
        if transpose:
            qt.copy_(qtp[:k, :m])
            st.copy_(stp[:k] if granularity == "row" else stp)
        return outputs
    for launch in quantize_launches(x, fmt, granularity, scale, outputs, amax):
        launch()
    return outputs


# ----------------------------------------------------------------------------------------------------------------
# GEMMs


def tma_eligible(*tensors: torch.Tensor) -> bool:
    """Whether TMA descriptors can address these K-contiguous FP8 operands: this Triton has them, every base is
    16-byte aligned, and each row is (K a multiple of 16 bytes)."""
    return supports_tma() and all(
        t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and t.shape[-1] % 16 == 0 and t.shape[-1] > 0 for t in tensors
    )


def _descriptor(t: torch.Tensor, rows: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    t2 = t.reshape(-1, t.shape[-1])
    return TensorDescriptor(t2, list(t2.shape), list(t2.stride()), [rows, TILE])


def _aligned_k(t: torch.Tensor) -> torch.Tensor:
    """An FP8 operand ``[..., K]`` with 16-byte aligned rows (what TMA needs, and vector loads): itself, or a copy
    with K zero-padded to a multiple of 16 (zeros add nothing to a product; the padding stays within K's last
    128-wide chunk, so the scales are unchanged)."""
    k = t.shape[-1]
    if k % ALIGN == 0 and t.data_ptr() % 16 == 0:
        return t
    pad = -(-k // ALIGN) * ALIGN - k
    return torch.nn.functional.pad(t.view(torch.uint8), (0, pad)).view(t.dtype)


def _b_gran(granularity: str) -> int:
    return _GRAN[granularity]


def _scale_stride(s: torch.Tensor, granularity: str) -> int:
    return s.shape[-1] if granularity in ("row", "block") else 0


def b_row_scales(b_scale: torch.Tensor) -> torch.Tensor:
    """B's 1x128-tile scales ``[N, chunks]`` as the GEMM kernel reads them: ``[chunks, N]`` contiguous."""
    return b_scale.t().contiguous()


def gemm_launch(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    a_granularity: str,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    b_granularity: str,
    out: torch.Tensor,
    cfg: tuple,
    tma: bool | None = None,
) -> Launch:
    """``out = a @ bᵀ`` with the scales' promotion: a ``[M, K]``, b ``[N, K]`` FP8, contiguous, their scales as
    ops.fp8 takes them except B's "row" scales, transposed (``b_row_scales``); ``cfg``: a ``GEMM_CONFIGS`` entry;
    ``tma``: operands through tensor descriptors (default: on sm_90 and under the interpreter, where
    ``tma_eligible``)."""
    bm, bn, warps, stages, group_m = cfg
    m, k = a.shape
    n = b.shape[0]
    if tma is None:
        tma = _has_tma(a) and tma_eligible(a, b)
    args = (
        _descriptor(a, bm) if tma else a,
        _descriptor(b, bn) if tma else b,
        out,
        a_scale,
        b_scale,
        m,
        n,
        k,
        a.stride(0),
        b.stride(0),
        out.stride(0),
        _scale_stride(a_scale, a_granularity),
        _scale_stride(b_scale, b_granularity),
    )
    kwargs = dict(
        A_ROW=a_granularity == "row",
        B_GRAN=_b_gran(b_granularity),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=TILE,
        GROUP_M=group_m,
        EVEN_K=k % TILE == 0,
        TMA=tma,
        num_warps=warps,
        num_stages=stages,
    )
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    return Launch(fp8_gemm_kernel, grid, args, kwargs)


def gemm_schedule(launch: Launch) -> Schedule:
    """Every program of a ``gemm_launch`` runs the K loop ``range(0, K, 128)`` ("k")."""
    loop = [("k", range(0, launch.arg("K"), launch.arg("BLOCK_K")))]
    return Schedule(("k",), [list(loop) for _ in range(launch.num_ctas)])


def _run_tuned(name: str, table: dict, interp: tuple, t: torch.Tensor, shape_key: tuple, make) -> None:
    arch = arch_of(t.device)
    cands = candidates(table, arch, interp)
    key = (name, arch, *shape_key)
    make(pick_config(key, cands, lambda cfg: make(cfg)()))()


def gemm(a, a_scale, a_granularity, b, b_scale, b_granularity, out_dtype):
    """``dequant(a) @ dequant(b)ᵀ`` in ``out_dtype`` (``ops.fp8.fp8_gemm``): a ``[M, K]``, b ``[N, K]`` FP8."""
    _check_runnable("fp8_gemm", a)
    m, k = a.shape
    n = b.shape[0]
    out = a.new_empty((m, n), dtype=out_dtype)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    a, b = _aligned_k(a), _aligned_k(b)
    a_scale = a_scale.contiguous()
    b_scale = b_row_scales(b_scale) if b_granularity == "row" else b_scale.contiguous()
    _run_tuned(
        "fp8_gemm",
        GEMM_CONFIGS,
        INTERPRETER_GEMM,
        a,
        (a.dtype, b.dtype, a_granularity, b_granularity, out_dtype, n, k, triton.next_power_of_2(m)),
        lambda cfg: gemm_launch(a, a_scale, a_granularity, b, b_scale, b_granularity, out, cfg),
    )
    return out


def grouped_launch(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    a_granularity: str,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    b_granularity: str,
    sizes: torch.Tensor,
    out: torch.Tensor,
    cfg: tuple,
    tma: bool | None = None,
) -> Launch:
    """``out[rows of e] = a[rows of e] @ b[e]ᵀ``: a ``[T, K]``, b ``[E, N, K]`` FP8 contiguous, ``sizes`` ``[E]`` on
    a's device; ``cfg``: a ``GROUPED_CONFIGS`` entry. Grid as the 16-bit grouped GEMM's: ``(cdiv(T, BLOCK_M) + E,
    cdiv(N, BLOCK_N))``."""
    bm, bn, warps, stages = cfg
    t, k = a.shape
    e, n = b.shape[0], b.shape[1]
    if tma is None:
        tma = _has_tma(a) and tma_eligible(a, b)
    args = (
        _descriptor(a, bm) if tma else a,
        _descriptor(b, bn) if tma else b,
        out,
        a_scale,
        b_scale,
        sizes,
        t,
        n,
        k,
        e,
        a.stride(0),
        b.stride(1),
        out.stride(0),
        _scale_stride(a_scale, a_granularity),
        _scale_stride(b_scale, b_granularity),
        b_scale.stride(0),
    )
    kwargs = dict(
        BLOCK_E=block_e(e),
        A_ROW=a_granularity == "row",
        B_GRAN=_b_gran(b_granularity),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=TILE,
        EVEN_K=k % TILE == 0,
        TMA=tma,
        num_warps=warps,
        num_stages=stages,
    )
    grid = (triton.cdiv(t, bm) + e, triton.cdiv(n, bn))
    return Launch(fp8_grouped_kernel, grid, args, kwargs)


def grouped_schedule(launch: Launch, group_sizes) -> Schedule:
    """The schedule of a ``grouped_launch`` for ``group_sizes`` (which the kernel reads on the device): row tile
    ``i`` (grid axis 0) belongs to the group whose ``cdiv(size, BLOCK_M)`` tiles cover it; a program past the last
    tile returns before its loop; every other runs ``range(0, K, 128)`` ("k")."""
    bm = launch.arg("BLOCK_M")
    tiles = sum(triton.cdiv(s, bm) for s in group_sizes_of(launch, group_sizes))
    loop = [("k", range(0, launch.arg("K"), launch.arg("BLOCK_K")))]
    return Schedule(("k",), [list(loop) if x < tiles else [] for x, _ in launch.program_ids()])


def grouped_gemm(a, a_scale, a_granularity, b, b_scale, b_granularity, group_sizes, out_dtype):
    """``out[rows of e] = dequant(a)[rows of e] @ dequant(b[e])ᵀ`` in ``out_dtype`` (``ops.fp8.fp8_grouped_gemm``);
    the group sizes are never read on the host."""
    _check_runnable("fp8_grouped_gemm", a)
    t, k = a.shape
    n = b.shape[1]
    out = a.new_empty((t, n), dtype=out_dtype)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    sizes = group_sizes.to(device=a.device, non_blocking=True)
    a, b = _aligned_k(a), _aligned_k(b)
    a_scale, b_scale = a_scale.contiguous(), b_scale.contiguous()
    _run_tuned(
        "fp8_grouped_gemm",
        GROUPED_CONFIGS,
        INTERPRETER_GROUPED,
        a,
        (a.dtype, b.dtype, a_granularity, b_granularity, out_dtype, b.shape[0], n, k),
        lambda cfg: grouped_launch(a, a_scale, a_granularity, b, b_scale, b_granularity, sizes, out, cfg),
    )
    return out
