"""fp32 GEMMs on the CPU: ``F.linear`` / ``torch.mm`` (PyTorch's BLAS, MKL in the official wheels) against
``megakernels.ops.gemm`` (oneDNN), at the products of a training step's linear layers.

    python -m benchmarks.cpu_gemm [--threads N] [--reps 10] [--out FILE.json]

For each shape (the forward ``x Wᵀ``, the input gradient ``dy W`` and the weight gradient ``dyᵀ x`` of GPT-2 small's
and Llama-768's projections and LM head at 512 tokens, and two products below ``gemm.MIN_FLOPS``), the two take
turns call by call (the median of ``--reps`` calls each, after two warm-ups) and their GF/s are printed with the
ratio. Also the largest relative difference of each result to the fp64 product. The machine's load average is
printed before and after. Never asserts.
"""

from __future__ import annotations

import argparse
import json
import os

SHAPES = [  # (name, m, k, n, how b is laid out): a [m, k] @ b [k, n]
    ("qkv fwd (768 -> 2304)", 512, 768, 2304, "wT"),
    ("mlp up fwd (768 -> 3072)", 512, 768, 3072, "wT"),
    ("mlp down fwd (3072 -> 768)", 512, 3072, 768, "wT"),
    ("lm head fwd (768 -> 8192)", 512, 768, 8192, "wT"),
    ("mlp up dX (dy W)", 512, 3072, 768, "w"),
    ("mlp up dW (dyT x)", 3072, 512, 768, "aT"),
    ("lm head dW (dyT x)", 8192, 512, 768, "aT"),
    ("small (below MIN_FLOPS)", 64, 64, 256, "wT"),
    ("tiny", 16, 32, 64, "wT"),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch

    from megakernels.bench import common
    from megakernels.ops import gemm

    if args.threads:
        torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    g = torch.Generator().manual_seed(0)
    rows = []
    print(f"threads {torch.get_num_threads()}, oneDNN routing {'on' if gemm.enabled() else 'off'}, load {load0}")
    print(
        f"{'product':32s} {'m x k x n':>18s} {'torch GF/s':>11s} {'gemm GF/s':>10s} {'ratio':>6s} {'rel err t/g':>18s}"
    )
    for name, m, k, n, layout in SHAPES:
        a = torch.randn(m, k, generator=g)
        if layout == "aT":  # a transposed view (the weight gradient's dyᵀ)
            a = torch.randn(k, m, generator=g).t()
        b = torch.randn(n, k, generator=g).t() if layout == "wT" else torch.randn(k, n, generator=g)
        ref = a.double() @ b.double()
        fns = {"torch": lambda: torch.mm(a, b), "gemm": lambda: gemm.mm(a, b)}
        fns["torch"]()  # a second warm-up beside timed_in_turns' own
        fns["gemm"]()
        med = common.timed_in_turns(fns, args.reps)
        err = {key: ((f().double() - ref).abs().max() / ref.abs().max()).item() for key, f in fns.items()}
        flops = 2 * m * k * n
        row = {
            "op": "cpu_fp32_gemm",
            "product": name,
            "m x k x n": f"{m}x{k}x{n}",
            "torch_tflops": flops / med["torch"] / 1e12,
            "gemm_tflops": flops / med["gemm"] / 1e12,
            "ratio": med["torch"] / med["gemm"],
            "torch_error_fraction": err["torch"],
            "gemm_error_fraction": err["gemm"],
        }
        rows.append(row)
        print(
            f"{name:32s} {f'{m}x{k}x{n}':>18s} {1e3 * row['torch_tflops']:11.0f} {1e3 * row['gemm_tflops']:10.0f} "
            f"{row['ratio']:5.2f}x {err['torch']:8.1e} / {err['gemm']:7.1e}"
        )
    load1 = os.getloadavg()
    print(f"load after {load1}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": common.machine(), "load_average": [load0, load1], "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
