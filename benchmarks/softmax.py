"""Softmax-family microbenchmarks: fused kernels vs PyTorch eager vs torch.compile of the same composition.

    python -m benchmarks.softmax [--quick] [--ops scaled,masked,causal] [--dtype float32,bfloat16] [--out DIR]
                                 [--device cpu|cuda] [--shapes b,h,sq,sk;...]

The eager composition is what a user would otherwise write for attention scores x [b, heads, sq, sk]:
``torch.softmax((x * scale).masked_fill(mask, -inf), -1)`` (the causal mask is built once, outside the timing).
Prints one table (median time over calibrated repeats, effective GB/s, speed-up vs eager and vs torch.compile, all
measured in the same run) and writes DIR/softmax.json. Never asserts on time. The pytest-benchmark suite
(benchmarks/test_bench_softmax.py) times the same callables.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable

import torch

from benchmarks.common import (comparison_fields, comparison_header, format_comparison, parse_choices, start,
                               time_fused_eager_compile, write_results)
from megakernels.ops import scaled_causal_softmax, scaled_masked_softmax, scaled_softmax
from megakernels.ops.softmax import causal_mask

SCALE = 0.125
# [b, heads, sq, sk]: 16M scores (64 MiB in fp32) each, from short to long rows.
SHAPES = [(4, 16, 512, 512), (1, 16, 1024, 1024), (1, 8, 512, 4096), (1, 2, 512, 16384)]
QUICK_SHAPES = [(2, 4, 64, 128)]
# On a GPU: 256M scores per shape (512 MiB in bf16, far past L2), from Megatron's short rows to long-context ones.
GPU_SHAPES = [(8, 32, 1024, 1024), (2, 32, 1024, 4096), (1, 16, 1024, 16384), (1, 4, 1024, 65536)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class Composition:
    """An op as the fused call and as the eager composition; both take (x, mask)."""

    name: str
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
    "scaled": Composition("scaled", lambda x, m: scaled_softmax(x, SCALE), _eager, lambda s: None),
    "masked": Composition("masked", lambda x, m: scaled_masked_softmax(x, m, SCALE), _eager, _padding_mask),
    "causal": Composition("causal", lambda x, m: scaled_causal_softmax(x, SCALE), _eager,
                          lambda s: causal_mask(s[-2], s[-1])),
}


def make_inputs(comp: Composition, shape, dtype, grad=False, device="cpu"):
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


def bytes_moved(shape, dtype, backward: bool) -> int:
    """Bytes a softmax over the full square must move: x read + y written (+ y, dy read and dx written)."""
    n = 1
    for s in shape:
        n *= s
    elem = torch.finfo(dtype).bits // 8
    return 2 * n * elem + (3 * n * elem if backward else 0)


def run(ops, dtypes, shapes, with_compile=True, min_run_time=0.3, log=print, device="cpu"):
    rows = []
    for name in ops:
        comp = COMPOSITIONS[name]
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            for shape in shapes:
                for backward in (False, True):
                    x, mask, dy = make_inputs(comp, shape, dtype, grad=backward, device=device)
                    t = time_fused_eager_compile(lambda fn: step_fn(fn, x, mask, dy, backward), comp.fused,
                                                 comp.eager, with_compile, min_run_time)
                    row = {"op": name, "device": device, "dtype": dtype_name, "shape": list(shape),
                           "pass": "fwd+bwd" if backward else "fwd",
                           **comparison_fields(t, bytes_moved(shape, dtype, backward))}
                    rows.append(row)
                    log(format_row(row))
    return rows


HEADER = comparison_header(8, 18)


def format_row(r) -> str:
    return format_comparison(r, "x".join(map(str, r["shape"])), 8, 18)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default=",".join(COMPOSITIONS), help="comma list of " + ", ".join(COMPOSITIONS))
    p.add_argument("--dtype", default="float32,bfloat16", help="comma list of " + ", ".join(DTYPES))
    p.add_argument("--shapes", default=None, help="semicolon list of b,h,sq,sk (default: the standard set)")
    p.add_argument("--quick", action="store_true", help="one small shape, short timing (a smoke run)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the tensors live (default cpu)")
    p.add_argument("--out", default=None, help="directory for softmax.json")
    args = p.parse_args(argv)
    ops = parse_choices(p, "--ops", args.ops, COMPOSITIONS)
    dtypes = parse_choices(p, "--dtype", args.dtype, DTYPES)
    shapes = QUICK_SHAPES if args.quick else (GPU_SHAPES if args.device == "cuda" else SHAPES)
    if args.shapes:
        try:
            shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";") if s]
        except ValueError:
            p.error(f"--shapes: expected b,h,sq,sk[;b,h,sq,sk...], got {args.shapes!r}")
        if any(len(s) != 4 or min(s) < 1 for s in shapes):
            p.error(f"--shapes: each shape needs 4 positive sizes b,h,sq,sk, got {args.shapes!r}")
    info = start(p, args.device)
    print(HEADER)
    rows = run(ops, dtypes, shapes, with_compile=not args.no_compile, min_run_time=0.05 if args.quick else 0.5,
               device=args.device)
    write_results(args.out, "softmax.json", info, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
