"""FlashAttention with dropout on the CPU: the C++ kernel against the blocked PyTorch path and PyTorch's SDPA.

    python -m benchmarks.attention_dropout_cpu [--quick] [--out DIR]

Forward + backward of causal attention with ``dropout_p`` over one 4k-token sequence (512 model width: 8 heads of
64 or 4 of 128), fp32 and bf16, three ways in one run: ``flash_attention`` on the C++ kernel (csrc/flash_attention,
which covers dropout since 2026-12-03), the same call forced onto megakernels/ops/_attention_cpu.py (the path it
took before), and ``F.scaled_dot_product_attention(..., dropout_p)``. The C++ kernel and the PyTorch path drop the
same scores (the Triton kernels' counter hash); SDPA draws its own mask. Median of ``--reps`` timed runs after one
warm-up; ratios are within the run. Never asserts on time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from megakernels.bench.common import machine, machine_line, write_json


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    import megakernels
    from megakernels.ops import attention
    from megakernels.ops.attention import flash_attention

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="256 tokens, one repeat: a smoke run")
    parser.add_argument("--out", help="write DIR/attention_dropout_cpu.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.seq, args.reps = 256, 1
    info = machine("cpu")
    print(machine_line(info))
    torch.manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for d, h in ((64, 8), (128, 4)):
            q, k, v, do = (torch.randn(1, args.seq, h, d, dtype=dtype) for _ in range(4))

            def ours():
                qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
                with megakernels.backend("cpu"):
                    out = flash_attention(qg, kg, vg, causal=True, dropout_p=args.dropout)
                out.backward(do)

            def sdpa():
                qg, kg, vg = (t.transpose(1, 2).clone().requires_grad_() for t in (q, k, v))
                out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, dropout_p=args.dropout)
                out.backward(do.transpose(1, 2))

            kernel_ms = _median_ms(ours, args.reps)
            covers = attention._cpp_kernel_covers
            attention._cpp_kernel_covers = lambda *a: False  # the blocked PyTorch path, as before
            try:
                pytorch_path_ms = _median_ms(ours, args.reps)
            finally:
                attention._cpp_kernel_covers = covers
            sdpa_ms = _median_ms(sdpa, args.reps)
            rows.append(
                {
                    "dtype": str(dtype).removeprefix("torch."),
                    "shape": f"1x{h}x{args.seq}x{d}",
                    "kernel_ms": kernel_ms,
                    "pytorch_path_ms": pytorch_path_ms,
                    "sdpa_ms": sdpa_ms,
                    "speedup_over_pytorch_path": pytorch_path_ms / kernel_ms,
                    "speedup_over_sdpa": sdpa_ms / kernel_ms,
                }
            )
            r = rows[-1]
            print(
                f"{r['dtype']:>9} {r['shape']:>14} causal p={args.dropout} fwd+bwd: kernel {kernel_ms:8.1f} ms, "
                f"PyTorch path {pytorch_path_ms:8.1f} ms ({r['speedup_over_pytorch_path']:.2f}x), "
                f"SDPA {sdpa_ms:8.1f} ms ({r['speedup_over_sdpa']:.2f}x)",
                flush=True,
            )
    write_json(args.out, "attention_dropout_cpu.json", {"machine": info, "settings": vars(args), "results": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
