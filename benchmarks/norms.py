"""Norm-family microbenchmarks: fused kernels vs PyTorch eager vs torch.compile of the same composition.

    python -m benchmarks.norms [--quick] [--dtype float32,bfloat16] [--device cpu|cuda] [--out DIR]

Prints one table (median time over calibrated repeats, effective GB/s, speed-up vs eager and vs torch.compile,
all measured in the same run) and writes DIR/norms.json. Never asserts on time. The pytest-benchmark suite
(benchmarks/test_bench_norms.py) times the same callables.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.common import (comparison_fields, comparison_header, format_comparison, parse_choices, start,
                               time_fused_eager_compile, write_results)
from megakernels.ops import bias_gelu, layer_norm, rms_norm

SHAPES = [(8192, 1024), (4096, 4096), (2048, 12800)]
QUICK_SHAPES = [(1024, 1024)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class Composition:
    """An op as the fused call and as the PyTorch composition a user would otherwise write."""

    name: str
    n_params: int
    fused: Callable
    eager: Callable


COMPOSITIONS = {
    "layer_norm_gelu": Composition(
        "layer_norm_gelu", 2,
        lambda x, w, b: layer_norm(x, w, b, 1e-5, "gelu"),
        lambda x, w, b: F.gelu(F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)),
    ),
    "layer_norm": Composition(
        "layer_norm", 2,
        lambda x, w, b: layer_norm(x, w, b, 1e-5),
        lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
    ),
    "rms_norm": Composition(
        "rms_norm", 1,
        lambda x, w: rms_norm(x, w, 1e-6),
        lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6),
    ),
    "bias_gelu": Composition(
        "bias_gelu", 1,
        lambda x, b: bias_gelu(x, b, "tanh"),
        lambda x, b: F.gelu(x + b, approximate="tanh"),
    ),
}


def make_inputs(comp: Composition, shape, dtype, device="cpu", grad=False):
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


def bytes_moved(comp: Composition, shape, dtype, backward: bool) -> int:
    """Bytes that must cross memory: x read + y written (+ dy read, dx written, x re-read in backward)."""
    elem = torch.finfo(dtype).bits // 8
    n = shape[0] * shape[1]
    fwd = 2 * n * elem
    return fwd + (3 * n * elem if backward else 0)


def run(ops, dtypes, shapes, with_compile=True, min_run_time=0.3, log=print, device="cpu"):
    rows = []
    for name in ops:
        comp = COMPOSITIONS[name]
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            for shape in shapes:
                for backward in (False, True):
                    x, params, dy = make_inputs(comp, shape, dtype, device=device, grad=backward)
                    t = time_fused_eager_compile(lambda fn: step_fn(fn, x, params, dy, backward), comp.fused,
                                                 comp.eager, with_compile, min_run_time)
                    row = {"op": name, "device": device, "dtype": dtype_name, "rows": shape[0], "hidden": shape[1],
                           "pass": "fwd+bwd" if backward else "fwd",
                           **comparison_fields(t, bytes_moved(comp, shape, dtype, backward))}
                    rows.append(row)
                    log(format_row(row))
    return rows


HEADER = comparison_header(16, 12)


def format_row(r) -> str:
    return format_comparison(r, f"{r['rows']}x{r['hidden']}", 16, 12)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default=",".join(COMPOSITIONS), help="comma list of " + ", ".join(COMPOSITIONS))
    p.add_argument("--dtype", default="float32,bfloat16", help="comma list of " + ", ".join(DTYPES))
    p.add_argument("--quick", action="store_true", help="one small shape, short timing (a smoke run)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--out", default=None, help="directory for norms.json")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the tensors live")
    args = p.parse_args(argv)
    ops = parse_choices(p, "--ops", args.ops, COMPOSITIONS)
    dtypes = parse_choices(p, "--dtype", args.dtype, DTYPES)
    info = start(p, args.device)
    print(HEADER)
    rows = run(ops, dtypes, QUICK_SHAPES if args.quick else SHAPES, with_compile=not args.no_compile,
               min_run_time=0.05 if args.quick else 0.5, device=args.device)
    write_results(args.out, "norms.json", info, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
