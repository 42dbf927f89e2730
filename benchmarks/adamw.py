"""AdamW step microbenchmark: megakernels FusedAdamW vs torch.optim.AdamW (foreach=True and fused=True).

    python -m benchmarks.adamw [--quick] [--configs 50x1M,1x100M] [--dtype float32] [--device cpu|cuda] [--out DIR]

One optimizer step over a parameter set (e.g. 50 tensors of 1M params, or one of 100M), grads fixed, state
already initialised. Prints a table (median step time over calibrated repeats, effective GB/s and its fraction of
the copy bandwidth measured in the same run, speed-up vs each torch variant) and writes DIR/adamw.json. Never
asserts on time.

Bytes that must move per element and step (fp32): read param, grad, exp_avg, exp_avg_sq and write param,
exp_avg, exp_avg_sq = 7 x 4 bytes; with master weights (16-bit params) read/write the fp32 master as well.
The pytest-benchmark suite (benchmarks/test_bench_adamw.py) times the same callables.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.common import median_seconds, parse_choices, start, write_results
from megakernels.optim import FusedAdamW

CONFIGS = {"50x1M": (50, 1 << 20), "1x100M": (1, 100_000_000)}
QUICK_CONFIGS = {"8x64K": (8, 1 << 16)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
IMPLS = ("megakernels", "torch_foreach", "torch_fused")


def make_optimizer(impl: str, n_tensors: int, numel: int, dtype: torch.dtype, device: str = "cpu"):
    """Params with grads set and state initialised (one warm-up step), ready to time `opt.step()`."""
    g = torch.Generator().manual_seed(0)
    params = []
    for _ in range(n_tensors):
        p = torch.randn(numel, generator=g).to(dtype=dtype, device=device).requires_grad_(True)
        p.grad = torch.randn(numel, generator=g).to(dtype=dtype, device=device) * 1e-2
        params.append(p)
    if impl == "megakernels":
        opt = FusedAdamW(params, lr=1e-4, weight_decay=0.01, master_weights=dtype != torch.float32)
    elif impl == "torch_foreach":
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=True)
    elif impl == "torch_fused":
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
    else:
        raise ValueError(f"unknown implementation {impl!r}")
    opt.step()
    return opt


def bytes_moved(n_tensors: int, numel: int, dtype: torch.dtype, master: bool) -> int:
    elem = torch.finfo(dtype).bits // 8
    per = 3 * elem + 2 * 2 * elem  # param r/w, grad r, exp_avg r/w, exp_avg_sq r/w
    if master:
        per = 3 * elem + 4 * 4 + 2 * 4  # param w + grad r (16-bit), moments r/w fp32, master r/w fp32
    return n_tensors * numel * per


def copy_bandwidth(device: str, numel: int = 1 << 26, min_run_time: float = 0.5) -> float:
    """The machine's ceiling for a streaming kernel: bytes read + written per second by ``dst.copy_(src)``."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / median_seconds(lambda: dst.copy_(src), min_run_time) / 1e9


def run(configs: dict, dtypes, impls=IMPLS, min_run_time=0.5, log=print, device="cpu"):
    rows = []
    ceiling = copy_bandwidth(device, min_run_time=min_run_time)
    log(f"# copy bandwidth {ceiling:.1f} GB/s")
    log(HEADER)
    for cname, (n, numel) in configs.items():
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            t = {}
            for impl in impls:
                opt = make_optimizer(impl, n, numel, dtype, device)
                t[impl] = median_seconds(opt.step, min_run_time)
                del opt
            ours = t["megakernels"]
            gbps = bytes_moved(n, numel, dtype, dtype != torch.float32) / ours / 1e9
            row = {
                "config": cname, "device": device, "tensors": n, "numel": numel, "dtype": dtype_name,
                **{f"{k}_ms": v * 1e3 for k, v in t.items()},
                "GBps": gbps, "copy_GBps": ceiling, "fraction_of_copy": gbps / ceiling,
                **{f"speedup_vs_{k}": v / ours for k, v in t.items() if k != "megakernels"},
            }
            rows.append(row)
            log(format_row(row))
    return rows


HEADER = (f"{'config':<10}{'dtype':<10}{'ours ms':>10}{'foreach ms':>12}{'fused ms':>10}{'GB/s':>8}{'% copy':>8}"
          f"{'vs foreach':>12}{'vs fused':>10}")


def format_row(r) -> str:
    def f(key, width, fmt):
        return f"{r[key]:>{width}{fmt}}" if r.get(key) is not None else f"{'-':>{width}}"
    return (f"{r['config']:<10}{r['dtype']:<10}{f('megakernels_ms', 10, '.3f')}{f('torch_foreach_ms', 12, '.3f')}"
            f"{f('torch_fused_ms', 10, '.3f')}{r['GBps']:>8.1f}{100 * r['fraction_of_copy']:>7.0f}%"
            f"{f('speedup_vs_torch_foreach', 11, '.2f')}x"
            f"{f('speedup_vs_torch_fused', 9, '.2f')}x")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma list of " + ", ".join(CONFIGS))
    p.add_argument("--dtype", default="float32", help="comma list of " + ", ".join(DTYPES)
                   + " (16-bit: ours with fp32 master weights, torch with 16-bit state)")
    p.add_argument("--quick", action="store_true", help="one small config, short timing (a smoke run)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the tensors live")
    p.add_argument("--out", default=None, help="directory for adamw.json")
    args = p.parse_args(argv)
    configs = QUICK_CONFIGS if args.quick else {}
    if not args.quick:
        configs = {c: CONFIGS[c] for c in parse_choices(p, "--configs", args.configs, CONFIGS)}
    dtypes = parse_choices(p, "--dtype", args.dtype, DTYPES)
    info = start(p, args.device)
    rows = run(configs, dtypes, min_run_time=0.05 if args.quick else 1.0, device=args.device)
    write_results(args.out, "adamw.json", info, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
