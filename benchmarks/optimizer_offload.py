"""The optimizer step with the state offloaded to host memory, per parameter, against torch's AdamW on the CPU.

    python -m benchmarks.optimizer_offload [--quick] [--params 16M,64M] [--precision bf16] [--min-run-time S]

For a model of N parameters (linear layers, wrapped in our DistributedDataParallel, grads already in ``main_grad``)
it times, in this process on the CPU, one ``ParallelOptimizer.step()`` with ``offload=True`` (gradient copies into
the host buffers, global-norm clipping, the C++ CPU AdamW on the fp32 masters and moments, the masters copied back
into the params), that AdamW alone on the host state, the same step without offload, and ``torch.optim.AdamW(fused=True)`` and ``foreach=True`` on fp32
copies of the params (no clipping: what a user would otherwise run). It prints nanoseconds per parameter and the
ratio to torch's fused AdamW. With a GPU the offloaded step also pays PCIe copies both ways, which this CPU
measurement does not have. Writes DIR/optimizer_offload.json with --out. Never asserts on time.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from megakernels_models.bench.common import machine, machine_line, median_seconds, write_json


def _model(n: int, dtype) -> nn.Module:
    width = 1024
    layers = max(1, n // (width * width))
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).to(dtype)


def _steps(n: int, precision: str) -> dict:
    from megakernels.parallel.ddp import DistributedDataParallel
    from megakernels.parallel.optimizer import ParallelOptimizer

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    out = {}
    for name, offload in (("ours, offloaded", True), ("ours, on the device", False)):
        model = _model(n, dtype)
        ddp = DistributedDataParallel(model)
        for p in model.parameters():
            p.main_grad.normal_()
        opt = ParallelOptimizer(ddp, lr=1e-4, precision=precision, clip_grad=1.0, offload=offload)
        out[name] = (opt.step, sum(p.numel() for p in model.parameters()))
        if offload:  # the C++ CPU AdamW alone on the host masters and moments (no copies, norm or clipping)
            out["ours, host AdamW only"] = (opt._adam.step, out[name][1])
    for flavour in ("fused", "foreach"):
        params = [p.float() for p in _model(n, torch.float32).parameters()]
        for p in params:
            p.grad = torch.randn_like(p)
        torch_opt = torch.optim.AdamW(params, lr=1e-4, **{flavour: True})
        out[f"torch AdamW {flavour}=True"] = (torch_opt.step, sum(p.numel() for p in params))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.optimizer_offload", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one small size, short timing")
    parser.add_argument("--params", default="16M,64M", help="comma list of sizes (suffix M for millions)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--min-run-time", type=float, default=1.0)
    parser.add_argument("--out", help="write DIR/optimizer_offload.json")
    args = parser.parse_args(argv)
    sizes = [int(float(s[:-1]) * 1e6) if s.endswith("M") else int(s) for s in args.params.split(",")]
    if args.quick:
        sizes, args.min_run_time = [1 << 20], 0.1
    info = machine("cpu")
    print(machine_line(info))
    rows = []
    for n in sizes:
        timed = {name: (median_seconds(step, args.min_run_time), count) for name, (step, count) in
                 _steps(n, args.precision).items()}
        base = timed["torch AdamW fused=True"][0] / timed["torch AdamW fused=True"][1]
        print(f"\n{n / 1e6:.0f}M parameters, {args.precision} params")
        print(f"{'step':>24} {'ns/param':>9} {'vs torch fused':>15}")
        for name, (sec, count) in timed.items():
            per = sec / count
            print(f"{name:>24} {per * 1e9:>9.3f} {base / per:>14.2f}x")
            rows.append({"params": n, "precision": args.precision, "step": name, "ns_per_param": per * 1e9,
                         "speedup_vs_torch_fused": base / per})
    write_json(args.out, "optimizer_offload.json", {"machine": info, "results": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
