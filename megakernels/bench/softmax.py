"""Softmax-family microbenchmarks: fused kernels vs PyTorch eager vs torch.compile of the same composition.

    megakernels bench --ops softmax [--dtype float32,bfloat16] [--shapes b,h,sq,sk;...] [--device cpu|cuda]
                      [--no-compile] [--quick] [--out DIR]

The eager composition is what a user would otherwise write for attention scores x [b, heads, sq, sk]:
``torch.softmax((x * scale).masked_fill(mask, -inf), -1)`` (the causal mask is built once, outside the timing).
Prints one table per op (median time over calibrated repeats, effective GB/s and its fraction of the copy
bandwidth, speed-up vs eager and vs torch.compile, all measured in the same run) (DIR/bench.json and DIR/<op>.png).
Never asserts on time. The pytest-benchmark suite (benchmarks/test_bench_softmax.py) times the same
callables.

Bytes that must move, forward: x read and y written; backward: y and dy read, dx written. For the causal op only
the kept (lower, bottom-right aligned) part of x, y and dy must be read; every output is written in full.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from megakernels.bench import ceilings as ceil
from megakernels.bench.common import DTYPES, OURS, Request, TablePrinter, median_seconds, result_row, run_measure
from megakernels.ops import scaled_causal_softmax, scaled_masked_softmax, scaled_softmax
from megakernels.ops.softmax import causal_mask

FAMILY = "softmax"
SCALE = 0.125
# [b, heads, sq, sk]: 16M scores (64 MiB in fp32) each, from short to long rows.
SHAPES = [(4, 16, 512, 512), (1, 16, 1024, 1024), (1, 8, 512, 4096), (1, 2, 512, 16384)]
QUICK_SHAPES = [(2, 4, 64, 128)]
# On a GPU: 256M scores per shape (512 MiB in bf16, far past L2), from Megatron's short rows to long-context ones.
GPU_SHAPES = [(8, 32, 1024, 1024), (2, 32, 1024, 4096), (1, 16, 1024, 16384), (1, 4, 1024, 65536)]
DEFAULT_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Composition:
    """An op as the fused call and as the eager composition; both take (x, mask)."""

    name: str  # short name (this script's --ops)
    op: str  # the op's name in megakernels.ops (megakernels bench --ops)
    fused: Callable
    eager: Callable
    mask: Callable  # mask(shape) -> bool tensor or None


def _eager(x, mask):
    z = x * SCALE
    if mask is not None:
        z = z.masked_fill(mask, float("-inf"))
    return torch.softmax(z, -1)


def _padding_mask(shape):
    """A [b, 1, 1, sk] key-padding mask (broadcast over heads and queries), every row keeping >= 1/4 of the keys."""
    b, _, _, sk = shape
    g = torch.Generator().manual_seed(0)
    keep = torch.randint(sk // 4 + 1, sk + 1, (b,), generator=g)
    return (torch.arange(sk)[None, :] >= keep[:, None]).view(b, 1, 1, sk)


COMPOSITIONS = {
    "scaled": Composition("scaled", "scaled_softmax", lambda x, m: scaled_softmax(x, SCALE), _eager, lambda s: None),
    "masked": Composition(
        "masked", "scaled_masked_softmax", lambda x, m: scaled_masked_softmax(x, m, SCALE), _eager, _padding_mask
    ),
    "causal": Composition(
        "causal",
        "scaled_causal_softmax",
        lambda x, m: scaled_causal_softmax(x, SCALE),
        _eager,
        lambda s: causal_mask(s[-2], s[-1]),
    ),
}
OPS = {c.op: c.name for c in COMPOSITIONS.values()}  # op name -> short name


def make_inputs(comp: Composition, shape, dtype, grad=False, device="cpu"):
    """(x [b, h, sq, sk] scaled up to give peaked rows, mask or None, dy like x) in ``dtype`` on ``device``."""
    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(shape, generator=g, device=device) * 4).to(dtype)
    dy = torch.randn(shape, generator=g, device=device).to(dtype)
    if grad:
        x.requires_grad_(True)
    mask = comp.mask(shape)
    return x, (mask.to(device) if mask is not None else None), dy


def step_fn(fn: Callable, x, mask, dy, backward: bool) -> Callable[[], None]:
    """A zero-argument callable running fn forward (and backward, the grad dropped each call)."""
    if not backward:

        def fwd():
            with torch.no_grad():
                fn(x, mask)

        return fwd

    def fwd_bwd():
        out = fn(x, mask)
        torch.autograd.backward(out, dy, inputs=[x])
        x.grad = None

    return fwd_bwd


def bytes_moved(shape, dtype, backward: bool, causal: bool = False) -> int:
    """Bytes the op must move: ``kept`` elements read per input (x forward; y and dy backward) and every element
    written (y forward, dx backward). ``kept`` is all of them, or the causal op's unmasked part."""
    b, h, sq, sk = shape
    n = b * h * sq * sk
    kept = n
    if causal:  # row i keeps sk - sq + i + 1 keys (bottom-right aligned; rows of a too-short sk keep none)
        kept = b * h * sum(max(0, min(sk, sk - sq + i + 1)) for i in range(sq))
    elem = torch.finfo(dtype).bits // 8
    return (kept + n) * elem + ((2 * kept + n) * elem if backward else 0)


def default_shapes(device: str, quick: bool):
    return QUICK_SHAPES if quick else (GPU_SHAPES if device == "cuda" else SHAPES)


def measure(
    ops, dtypes, shapes, *, device="cpu", with_compile=True, min_run_time=0.3, ceilings=None, log=print, peers=None
) -> list[dict]:
    """Measure every (op, dtype, shape, fwd / fwd+bwd); ``ops`` are short names (``scaled``) or op names
    (``scaled_softmax``). Returns the result rows, each printed through ``log`` as it is measured. No peer ships
    these ops, so ``peers`` is accepted for a uniform signature and unused."""
    rows, table = [], TablePrinter(log)
    for name in ops:
        comp = COMPOSITIONS[OPS.get(name, name)]
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            for shape in shapes:
                for backward in (False, True):
                    x, mask, dy = make_inputs(comp, shape, dtype, grad=backward, device=device)
                    times = {
                        OURS: median_seconds(step_fn(comp.fused, x, mask, dy, backward), min_run_time),
                        "eager": median_seconds(step_fn(comp.eager, x, mask, dy, backward), min_run_time),
                    }
                    if with_compile:
                        torch._dynamo.reset()
                        compiled = torch.compile(comp.eager, dynamic=False)
                        times["compile"] = median_seconds(step_fn(compiled, x, mask, dy, backward), min_run_time)
                    value, cname = ceil.for_unit(ceilings, "GB/s", dtype_name)
                    row = result_row(
                        comp.op,
                        FAMILY,
                        dtype=dtype_name,
                        shape="x".join(map(str, shape)),
                        pass_="fwd+bwd" if backward else "fwd",
                        size=shape[-1],
                        size_label="row length sk",
                        unit="GB/s",
                        work=bytes_moved(shape, dtype, backward, comp.name == "causal"),
                        times=times,
                        ceiling=value,
                        ceiling_name=cname,
                        dims=list(shape),
                        rows=shape[0] * shape[1] * shape[2],
                    )
                    rows.append(row)
                    table(row)
    return rows


def run(request: Request) -> list[dict]:
    """``megakernels bench`` for this family (``common.Request``)."""
    return run_measure(measure, request, DEFAULT_DTYPES, default_shapes)
