"""FlashAttention microbenchmark: megakernels.ops.flash_attention vs torch's scaled_dot_product_attention.

    python -m benchmarks.attention [--quick] [--device cpu|cuda] [--dtype bfloat16,float16] [--head-dims 64,128]
                                   [--seqlens 512,1024,...] [--out DIR]

TFLOP/s are counted as flash-attn does: forward ``4 * b * h * s^2 * d`` (halved when causal), backward 2.5x the
forward. Each (head dim, seqlen) keeps ``b * s = 16k`` tokens and ``h * d = 2048`` on a GPU (flash-attn's sweep),
smaller on the CPU. SDPA gets the same data in its own ``[b, h, s, d]`` layout, so no transpose is timed. On the
CPU this compares the blocked CPU path with SDPA's CPU kernel. Writes DIR/attention.json; never asserts on time.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from benchmarks.common import median_seconds, parse_choices, start, write_results
from megakernels.ops import flash_attention

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
GPU_SEQLENS = [512, 1024, 2048, 4096, 8192, 16384]
CPU_SEQLENS = [512, 1024, 2048, 4096]


def shape_for(seqlen: int, head_dim: int, device: str) -> tuple[int, int]:
    """(batch, heads) for a sweep point: 16k tokens x 2048 model width on a GPU; 4k tokens x 512 on the CPU."""
    tokens, width = (16384, 2048) if device == "cuda" else (4096, 512)
    return max(1, tokens // seqlen), max(1, width // head_dim)


def flops(b, h, s, d, causal, backward) -> float:
    f = 4.0 * b * h * s * s * d / (2 if causal else 1)
    return f * (3.5 if backward else 1.0)  # fwd + bwd = 1 + 2.5


def make_inputs(b, h, s, d, dtype, device, grad):
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn((b, s, h, d), generator=g, device=device, dtype=dtype) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(grad)
    return q, k, v, do


def steps(q, k, v, do, causal, backward):
    """Zero-argument callables {impl: step} for flash_attention and SDPA."""
    qt, kt, vt, dot = (t.detach().transpose(1, 2).contiguous().requires_grad_(t.requires_grad) for t in (q, k, v, do))

    def flash():
        out = flash_attention(q, k, v, causal=causal)
        if backward:
            torch.autograd.backward(out, do, inputs=[q, k, v])

    def sdpa():
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        if backward:
            torch.autograd.backward(out, dot, inputs=[qt, kt, vt])

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn()
        return run

    return {"flash": flash if backward else no_grad(flash), "sdpa": sdpa if backward else no_grad(sdpa)}


def run(dtypes, head_dims, seqlens, device="cpu", min_run_time=0.3, log=print):
    rows = []
    for dtype_name in dtypes:
        for d in head_dims:
            for s in seqlens:
                b, h = shape_for(s, d, device)
                for causal in (False, True):
                    for backward in (False, True):
                        q, k, v, do = make_inputs(b, h, s, d, DTYPES[dtype_name], device, backward)
                        t = {name: median_seconds(fn, min_run_time) for name, fn in
                             steps(q, k, v, do, causal, backward).items()}
                        f = flops(b, h, s, d, causal, backward)
                        row = {"op": "flash_attention", "device": device, "dtype": dtype_name, "batch": b,
                               "heads": h, "seqlen": s, "head_dim": d, "causal": causal,
                               "pass": "fwd+bwd" if backward else "fwd",
                               "flash_ms": t["flash"] * 1e3, "sdpa_ms": t["sdpa"] * 1e3,
                               "flash_TFLOPs": f / t["flash"] / 1e12, "sdpa_TFLOPs": f / t["sdpa"] / 1e12,
                               "speedup_vs_sdpa": t["sdpa"] / t["flash"]}
                        rows.append(row)
                        log(format_row(row))
    return rows


HEADER = (f"{'dtype':<10}{'d':>5}{'seqlen':>8}{'b x h':>9}{'causal':>8} {'pass':<9}{'flash ms':>10}{'sdpa ms':>10}"
          f"{'flash TF/s':>12}{'sdpa TF/s':>11}{'vs sdpa':>9}")


def format_row(r) -> str:
    return (f"{r['dtype']:<10}{r['head_dim']:>5}{r['seqlen']:>8}{str(r['batch']) + 'x' + str(r['heads']):>9}"
            f"{str(r['causal']):>8} {r['pass']:<9}{r['flash_ms']:>10.3f}{r['sdpa_ms']:>10.3f}"
            f"{r['flash_TFLOPs']:>12.3f}{r['sdpa_TFLOPs']:>11.3f}{r['speedup_vs_sdpa']:>8.2f}x")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, help="comma list of " + ", ".join(DTYPES) +
                   " (default: bfloat16,float16 on cuda, float32 on cpu)")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--seqlens", default=None, help="comma list (default: 512..16k on cuda, 512..4k on cpu)")
    p.add_argument("--quick", action="store_true", help="one small point, short timing (a smoke run)")
    p.add_argument("--out", default=None, help="directory for attention.json")
    args = p.parse_args(argv)
    dtypes = parse_choices(p, "--dtype", args.dtype or ("bfloat16,float16" if args.device == "cuda" else "float32"),
                           DTYPES)
    try:
        head_dims = [int(x) for x in args.head_dims.split(",") if x]
        seqlens = [int(x) for x in args.seqlens.split(",") if x] if args.seqlens else \
            (GPU_SEQLENS if args.device == "cuda" else CPU_SEQLENS)
    except ValueError:
        p.error("--head-dims/--seqlens: expected comma lists of integers")
    if args.quick:
        head_dims, seqlens = head_dims[:1], [128]
    info = start(p, args.device)
    print(HEADER)
    rows = run(dtypes, head_dims, seqlens, args.device, min_run_time=0.05 if args.quick else 0.5)
    write_results(args.out, "attention.json", info, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
