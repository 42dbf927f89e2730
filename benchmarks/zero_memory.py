"""Memory per rank of ZeRO-1, ZeRO-2 and ZeRO-3 (FSDP2) beside plain data parallelism, measured on the CPU at 4 ranks.

    python -m benchmarks.zero_memory [--preset llama-tiny] [--precision bf16] [--steps 2] [--out DIR]

Each stage trains the same preset in its own spawned world of 4 gloo processes (data parallelism 4; ``--zero 0``,
``--distributed-optimizer``, ``--zero 2``, ``--fsdp``, and ZeRO-1 and ZeRO-3 with ``--offload-optimizer``). Figures per
rank (the last rank; every rank holds the same share): the bytes per parameter the trainer measures on the tensors it
holds after the first step (parameters, gradients, optimizer state: ``ParallelOptimizer.memory_bytes``; for FSDP the
sharded fp32 masters, sharded gradients and moments; with ``--offload-optimizer`` the host bytes apart), and the
process's peak resident memory (``ru_maxrss``: everything, the gathered parameters, activations and the Python runtime
included; a process-wide high-water mark, so it shows differences of the order of the model's size only).
docs/parallelism.md
"Data parallelism, ZeRO-1, offload, FSDP2"; the planner's model of the same is ``planning/costs.memory``.
"""

from __future__ import annotations

import argparse
import resource

from megakernels.bench.common import machine, machine_line, write_json

STAGES = (
    ("zero-0", {}),
    ("zero-1", {"distributed_optimizer": True}),
    ("zero-2", {"zero": 2}),
    ("zero-3", {"fsdp": True}),
    ("zero-1-offload", {"distributed_optimizer": True, "offload_optimizer": True}),
    ("zero-3-offload", {"fsdp": True, "offload_optimizer": True}),
)


def _world(rank: int, world_size: int, args):
    from megakernels_models.training.train import train

    records = train(args)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return None if records is None else (records[0]["memory_per_param_bytes"], peak, records[-1]["loss"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.zero_memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", default="llama-tiny")
    parser.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", help="write DIR/zero_memory.json")
    ns = parser.parse_args(argv)
    from megakernels.parallel.launch import run_world
    from megakernels_models.arguments import TrainArgs, validate

    info = machine("cpu")
    print(machine_line(info))
    rows = []
    print(
        f"{'stage':>14} {'params B/p':>11} {'grads B/p':>10} {'optim B/p':>10} {'total B/p':>10} {'host B/p':>9} "
        f"{'peak RSS MiB':>13}"
    )
    for name, flags in STAGES:
        args = TrainArgs(
            preset=ns.preset,
            precision=ns.precision,
            steps=ns.steps,
            nproc=4,
            micro_batch_size=1,
            global_batch_size=8,
            eval_interval=0,
            progress=False,
            **flags,
        )
        validate(args)
        per_param, peak, loss = run_world(4, _world, args, timeout=1800)[-1]
        total = sum(v for k, v in per_param.items() if k in ("params", "grads", "optimizer"))
        rows.append(
            {
                "name": name,
                "preset": ns.preset,
                "precision": ns.precision,
                "ranks": 4,
                "params_bytes_per_param": float(per_param["params"]),
                "grads_bytes_per_param": float(per_param["grads"]),
                "optimizer_bytes_per_param": float(per_param["optimizer"]),
                "total_bytes_per_param": float(total),
                "host_bytes_per_param": float(per_param.get("host", 0.0)),
                "peak_rss_mib": peak / 2**20,
                "final_loss": float(loss),
            }
        )
        r = rows[-1]
        print(
            f"{name:>14} {r['params_bytes_per_param']:>11.2f} {r['grads_bytes_per_param']:>10.2f} "
            f"{r['optimizer_bytes_per_param']:>10.2f} {total:>10.2f} {r['host_bytes_per_param']:>9.2f} "
            f"{r['peak_rss_mib']:>13.0f}",
            flush=True,
        )
    write_json(ns.out, "zero_memory.json", {"machine": info, "settings": vars(ns), "results": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
