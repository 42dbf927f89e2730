"""FP8 GEMM microbenchmark, run by ``megakernels bench --ops fp8_gemm``: ``megakernels.ops.fp8_gemm`` (``a @ bᵀ`` of
FP8 operands quantised beforehand, out of the timed region) in both recipes of megakernels/ops/fp8.py —
``tensorwise`` (one scale per operand) and ``blockwise`` (1x128 tiles of ``a`` against 128x128 blocks of ``b``) —
against ``torch.matmul`` of the same product in bf16 (``matmul_bf16``: the 16-bit GEMM the FP8 one replaces) and,
on the CPU, in fp32 (``matmul_fp32``), all measured in the same run.

On a GPU ours is the Triton kernel on FP8 tensor cores (megakernels/triton/fp8.py) at Llama-3-8B's linear layers
over 8192 tokens, the shapes the static report prices (``megakernels bench --static --ops fp8_gemm``; the
``bench`` links of its rows name these rows, so scripts/gpu_check.sh's summary prints the prediction beside the
measurement). On the CPU ours is the op's CPU path, ``ops.fp8.gemm_reference``: the operands dequantised to fp32
and one fp32 GEMM, so the ratio to ``matmul_fp32`` is the cost of the dequantisation. Work: ``2·M·N·K`` FLOPs;
``% ceil`` is of the GEMM rate of the output dtype measured at the start (bf16 on a GPU: FP8 tensor cores can reach
about twice it). ``--dtype`` picks the output dtype (default bfloat16); operands are e4m3. ``--shapes`` takes
``m,n,k``. Never asserts on time.
"""

from __future__ import annotations

import torch

from megakernels.bench import ceilings as ceil
from megakernels.bench.common import DTYPES, OURS, Request, TablePrinter, median_seconds, result_row, run_measure
from megakernels.ops import fp8

FAMILY = "fp8"
SHAPES = [(1024, 1024, 1024), (512, 3584, 1024)]  # (m, n, k): scaled down for the CPU
GPU_SHAPES = [(8192, 6144, 4096), (8192, 14336, 4096), (8192, 4096, 14336)]  # the static report's FP8 GEMMs
QUICK_SHAPES = [(64, 96, 320)]  # K not a multiple of 128
DEFAULT_DTYPES = ("bfloat16",)
# recipe -> (activation, weight) granularity
RECIPES = {name: (r.input_granularity, r.weight_granularity) for name, r in fp8.RECIPES.items()}
FORMAT = "e4m3"


def default_shapes(device: str, quick: bool):
    return QUICK_SHAPES if quick else (GPU_SHAPES if device == "cuda" else SHAPES)


def make_inputs(shape, device: str = "cpu"):
    """(a ``[m, k]``, b ``[n, k]``) bf16, seeded, with the spread of activations and weights."""
    m, n, k = shape
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn((m, k), generator=g, device=device).to(torch.bfloat16)
    b = (torch.randn((n, k), generator=g, device=device) * k**-0.5).to(torch.bfloat16)
    return a, b


def quantized(a: torch.Tensor, b: torch.Tensor, recipe: str):
    """``(qa, sa, qb, sb)``: the operands quantised as ``recipe`` quantises an activation and a weight."""
    ga, gb = RECIPES[recipe]
    qa, sa, _, _ = fp8.fp8_quantize(a, FORMAT, ga)
    qb, sb, _, _ = fp8.fp8_quantize(b, FORMAT, gb)
    return qa, sa, qb, sb


def implementations(a, b, recipe: str, out_dtype: torch.dtype, device: str) -> dict:
    """Zero-argument callables: ours (``fp8_gemm`` on the quantised operands) and the matmul baselines."""
    ga, gb = RECIPES[recipe]
    qa, sa, qb, sb = quantized(a, b, recipe)
    bt = b.t()
    impls = {
        OURS: lambda: fp8.fp8_gemm(qa, sa, qb, sb, a_granularity=ga, b_granularity=gb, out_dtype=out_dtype),
        "matmul_bf16": lambda: torch.matmul(a, bt),
    }
    if device == "cpu":
        af, bft = a.float(), b.float().t()
        impls["matmul_fp32"] = lambda: torch.matmul(af, bft)
    return impls


def measure(
    ops, dtypes, shapes, *, device="cpu", with_compile=True, min_run_time=0.3, ceilings=None, log=print, peers=None
) -> list[dict]:
    """Every (output dtype, shape, recipe) of ``fp8_gemm`` against the matmul baselines; ``with_compile`` and
    ``peers`` are taken for the common signature and unused."""
    rows, table = [], TablePrinter(log)
    if "fp8_gemm" not in ops:
        return rows
    for dtype_name in dtypes:
        out_dtype = DTYPES[dtype_name]
        value, cname = ceil.for_unit(ceilings, "TFLOP/s", "bfloat16" if device == "cuda" else "float32")
        for shape in shapes or default_shapes(device, False):
            a, b = make_inputs(shape, device)
            for recipe in RECIPES:
                impls = implementations(a, b, recipe, out_dtype, device)
                times = {name: median_seconds(fn, min_run_time) for name, fn in impls.items()}
                m, n, k = shape
                row = result_row(
                    "fp8_gemm",
                    FAMILY,
                    dtype=FORMAT,
                    shape=f"{m}x{n}x{k}",
                    pass_="fwd",
                    variant=recipe,
                    size=m * n * k,
                    size_label="m x n x k",
                    unit="TFLOP/s",
                    work=2.0 * m * n * k,
                    times=times,
                    ceiling=value,
                    ceiling_name=cname,
                    out_dtype=dtype_name,
                )
                rows.append(row)
                table(row)
    return rows


def run(request: Request) -> list[dict]:
    """``megakernels bench`` for this family (``common.Request``)."""
    return run_measure(measure, request, DEFAULT_DTYPES, default_shapes)
