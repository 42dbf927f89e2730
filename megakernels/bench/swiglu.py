"""SwiGLU microbenchmark: the fused op vs PyTorch eager vs torch.compile of ``silu(x[..., :f]) * x[..., f:]``, run by
``megakernels bench --ops swiglu``.

Shapes: Llama-3-8B's MLP width f = 14336 (the packed gate/up projection output is ``[rows, 2f]``), scaled down in
rows for this machine. Bytes that must move: forward x read (2f) and y written (f); backward x and dy read (3f),
dx written (2f). Never asserts on time; the pytest-benchmark suite (benchmarks/test_bench_llama.py) times the
same callables.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megakernels.bench import ceilings as ceil
from megakernels.bench.common import DTYPES, OURS, Request, TablePrinter, median_seconds, result_row, run_measure
from megakernels.ops import swiglu

FAMILY = "swiglu"
SHAPES = [(256, 14336), (1024, 14336)]  # (rows, f)
GPU_SHAPES = [(8192, 14336), (32768, 3584)]  # Llama-8B at tp 1 and tp 4
QUICK_SHAPES = [(64, 512)]
DEFAULT_DTYPES = ("float32", "bfloat16")


def _eager(x):
    f = x.shape[-1] // 2
    return F.silu(x[..., :f]) * x[..., f:]


@dataclasses.dataclass(frozen=True)
class Composition:
    fused: Callable
    eager: Callable


COMPOSITION = Composition(swiglu, _eager)


def make_inputs(shape, dtype, grad=False, device="cpu"):
    """(x ``[rows, 2f]``, dy ``[rows, f]``) seeded, in ``dtype`` on ``device``."""
    rows, f = shape
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn((rows, 2 * f), generator=g, device=device).to(dtype).requires_grad_(grad)
    return x, torch.randn((rows, f), generator=g, device=device).to(dtype)


def step_fn(fn: Callable, x, dy, backward: bool) -> Callable[[], None]:
    """A zero-argument callable running ``fn`` forward (and backward, the grad dropped each call)."""
    if not backward:

        def fwd():
            with torch.no_grad():
                fn(x)

        return fwd

    def fwd_bwd():
        torch.autograd.backward(fn(x), dy, inputs=[x])
        x.grad = None

    return fwd_bwd


def bytes_moved(shape, dtype, backward: bool) -> int:
    rows, f = shape
    unit = rows * f * (torch.finfo(dtype).bits // 8)
    return 3 * unit + (5 * unit if backward else 0)


def default_shapes(device: str, quick: bool):
    return QUICK_SHAPES if quick else (GPU_SHAPES if device == "cuda" else SHAPES)


def measure(
    ops, dtypes, shapes, *, device="cpu", with_compile=True, min_run_time=0.3, ceilings=None, log=print, peers=None
) -> list[dict]:
    """Measure every (dtype, shape, fwd / fwd+bwd). ``ops`` is ``["swiglu"]`` (the bench CLI's uniform signature);
    ``peers`` is unused. Returns the result rows."""
    rows, table = [], TablePrinter(log)
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        for shape in shapes:
            for backward in (False, True):
                x, dy = make_inputs(shape, dtype, grad=backward, device=device)
                times = {
                    OURS: median_seconds(step_fn(swiglu, x, dy, backward), min_run_time),
                    "eager": median_seconds(step_fn(_eager, x, dy, backward), min_run_time),
                }
                if with_compile:
                    torch._dynamo.reset()
                    times["compile"] = median_seconds(
                        step_fn(torch.compile(_eager, dynamic=False), x, dy, backward), min_run_time
                    )
                value, cname = ceil.for_unit(ceilings, "GB/s", dtype_name)
                row = result_row(
                    "swiglu",
                    FAMILY,
                    dtype=dtype_name,
                    shape=f"{shape[0]}x{2 * shape[1]}",
                    pass_="fwd+bwd" if backward else "fwd",
                    size=shape[0] * shape[1],
                    size_label="outputs (rows x f)",
                    unit="GB/s",
                    work=bytes_moved(shape, dtype, backward),
                    times=times,
                    ceiling=value,
                    ceiling_name=cname,
                    rows=shape[0],
                    f=shape[1],
                )
                rows.append(row)
                table(row)
    return rows


def run(request: Request) -> list[dict]:
    """``megakernels bench`` for this family (``common.Request``)."""
    return run_measure(measure, request, DEFAULT_DTYPES, default_shapes)
