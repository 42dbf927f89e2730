"""Cross-entropy microbenchmark: megakernels.ops.cross_entropy vs F.cross_entropy, time and peak memory.

    python -m benchmarks.cross_entropy [--quick] [--device cpu|cuda] [--dtype bfloat16,float32] [--out DIR]

Shapes [tokens, vocab]: [16384, 50304] and [8192, 131072] on a GPU (GPT-2's padded vocab, a Llama-3-size one),
a quarter of the tokens on the CPU. The PyTorch baseline is what Megatron and nanoGPT write: ``F.cross_entropy(
logits.float(), target)`` (the fp32 upcast of bf16 logits included). GB/s counts the bytes that must move: the
logits read once forward; read once and the gradient written once backward. Peak memory is the largest amount of
memory allocated during forward+backward beyond the logits and targets themselves (torch.cuda's counter on a GPU;
on the CPU the rise of a fresh process's peak resident set over the inputs). Writes DIR/cross_entropy.json; never asserts
on time.
"""

from __future__ import annotations

import argparse
import sys
import subprocess

import torch
import torch.nn.functional as F

from benchmarks.common import median_seconds, parse_choices, start, write_results
from megakernels.ops import cross_entropy

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
GPU_SHAPES = [(16384, 50304), (8192, 131072)]
CPU_SHAPES = [(4096, 50304), (2048, 131072)]
QUICK_SHAPES = [(64, 1000)]

IMPLS = {
    "fused": lambda x, t: cross_entropy(x, t).mean(),
    "torch": lambda x, t: F.cross_entropy(x.float(), t),
}


def _proc_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def make_inputs(n, v, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn((n, v), generator=g, device=device) * 2).to(dtype).requires_grad_(True)
    t = torch.randint(0, v, (n,), generator=g, device=device)
    return x, t


def step(impl, x, t):
    def run():
        IMPLS[impl](x, t).backward()
        x.grad = None
    return run


def peak_bytes(impl, x, t) -> int:
    if x.device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(impl, x, t)()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    # CPU: in a fresh process, the peak resident set (VmHWM, reset through /proc/self/clear_refs once the inputs
    # exist) over the resident set at that point.
    code = (f"from benchmarks.cross_entropy import make_inputs, step, _proc_kib; import torch; "
            f"x, t = make_inputs({x.shape[0]}, {x.shape[1]}, {x.dtype}, 'cpu'); "
            f"open('/proc/self/clear_refs', 'w').write('5'); base = _proc_kib('VmRSS'); "
            f"step({impl!r}, x, t)(); print((_proc_kib('VmHWM') - base) * 1024)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def run(dtypes, shapes, device="cpu", min_run_time=0.3, log=print):
    rows = []
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        for n, v in shapes:
            x, t = make_inputs(n, v, dtype, device)
            times = {impl: median_seconds(step(impl, x, t), min_run_time) for impl in IMPLS}
            peaks = {impl: peak_bytes(impl, x, t) for impl in IMPLS}
            nbytes = 3 * n * v * x.element_size()
            row = {"op": "cross_entropy", "device": device, "dtype": dtype_name, "tokens": n, "vocab": v,
                   **{f"{impl}_ms": times[impl] * 1e3 for impl in IMPLS},
                   "fused_GBps": nbytes / times["fused"] / 1e9, "speedup_vs_torch": times["torch"] / times["fused"],
                   **{f"{impl}_peak_MiB": peaks[impl] / 2**20 for impl in IMPLS}}
            rows.append(row)
            log(format_row(row))
    return rows


HEADER = (f"{'dtype':<10}{'tokens x vocab':<16}{'fused ms':>10}{'torch ms':>10}{'GB/s':>8}{'vs torch':>9}"
          f"{'fused MiB':>11}{'torch MiB':>11}")


def format_row(r) -> str:
    return (f"{r['dtype']:<10}{str(r['tokens']) + 'x' + str(r['vocab']):<16}{r['fused_ms']:>10.2f}"
            f"{r['torch_ms']:>10.2f}{r['fused_GBps']:>8.1f}{r['speedup_vs_torch']:>8.2f}x"
            f"{r['fused_peak_MiB']:>11.0f}{r['torch_peak_MiB']:>11.0f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="bfloat16,float32", help="comma list of " + ", ".join(DTYPES))
    p.add_argument("--quick", action="store_true", help="one small shape, short timing (a smoke run)")
    p.add_argument("--out", default=None, help="directory for cross_entropy.json")
    args = p.parse_args(argv)
    dtypes = parse_choices(p, "--dtype", args.dtype, DTYPES)
    shapes = QUICK_SHAPES if args.quick else (GPU_SHAPES if args.device == "cuda" else CPU_SHAPES)
    info = start(p, args.device)
    print(HEADER)
    rows = run(dtypes, shapes, args.device, min_run_time=0.05 if args.quick else 0.5)
    write_results(args.out, "cross_entropy.json", info, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
