"""Two builds of the CPU kernels side by side: the same calls timed in each build's own process, the builds taking
turns round by round, each call's best time over many repetitions on one thread (a shared host's load inflates the
typical time far more than the best one).

    python -m benchmarks.cpu_builds --tree portable=/path/to/checkout --tree native=/path/to/other [--rounds 4]
                                    [--isa baseline] [--out FILE.json]

A tree is a checkout with its extension built in place (``megakernels/_C*.so``); ``--tree NAME=PATH:ISA`` runs it
with ``MEGAKERNELS_CPU_ISA=ISA`` (a portable build's narrower instruction set). Prints, per call, the best time of
each tree over all rounds and its ratio to the first tree, then the geometric mean of the ratios per family, and
the load average before and after. Never asserts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from collections import defaultdict


def _calls():
    """(name, thunk, repetitions) of the CPU kernels of every family, forward and forward+backward, fp32 and bf16."""
    import torch

    from megakernels import ops
    from megakernels.optim import FusedAdamW

    def backward(f, *inputs):
        out = f()
        grads = [torch.randn_like(o) for o in (out if isinstance(out, tuple) else (out,))]
        return lambda: torch.autograd.grad(f(), inputs, grads if isinstance(out, tuple) else grads[0])

    def of_dtype(dtype):  # one scope per dtype: each closure holds its own tensors
        d = str(dtype).removeprefix("torch.")
        x = torch.randn(512, 1024, dtype=dtype, requires_grad=True)
        w = torch.randn(1024, dtype=dtype, requires_grad=True)
        rows = {
            "layer_norm": lambda: ops.layer_norm(x, w, w),
            "rms_norm": lambda: ops.rms_norm(x, w),
            "bias_gelu": lambda: ops.bias_gelu(x, w),
            "swiglu": lambda: ops.swiglu(x),
            "softmax": lambda: ops.scaled_softmax(x.view(2, 4, 64, 1024), 0.5),
        }
        out = []
        for name, f in rows.items():
            out += [(f"{name} {d} fwd", f, 60), (f"{name} {d} fwd+bwd", backward(f, x), 60)]
        q = torch.randn(1, 256, 8, 64, dtype=dtype, requires_grad=True)
        k = torch.randn(1, 256, 8, 64, dtype=dtype, requires_grad=True)

        def rope():
            return ops.fused_rope(q, k)

        out += [(f"rope {d} fwd", rope, 60), (f"rope {d} fwd+bwd", backward(rope, q, k), 60)]
        qa = torch.randn(1, 8, 512, 64, dtype=dtype, requires_grad=True)
        for causal in (False, True):

            def attention(causal=causal):
                return ops.flash_attention(qa, qa, qa, causal=causal)

            tag = f"flash_attention {d} {'causal' if causal else 'full'}"
            out += [(f"{tag} fwd", attention, 15), (f"{tag} fwd+bwd", backward(attention, qa), 8)]
        return out

    calls = of_dtype(torch.float32) + of_dtype(torch.bfloat16)
    params = [torch.nn.Parameter(torch.randn(1 << 20)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    calls.append(("adamw float32 step", FusedAdamW(params, lr=1e-3).step, 30))
    return calls


def _worker() -> None:
    """One round in this process: the best time (ms) of each call, as one JSON line with the ISA the kernels ran."""
    import time

    import torch

    import megakernels

    torch.set_num_threads(1)
    torch.manual_seed(0)
    best = {"isa": megakernels.cpu_isa()}
    for name, call, reps in _calls():
        for _ in range(3):
            call()
        t_best = math.inf
        for _ in range(reps):
            t = time.perf_counter()
            call()
            t_best = min(t_best, time.perf_counter() - t)
        best[name] = t_best * 1e3
    print(json.dumps(best))


def _parse_tree(spec: str) -> tuple[str, str, str | None]:
    name, sep, rest = spec.partition("=")
    if not sep or not name:
        raise SystemExit(f"--tree takes NAME=PATH[:ISA], got {spec!r}")
    path, _, isa = rest.partition(":")
    if not os.path.isdir(os.path.join(path, "megakernels")):
        raise SystemExit(f"--tree {spec!r}: {path} holds no megakernels package")
    return name, os.path.abspath(path), isa or None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PATH[:ISA]")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default=None, metavar="FILE.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker()
    trees = [_parse_tree(t) for t in args.tree]
    if len(trees) < 2:
        raise SystemExit("--tree: give at least two trees to compare")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    load = [os.getloadavg()]
    runs: dict[str, list[dict]] = defaultdict(list)
    for _ in range(args.rounds):
        for name, path, isa in trees:
            env = {**os.environ, "PYTHONPATH": path}
            env.pop("MEGAKERNELS_CPU_ISA", None)
            if isa:
                env["MEGAKERNELS_CPU_ISA"] = isa
            cmd = [sys.executable, os.path.abspath(__file__), "--worker"]  # this file, the tree's package
            out = subprocess.run(cmd, cwd=path, env=env, capture_output=True, text=True, check=True).stdout
            runs[name].append(json.loads(out.splitlines()[-1]))
    load.append(os.getloadavg())
    names = [t[0] for t in trees]
    best = {n: {k: min(r[k] for r in runs[n]) for k in runs[n][0] if k != "isa"} for n in names}
    isas = {n: runs[n][0]["isa"] for n in names}
    ref = names[0]
    print(
        f"# load average before {load[0][0]:.2f}, after {load[1][0]:.2f}; {args.rounds} rounds; ISA "
        + ", ".join(f"{n}={isas[n]}" for n in names)
    )
    print(
        "call".ljust(44)
        + "".join(f"{n + ' ms':>14}" for n in names)
        + "".join(f"{n + '/' + ref:>18}" for n in names[1:])
    )
    families: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for call, t_ref in best[ref].items():
        ratios = [best[n][call] / t_ref for n in names[1:]]
        for n, r in zip(names[1:], ratios):
            families[call.split()[0]][n].append(r)
        print(call.ljust(44) + "".join(f"{best[n][call]:14.3f}" for n in names) + "".join(f"{r:18.2f}" for r in ratios))
    print("\nfamily (geometric mean of the time ratios)".ljust(44) + "".join(f"{n + '/' + ref:>18}" for n in names[1:]))
    for family, per in families.items():
        print(
            family.ljust(44) + "".join(f"{math.exp(sum(map(math.log, per[n])) / len(per[n])):18.2f}" for n in names[1:])
        )
    if args.out:
        write_report(args.out, load, isas, best)


def write_report(path: str, load: list, isas: dict, best: dict) -> None:
    """The figures as a results file (benchmarks/results_table.py's ``results`` layout): one row per build and call."""
    import datetime

    from megakernels import host
    from megakernels.bench import common

    machine = {
        "cpu": host.cpu()["model"],
        "threads": 1,
        "commit": common.git_commit(),
        "date": str(datetime.date.today()),
    }
    rows = [
        {"name": call, "build": name, "isa": isas[name], "best_ms": round(ms, 4)}
        for name, calls in best.items()
        for call, ms in calls.items()
    ]
    with open(path, "w") as f:
        json.dump({"machine": machine, "load_average": [round(x[0], 2) for x in load], "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
