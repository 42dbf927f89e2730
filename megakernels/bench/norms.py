"""Norm-family microbenchmarks: fused kernels vs PyTorch eager vs torch.compile of the same composition (+ peers).

    megakernels bench --ops layer_norm_gelu,layer_norm,rms_norm [--dtype float32,bfloat16]
                      [--shapes rows,hidden;...] [--device cpu|cuda] [--no-compile] [--quick] [--out DIR]

Prints one table per op (median time over calibrated repeats, effective GB/s and its fraction of the copy
bandwidth measured in the same run, speed-up vs eager, vs torch.compile and vs apex / Liger-Kernel when installed)
(DIR/bench.json and DIR/<op>.png). Never asserts on time. The pytest-benchmark suite
(benchmarks/test_bench_norms.py) times the same callables.

Bytes that must move: x read and y written forward; backward adds dy read, dx written and x read again (the
parameters and their gradients, one row each, are left out).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megakernels.bench import ceilings as ceil
from megakernels.bench.common import DTYPES, OURS, Request, TablePrinter, median_seconds, result_row, run_measure
from megakernels.bench.peers import Peers
from megakernels.ops import layer_norm, rms_norm

FAMILY = "norms"
SHAPES = [(8192, 1024), (4096, 4096), (2048, 12800)]
# On a GPU: 32M-105M elements (64-210 MB in bf16), past the 50 MB L2 of an H100/H200, all with rows >= 4k or so.
GPU_SHAPES = [(32768, 1024), (16384, 4096), (8192, 12800)]
QUICK_SHAPES = [(1024, 1024)]
DEFAULT_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Composition:
    """An op as the fused call and as the PyTorch composition a user would otherwise write."""

    name: str
    n_params: int
    fused: Callable
    eager: Callable


COMPOSITIONS = {
    "layer_norm_gelu": Composition(
        "layer_norm_gelu",
        2,
        lambda x, w, b: layer_norm(x, w, b, 1e-5, "gelu"),
        lambda x, w, b: F.gelu(F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)),
    ),
    "layer_norm": Composition(
        "layer_norm",
        2,
        lambda x, w, b: layer_norm(x, w, b, 1e-5),
        lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
    ),
    "rms_norm": Composition(
        "rms_norm",
        1,
        lambda x, w: rms_norm(x, w, 1e-6),
        lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6),
    ),
}
OPS = tuple(COMPOSITIONS)


def make_inputs(comp: Composition, shape, dtype, device="cpu", grad=False):
    """(x [rows, hidden], params (n_params vectors of hidden), dy like x), seeded, in ``dtype`` on ``device``."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype=dtype, device=device)
    params = [torch.randn(shape[-1], generator=g).to(dtype=dtype, device=device) for _ in range(comp.n_params)]
    dy = torch.randn(shape, generator=g).to(dtype=dtype, device=device)
    if grad:
        x.requires_grad_(True)
        for p in params:
            p.requires_grad_(True)
    return x, params, dy


def step_fn(fn: Callable, x, params, dy, backward: bool) -> Callable[[], None]:
    """A zero-argument callable running fn forward (and backward, grads dropped each call)."""
    if not backward:

        def fwd():
            with torch.no_grad():
                fn(x, *params)

        return fwd

    leaves = [x, *params]

    def fwd_bwd():
        out = fn(x, *params)
        torch.autograd.backward(out, dy, inputs=leaves)
        for t in leaves:
            t.grad = None

    return fwd_bwd


def suite_step(comp: Composition, impl: str, dtype_name: str, shape, backward: bool) -> Callable[[], None]:
    """The callable a pytest-benchmark suite times for ``impl`` (``common.IMPLS``) of ``comp`` on the CPU."""
    from megakernels.bench.common import implementation

    x, params, dy = make_inputs(comp, shape, DTYPES[dtype_name], grad=backward)
    return step_fn(implementation(comp, impl), x, params, dy, backward=backward)


def bytes_moved(comp: Composition, shape, dtype, backward: bool) -> int:
    """Bytes that must cross memory: x read + y written (+ dy read, dx written, x re-read in backward)."""
    elem = torch.finfo(dtype).bits // 8
    n = shape[0] * shape[1]
    return 2 * n * elem + (3 * n * elem if backward else 0)


def default_shapes(device: str, quick: bool):
    return QUICK_SHAPES if quick else (GPU_SHAPES if device == "cuda" else SHAPES)


def measure(
    ops,
    dtypes,
    shapes,
    *,
    device="cpu",
    with_compile=True,
    min_run_time=0.3,
    ceilings=None,
    peers: Peers | None = None,
    log=print,
    compositions=None,
    family=FAMILY,
) -> list[dict]:
    """Measure every (op, dtype, shape, fwd / fwd+bwd) of ``compositions`` (default: the norms'); returns the result
    rows (``common.result_row``), each printed through ``log`` as it is measured."""
    rows, table = [], TablePrinter(log)
    peers = peers or Peers(device, enabled=False)
    compositions = compositions or COMPOSITIONS
    for name in ops:
        comp = compositions[name]
        extra = peers.norm(name)
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            for shape in shapes:
                for backward in (False, True):
                    x, params, dy = make_inputs(comp, shape, dtype, device=device, grad=backward)
                    steps = {
                        OURS: step_fn(comp.fused, x, params, dy, backward),
                        "eager": step_fn(comp.eager, x, params, dy, backward),
                    }
                    times = {k: median_seconds(fn, min_run_time) for k, fn in steps.items()}
                    if with_compile:
                        torch._dynamo.reset()
                        compiled = torch.compile(comp.eager, dynamic=False)
                        times["compile"] = median_seconds(step_fn(compiled, x, params, dy, backward), min_run_time)
                    what = f"{name} {dtype_name} {shape[0]}x{shape[1]}"
                    for peer, fn in extra.items():
                        try:
                            times[peer] = median_seconds(step_fn(fn, x, params, dy, backward), min_run_time)
                        except Exception as e:  # a peer's failure is reported, not fatal
                            peers.failed(peer, what, e)
                    value, cname = ceil.for_unit(ceilings, "GB/s", dtype_name)
                    row = result_row(
                        name,
                        family,
                        dtype=dtype_name,
                        shape=f"{shape[0]}x{shape[1]}",
                        pass_="fwd+bwd" if backward else "fwd",
                        size=shape[0] * shape[1],
                        size_label="elements (rows x hidden)",
                        unit="GB/s",
                        work=bytes_moved(comp, shape, dtype, backward),
                        times=times,
                        ceiling=value,
                        ceiling_name=cname,
                        rows=shape[0],
                        hidden=shape[1],
                    )
                    rows.append(row)
                    table(row)
    return rows


def run(request: Request) -> list[dict]:
    """``megakernels bench`` for this family (``common.Request``)."""
    return run_measure(measure, request, DEFAULT_DTYPES, default_shapes)
