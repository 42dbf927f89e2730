"""Peak memory and time of ``ops.linear_cross_entropy`` (the LM head fused with the cross-entropy, chunked over
tokens) against ``F.linear`` + ``F.cross_entropy`` (the logits held whole), forward + backward, on the CPU.

    python -m benchmarks.linear_cross_entropy [--tokens 4096,16384] [--hidden 1024] [--vocab 128256]
                                              [--dtypes float32,bfloat16] [--chunk N] [--out DIR]

Llama 3's vocabulary (128256) by default; the hidden size is smaller than Llama 3 8B's 4096 so that a point fits a
development machine's memory and minutes (the logits' size does not depend on it; the GEMMs' time does, linearly).
Each (dtype, tokens, implementation) runs in a fresh process: the inputs are made, a warm-up step runs on 256
tokens, the process's peak resident memory is reset (``/proc/self/clear_refs``) and one forward + backward step
at the full size is timed; its peak is reported above the resident memory before it (the inputs; the gradients
of hidden and weight are part of the peak for both). One timed step per point: the differences measured are
several-fold, and a point at 16k tokens takes minutes. A point whose unfused logits would not fit (an estimate
against MemAvailable) is skipped and said so. The machine's load average is printed and recorded before and after:
other jobs on a shared machine slow the times, not the memory. Never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _vm(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _one(spec: dict) -> dict:
    """One point, in this (fresh) process: ``{"ms", "peak_mib"}``."""
    import torch
    import torch.nn.functional as F

    from megakernels.ops import linear_cross_entropy

    torch.set_num_threads(spec["threads"])
    dtype = getattr(torch, spec["dtype"])
    t, h, v = spec["tokens"], spec["hidden"], spec["vocab"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, h, generator=g).to(dtype).requires_grad_(True)
    w = (torch.randn(v, h, generator=g) / h**0.5).to(dtype).requires_grad_(True)
    target = torch.randint(0, v, (t,), generator=g)

    def step(n):
        x.grad = w.grad = None
        xs, ts = x[:n], target[:n]
        if spec["impl"] == "fused":
            loss = linear_cross_entropy(xs, w, ts, chunk_tokens=spec["chunk"])
        else:
            loss = F.cross_entropy(F.linear(xs, w), ts, reduction="none")
        loss.sum().backward()

    step(256)  # warm-up: threads, first-call paths
    x.grad = w.grad = None
    base = _vm("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set (VmHWM) to the current one
    start = time.perf_counter()
    step(t)
    ms = (time.perf_counter() - start) * 1e3
    return {"ms": ms, "peak_mib": (_vm("VmHWM") - base) / 2**20}


def _estimate_unfused(dtype: str, t: int, v: int) -> int:
    """Bytes the unfused step holds at its peak, about: the logits, F.cross_entropy's log-softmax, their gradient."""
    return 3 * t * v * (4 if dtype == "float32" else 2)


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="4096,16384")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--chunk", type=int, default=None, help="chunk_tokens (default: the op's, ~256 MiB of fp32 logits)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", default=None, help="write DIR/linear_cross_entropy.json")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(_one(json.loads(a.one))), flush=True)
        return 0

    from megakernels.bench.common import machine, machine_line, write_json
    from megakernels.ops.linear_cross_entropy import default_chunk_tokens

    info = machine("cpu")
    info["threads"] = a.threads
    info["load_average_start"] = _load()
    chunk = a.chunk or default_chunk_tokens(a.vocab)
    print(machine_line(info))
    print(f"# load average (1, 5, 15 min) at start: {info['load_average_start']}; chunk_tokens {chunk}")
    header = (
        f"{'dtype':<10} {'tokens':>7} {'hidden':>6} {'vocab':>7}  {'fused ms':>10} {'unfused ms':>10} "
        f"{'fused MiB':>10} {'unfused MiB':>11} {'speed-up':>8} {'memory':>7}"
    )
    print(header)
    results = []
    for dtype in a.dtypes.split(","):
        for tokens in (int(s) for s in a.tokens.split(",")):
            row = {"op": "linear_cross_entropy", "dtype": dtype, "tokens": tokens, "hidden": a.hidden}
            row.update({"vocab": a.vocab, "chunk_tokens": chunk, "pass": "fwd+bwd"})
            for impl in ("fused", "unfused"):
                need = _estimate_unfused(dtype, tokens, a.vocab) if impl == "unfused" else 0
                if need > 0.8 * _mem_available():
                    row[f"{impl}_skipped"] = f"needs about {need / 2**30:.1f} GiB, more than 80 % of MemAvailable"
                    continue
                spec = dict(impl=impl, dtype=dtype, tokens=tokens, hidden=a.hidden, vocab=a.vocab, chunk=chunk)
                spec["threads"] = a.threads
                out = subprocess.run(
                    [sys.executable, "-m", "benchmarks.linear_cross_entropy", "--one", json.dumps(spec)],
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                )
                if out.returncode != 0:
                    row[f"{impl}_skipped"] = f"exit {out.returncode}: {out.stderr.strip().splitlines()[-1:]}"
                    continue
                got = json.loads(out.stdout.strip().splitlines()[-1])
                row[f"{impl}_ms"], row[f"{impl}_peak_mib"] = got["ms"], got["peak_mib"]
            if "fused_ms" in row and "unfused_ms" in row:
                row["speedup_vs_unfused"] = row["unfused_ms"] / row["fused_ms"]
            results.append(row)

            def cell(key, fmt, width, row=row):
                return format(row[key], fmt).rjust(width) if key in row else "skipped".rjust(width)

            speedup = f"{row['speedup_vs_unfused']:7.2f}x" if "speedup_vs_unfused" in row else "-".rjust(8)
            ratio = (
                f"{row['unfused_peak_mib'] / row['fused_peak_mib']:6.1f}x"
                if "unfused_peak_mib" in row and "fused_peak_mib" in row
                else "-".rjust(7)
            )
            print(
                f"{dtype:<10} {tokens:>7} {a.hidden:>6} {a.vocab:>7}  {cell('fused_ms', '.0f', 10)} "
                f"{cell('unfused_ms', '.0f', 10)} {cell('fused_peak_mib', '.0f', 10)} "
                f"{cell('unfused_peak_mib', '.0f', 11)} {speedup} {ratio}",
                flush=True,
            )
    info["load_average_end"] = _load()
    print(f"# load average at end: {info['load_average_end']}")
    path = write_json(a.out, "linear_cross_entropy.json", {"machine": info, "results": results})
    if path:
        print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
