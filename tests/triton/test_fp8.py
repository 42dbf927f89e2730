"""The FP8 Triton kernels (megakernels/triton/fp8.py) against megakernels/ops/fp8.py's references.

Under Triton's interpreter (CPU, ``TRITON_INTERPRET=1``, set by tests/conftest.py without a GPU):

- its FP8 casts are wrong (fp32 -124.0 rounds to e4m3 -64.0; e5m2 subnormals widen to zero), so this module
  installs ``install_interpreter_fp8_casts()`` (exact, saturating, as sm_90's ``cvt.rn.satfinite``) and checks it;
- its FP8 ``tl.dot`` is right once the casts are: it widens both operands to fp16 (exact for e4m3 and e5m2) and
  multiplies in fp32, so the GEMMs run whole here, the fp32 accumulation in numpy's order (the tensor cores'
  limited-precision accumulation within a 128-wide chunk is the GPU tests' business; its fp32 -> bf16 cast
  truncates, so a bf16 output is allowed a whole ulp);
- the quantiser is bit-identical to ``quantize_reference`` (q, qᵀ and scales, every granularity and format, odd
  shapes, zero tiles, subnormal, huge and non-finite values, given scales of any value);
- the GEMMs are within fp32-accumulation-order tolerance of ``gemm_reference`` for every granularity pair, both
  operand paths (TMA descriptors, masked pointers), K not a multiple of 128, wide tiles (block scales as a vector);
- the schedules beside the launchers are the loops the kernels run; ``torch.library.opcheck`` passes on the three
  ops under backend cuda_emu.

Compiled for sm_90 without a GPU (tests/costmodel/fp8_sm90.py in a subprocess): no spills, shared memory within a
block's limit, the GEMMs on FP8 wgmma (QGMMA), the casts saturating. On a GPU (``cuda``): bit-identical
quantisation and the GEMMs against the CPU references.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import megakernels  # noqa: E402
from megakernels.ops import fp8 as ops  # noqa: E402
from megakernels.triton import install_interpreter_fp8_casts, interpreting  # noqa: E402

FORMATS = ("e4m3", "e5m2")
GRANULARITIES = ("tensor", "row", "block")
GEMM_PAIRS = [("tensor", "tensor"), ("row", "block"), ("row", "row"), ("tensor", "row"), ("tensor", "block"),
              ("row", "tensor")]  # fmt: skip
interp = pytest.mark.skipif(not interpreting(), reason="needs Triton's interpreter (TRITON_INTERPRET=1)")
# non-finite tiles on purpose (inf / inf, x / 0): numpy, running the interpreted kernels, says so
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
]

if interpreting():
    install_interpreter_fp8_casts()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, NaNs equal whatever their payload (the scales of a non-finite tile)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        an, bn = torch.isnan(a.float()), torch.isnan(b.float())
        return torch.equal(an, bn) and torch.equal(_bits(a)[~an], _bits(b)[~bn])
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _reference(x, fmt, granularity, scale=None, transpose=True):
    q, s = ops.quantize_reference(x, fmt, granularity, scale)
    if not transpose:
        return q, s, None, None
    if granularity == "row":
        qt, st = ops.quantize_reference(x.t(), fmt, "row")
    else:
        qt, st = q.t().contiguous(), s.t().contiguous() if granularity == "block" else s
    return q, s, qt, st


def _check_quantize(x, fmt, granularity, scale=None, transpose=True, device=None):
    from megakernels.triton import fp8

    got = fp8.quantize(x if device is None else x.to(device), fmt, granularity, scale, transpose)
    want = _reference(x, fmt, granularity, None if scale is None else scale.cpu(), transpose)
    what = f"{fmt} {granularity} {tuple(x.shape)} {x.dtype} scale={'given' if scale is not None else 'computed'}"
    for name, g, w in zip(("q", "scale", "qt", "scale_t"), got, want):
        if w is None:
            assert g.shape == (0,), f"{what}: {name} without transpose has shape {tuple(g.shape)}"
        else:
            assert _same(g.cpu(), w), f"{what}: {name} differs from quantize_reference"


def _values(shape, dtype, seed=0):
    """Values over many binades, with some rows and 128x128 tiles of zeros."""
    g = torch.Generator().manual_seed(seed)
    m, k = shape
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, (m, 1), generator=g).float())
    if m > 2:
        x[1] = 0.0
    if m > 128 and k > 128:
        x[128:, 128:256] = 0.0
    return x.to(dtype)


# ---- the interpreter's casts ------------------------------------------------------------------------------------


@interp
@pytest.mark.parametrize("fmt", FORMATS)
def test_interpreter_casts_round_to_nearest_even_and_saturate(fmt):
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    dtype = ops.FORMATS[fmt]
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, torch.nextafter(mids, grid[1:]), torch.nextafter(mids, grid[:-1]), torch.randn(1000)])
    x = torch.cat([x, torch.tensor([1e9, -1e9, float("inf"), float("-inf"), float("nan")])])
    tt = tl.float8e4nv if fmt == "e4m3" else tl.float8e5
    got = interpreter._convert_float(x.numpy(), tl.float32, tt, None)
    want = x.clamp(-ops.FORMAT_MAX[fmt], ops.FORMAT_MAX[fmt]).to(dtype)  # clamp keeps NaN
    assert _same(torch.from_numpy(got.astype(np.uint8)).view(dtype), want)
    back = interpreter._convert_float(got, tt, tl.float16, None).view(np.float16)
    assert _same(torch.from_numpy(back.copy()).float().to(dtype), want)  # widening is exact, subnormals included


@interp
def test_kernels_refuse_the_interpreters_own_casts(monkeypatch):
    from megakernels.triton import fp8

    monkeypatch.setattr(fp8, "interpreter_fp8_casts_installed", lambda: False)
    with pytest.raises(RuntimeError, match="install_interpreter_fp8_casts"):
        fp8.quantize(torch.ones(2, 2), "e4m3", "tensor", None, False)


# ---- quantisation -------------------------------------------------------------------------------------------------


@interp
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(1, 1), (7, 5), (130, 260), (256, 128), (129, 385)])
def test_quantize_is_bit_identical_to_the_reference(shape, fmt, granularity):
    x = _values(shape, torch.float32)
    _check_quantize(x, fmt, granularity, transpose=True)
    _check_quantize(x, fmt, granularity, transpose=False)


@interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_quantize_16_bit_inputs(dtype, granularity):
    _check_quantize(_values((140, 200), dtype, seed=1), "e4m3", granularity)


@interp
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_quantize_extreme_and_non_finite_values(granularity):
    x = _values((130, 140), torch.float32, seed=2)
    x[0, :3] = torch.tensor([1e-40, -3e-39, 2e-45])  # subnormal fp32: tiles whose amax is subnormal
    x[2:4] = 1e-44
    x[5, 7] = 3.0e38  # near fp32's max: the largest scales
    x[6, 0] = 448.0  # exactly e4m3's max (frexp mantissa 0.875)
    x[129, 139] = float("inf")
    x[7, 130] = float("nan")
    x[8, 9] = float("-inf")
    for fmt in FORMATS:
        _check_quantize(x, fmt, granularity)


@interp
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_quantize_with_given_scales_of_any_value(granularity):
    x = _values((131, 260), torch.float32, seed=3)
    shape = ops.scale_shape(x.shape, granularity)
    pow2 = torch.exp2(torch.randint(-8, 8, shape).float())
    _check_quantize(x, "e4m3", granularity, scale=pow2)
    odd = pow2 * 1.37  # not powers of two: the kernel divides (IEEE) as the CPU does
    if odd.dim():
        odd.view(-1)[0] = 0.0  # a zero scale: inf, then saturated
        odd.view(-1)[-1] = float("inf")
    _check_quantize(x, "e5m2", granularity, scale=odd)


@interp
@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0, 0)])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_quantize_empty(shape, granularity):
    _check_quantize(torch.zeros(shape), "e4m3", granularity)
    _check_quantize(torch.zeros(shape), "e4m3", granularity, transpose=False)


@interp
def test_quantize_through_the_op_under_cuda_emu():
    x = _values((70, 300), torch.bfloat16, seed=4)
    want = _reference(x, "e4m3", "row")
    with megakernels.backend("cuda_emu"):
        got = ops.fp8_quantize(x, "e4m3", "row", transpose=True)
    assert all(_same(g, w) for g, w in zip(got, want))


# ---- GEMMs ---------------------------------------------------------------------------------------------------------


def _operands(m, n, k, fa, fb, ga, gb, seed=0, device=None):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-6, 6, (1, k), generator=g).float())
    b = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-6, 6, (n, 1), generator=g).float())
    qa, sa = ops.quantize_reference(a, fa, ga)
    qb, sb = ops.quantize_reference(b, fb, gb)
    if device is not None:
        qa, sa, qb, sb = qa.to(device), sa.to(device), qb.to(device), sb.to(device)
    return qa, sa, qb, sb


def _assert_gemm_close(got, qa, sa, ga, qb, sb, gb, out_dtype, rel=2e-6, what=""):
    """``|got - ref| <= rel * (|A| |B|ᵀ) + (the output dtype's rounding of ref)``, A and B dequantised: the bound of
    an fp32 sum of K products taken in another order (``rel``: about K fp32 ulps), then cast."""
    da, db = ops.dequantize(qa.cpu(), sa.cpu(), ga), ops.dequantize(qb.cpu(), sb.cpu(), gb)
    want = (da.double() @ db.double().t()).float()
    bound = rel * (da.abs().double() @ db.abs().double().t()).float()
    # the output's rounding: half an ulp, but a whole one for bf16 (the interpreter's fp32 -> bf16 cast truncates)
    eps = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-11}[out_dtype]
    got = got.cpu().float()
    err = (got - want).abs()
    tol = bound + eps * want.abs() + 1e-30
    assert got.shape == want.shape, what
    assert (err <= tol).all(), f"{what}: max error {err.max():.3g} ({(err / tol).max():.3g} x the bound)"


@interp
@pytest.mark.parametrize("ga, gb", GEMM_PAIRS)
@pytest.mark.parametrize("formats", [("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e4m3", "e5m2")])
@pytest.mark.parametrize("m, n, k", [(37, 70, 300), (64, 96, 256), (5, 3, 17)])
def test_gemm_matches_the_reference(m, n, k, formats, ga, gb):
    from megakernels.triton import fp8

    qa, sa, qb, sb = _operands(m, n, k, *formats, ga, gb)
    out = fp8.gemm(qa, sa, ga, qb, sb, gb, torch.float32)
    _assert_gemm_close(out, qa, sa, ga, qb, sb, gb, torch.float32, what=f"{m}x{n}x{k} {formats} {ga}/{gb}")


@interp
@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("cfg", [(16, 32, 4, 1, 2), (32, 256, 4, 1, 1), (16, 64, 4, 1, 8)])
@pytest.mark.parametrize("ga, gb", [("row", "block"), ("row", "row"), ("tensor", "tensor")])
def test_gemm_operand_paths_and_tile_shapes(tma, cfg, ga, gb):
    """Descriptor and pointer loads; tiles narrower than a 128-column block of B (one scale a tile) and wider (a
    vector of them); row-tile groups over a grid that does not divide."""
    from megakernels.triton import fp8

    m, n, k = 70, 400, 384
    qa, sa, qb, sb = _operands(m, n, k, "e4m3", "e4m3", ga, gb, seed=1)
    out = torch.full((m, n), float("nan"))
    bs = fp8.b_row_scales(sb) if gb == "row" else sb
    launch = fp8.gemm_launch(qa, sa, ga, qb, bs, gb, out, cfg, tma=tma)
    assert launch.kwargs["TMA"] is tma
    launch()
    _assert_gemm_close(out, qa, sa, ga, qb, sb, gb, torch.float32, what=f"{cfg} tma={tma}")


@interp
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_gemm_output_dtypes_through_the_op(out_dtype):
    qa, sa, qb, sb = _operands(33, 40, 200, "e4m3", "e4m3", "row", "block", seed=2)
    with megakernels.backend("cuda_emu"):
        out = ops.fp8_gemm(qa, sa, qb, sb, a_granularity="row", b_granularity="block", out_dtype=out_dtype)
    assert out.dtype == out_dtype
    _assert_gemm_close(out, qa, sa, "row", qb, sb, "block", out_dtype)


@interp
def test_gemm_empty_and_k_zero():
    from megakernels.triton import fp8

    qa, sa, qb, sb = _operands(4, 3, 0, "e4m3", "e4m3", "tensor", "tensor")
    assert torch.equal(fp8.gemm(qa, sa, "tensor", qb, sb, "tensor", torch.float32), torch.zeros(4, 3))
    qa, sa, qb, sb = _operands(0, 3, 16, "e4m3", "e4m3", "row", "block")
    assert fp8.gemm(qa, sa, "row", qb, sb, "block", torch.bfloat16).shape == (0, 3)


def _grouped_operands(sizes, n, k, ga, gb, seed=0):
    g = torch.Generator().manual_seed(seed)
    t, e = sum(sizes), len(sizes)
    a = torch.randn(t, k, generator=g)
    w = torch.randn(e, n, k, generator=g) * torch.exp2(torch.randint(-4, 4, (e, 1, 1), generator=g).float())
    qa, sa = ops.quantize_reference(a, "e4m3", ga)
    pairs = [ops.quantize_reference(w[i], "e4m3", gb) for i in range(e)]
    return qa, sa, torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def _assert_grouped_close(out, qa, sa, ga, qb, sb, gb, sizes, out_dtype, rel=2e-6):
    start = 0
    for e, size in enumerate(sizes):
        rows = slice(start, start + size)
        a_scale = sa if ga == "tensor" else sa[rows]
        _assert_gemm_close(out[rows], qa[rows], a_scale, ga, qb[e], sb[e], gb, out_dtype, rel, what=f"group {e}")
        start += size


@interp
@pytest.mark.parametrize("ga, gb", [("tensor", "tensor"), ("row", "block"), ("row", "tensor"), ("tensor", "block")])
@pytest.mark.parametrize("sizes", [[40, 0, 17, 70], [0, 0, 9], [5]])
@pytest.mark.parametrize("k", [256, 200])
def test_grouped_gemm_matches_the_reference(sizes, ga, gb, k):
    from megakernels.triton import fp8

    qa, sa, qb, sb = _grouped_operands(sizes, 70, k, ga, gb)
    for dtype in (torch.int64, torch.int32):
        out = fp8.grouped_gemm(qa, sa, ga, qb, sb, gb, torch.tensor(sizes, dtype=dtype), torch.float32)
        _assert_grouped_close(out, qa, sa, ga, qb, sb, gb, sizes, torch.float32)


@interp
@pytest.mark.parametrize("tma", [True, False])
def test_grouped_gemm_operand_paths_through_the_op(tma, monkeypatch):
    from megakernels.triton import fp8

    monkeypatch.setattr(fp8, "tma_eligible", lambda *t: tma)
    sizes = [33, 0, 64, 1]
    qa, sa, qb, sb = _grouped_operands(sizes, 150, 256, "row", "block", seed=5)
    with megakernels.backend("cuda_emu"):
        out = ops.fp8_grouped_gemm(
            qa, sa, qb, sb, torch.tensor(sizes), a_granularity="row", b_granularity="block", out_dtype=torch.bfloat16
        )
    _assert_grouped_close(out, qa, sa, "row", qb, sb, "block", sizes, torch.bfloat16)


# ---- schedules and opcheck -----------------------------------------------------------------------------------------


@interp
def test_schedules_are_the_loops_the_kernels_run(monkeypatch):
    from megakernels.triton import _fp8_gemm, _fp8_quant, fp8
    from tests.triton.test_schedules import LoopRecorder, _assert_schedule

    rec = LoopRecorder(monkeypatch, [_fp8_gemm, _fp8_quant])
    qa, sa, qb, sb = _operands(40, 70, 300, "e4m3", "e4m3", "row", "block")
    launch = fp8.gemm_launch(qa, sa, "row", qb, sb, "block", torch.empty(40, 70), fp8.INTERPRETER_GEMM)
    _assert_schedule(launch, fp8.gemm_schedule(launch), rec.run(launch))
    sizes = [20, 0, 17, 3]
    qa, sa, qb, sb = _grouped_operands(sizes, 40, 130, "tensor", "tensor")
    launch = fp8.grouped_launch(
        qa, sa, "tensor", qb, sb, "tensor", torch.tensor(sizes), torch.empty(40, 40), fp8.INTERPRETER_GROUPED
    )
    _assert_schedule(launch, fp8.grouped_schedule(launch, sizes), rec.run(launch))
    x = torch.randn(300, 270)
    outputs = fp8.quantize_outputs(x, "e4m3", "tensor", True)
    for launch in fp8.quantize_launches(x, "e4m3", "tensor", None, outputs, torch.zeros(1, dtype=torch.int32)):
        _assert_schedule(launch, fp8.quantize_schedule(launch), rec.run(launch))


@interp
def test_opcheck_under_cuda_emu():
    x = torch.randn(20, 140)
    for granularity in GRANULARITIES:
        torch.library.opcheck(torch.ops.megakernels.fp8_quantize, (x, "e4m3", granularity, None, True, True))
    scale = torch.tensor(0.5)
    torch.library.opcheck(torch.ops.megakernels.fp8_quantize, (x, "e5m2", "tensor", scale, False, True))
    # the GEMM ops take FP8 operands as their bytes and the formats as a string (ops/fp8.py)
    qa, sa, qb, sb = _operands(9, 12, 140, "e5m2", "e4m3", "row", "block")
    args = (qa.view(torch.uint8), sa, "row", qb.view(torch.uint8), sb, "block", torch.bfloat16, "e5m2,e4m3", True)
    torch.library.opcheck(torch.ops.megakernels.fp8_gemm, args)
    sizes = [4, 0, 5]
    qa, sa, qb, sb = _grouped_operands(sizes, 12, 140, "tensor", "tensor")
    args = (qa.view(torch.uint8), sa, "tensor", qb.view(torch.uint8), sb, "tensor", torch.tensor(sizes))
    torch.library.opcheck(torch.ops.megakernels.fp8_grouped_gemm, (*args, torch.float32, "e4m3,e4m3", True))


# ---- compiled for sm_90 (no GPU) -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sm90_rows():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.costmodel.fp8_sm90"], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_sm90_compiles_without_spills_within_shared_memory(sm90_rows):
    from megakernels.machines import ARCHS

    assert len(sm90_rows) > 20
    assert [r for r in sm90_rows if r["spill_bytes"]] == []
    assert [r for r in sm90_rows if r["shared_bytes"] > ARCHS[90].smem_per_block] == []


def test_sm90_gemms_run_on_fp8_wgmma(sm90_rows):
    gemms = [r for r in sm90_rows if r["kernel"] in ("gemm", "grouped")]
    assert gemms and all(r["mma"] == "wgmma" and r["qgmma"] for r in gemms), [r for r in gemms if not r["qgmma"]]
    mixed = [r for r in gemms if r["formats"] == ["e5m2", "e4m3"]]
    assert mixed and all("E5M2.E4M3" in op for r in mixed for op in r["qgmma"])


def test_sm90_casts_to_fp8_saturate(sm90_rows):
    quant = [r for r in sm90_rows if r["kernel"] == "quantize"]
    assert quant and all(r["cvt"] and all(".satfinite" in c for c in r["cvt"]) for r in quant)


# ---- on a GPU ------------------------------------------------------------------------------------------------------


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return torch.device("cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_quantize_is_bit_identical_to_the_cpu(fmt, granularity):
    dev = _cuda()
    for shape, dtype in (((1, 1), torch.float32), ((129, 385), torch.bfloat16), ((4096, 1024), torch.bfloat16)):
        x = _values(shape, dtype)
        _check_quantize(x, fmt, granularity, device=dev)
        _check_quantize(x, fmt, granularity, transpose=False, device=dev)
        scale = torch.exp2(torch.randint(-8, 8, ops.scale_shape(shape, granularity)).float()) * 1.37
        _check_quantize(x, fmt, granularity, scale=scale.to(dev), device=dev)


@pytest.mark.cuda
@pytest.mark.parametrize("ga, gb", GEMM_PAIRS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_cuda_gemm_matches_the_reference(ga, gb, out_dtype):
    """Tolerance: the FP8 tensor cores accumulate a chunk's 128 products with fewer bits than fp32 (the reason
    for the promotion), about 2^-13 of the sum of magnitudes."""
    _cuda()
    for m, n, k, formats in ((300, 260, 1000, ("e4m3", "e4m3")), (1024, 512, 4096, ("e5m2", "e4m3"))):
        qa, sa, qb, sb = _operands(m, n, k, *formats, ga, gb, device="cuda")
        out = ops.fp8_gemm(qa, sa, qb, sb, a_granularity=ga, b_granularity=gb, out_dtype=out_dtype)
        _assert_gemm_close(out, qa, sa, ga, qb, sb, gb, out_dtype, rel=2.0**-12, what=f"{m}x{n}x{k} {formats}")


@pytest.mark.cuda
@pytest.mark.parametrize("ga, gb", [("tensor", "tensor"), ("row", "block")])
def test_cuda_grouped_gemm_matches_the_reference_without_a_host_sync(ga, gb):
    _cuda()
    sizes = [300, 0, 129, 1000, 77]
    qa, sa, qb, sb = _grouped_operands(sizes, 384, 512, ga, gb)
    qa, sa, qb, sb = qa.cuda(), sa.cuda(), qb.cuda(), sb.cuda()
    g = torch.tensor(sizes, device="cuda")
    ops.fp8_grouped_gemm(qa, sa, qb, sb, g, a_granularity=ga, b_granularity=gb)  # compile and tune first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = ops.fp8_grouped_gemm(qa, sa, qb, sb, g, a_granularity=ga, b_granularity=gb)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _assert_grouped_close(out, qa, sa, ga, qb, sb, gb, sizes, torch.bfloat16, rel=2.0**-12)
