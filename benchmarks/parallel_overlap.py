"""Overlap of ColumnParallelLinear's backward collectives with its weight-gradient GEMM: overlapped vs waited-at-once.

    python -m benchmarks.parallel_overlap [--quick] [--tp 2,4] [--shapes s,b,h;...] [--reps N] [--out DIR]

Spawns one local world per tensor-parallel size (gloo on CPU, one thread per rank) and times forward + backward of
``ColumnParallelLinear(h, 4h)`` on ``x [s, b, h]``, with sequence parallelism off (the input gradient's all-reduce
hides behind the wgrad GEMM) and on (the input's re-gather behind dgrad, the gradient's reduce-scatter behind
wgrad), once with ``overlap_comm=True`` and once with ``overlap_comm=False`` (each collective waited for at once).
Every rank runs the same fixed number of steps (a calibrated repeat count could differ between ranks and deadlock
the collectives); a step's time is the slowest rank's, and the table shows the median step. For context it also
times the collectives alone and the wgrad GEMM alone: the saving cannot exceed the smaller of the two.

On a CPU the collective and the GEMM compete for the same cores, so the saving is smaller than on a GPU, where nccl
runs on its own stream and links. Writes DIR/parallel_overlap.json with --out. Never asserts on time.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp_

from megakernels.bench.common import parse_choices, parse_shapes, start, timed_over_ranks, write_json

SHAPES = [(256, 4, 1024), (512, 4, 512)]
QUICK_SHAPES = [(256, 2, 512)]


def _rank(rank: int, world: int, port: int, shapes, reps: int, results) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=600))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    import megakernels.parallel as mp
    from megakernels.parallel import comm

    mp.initialize(world)
    rows = []
    try:
        for s, b, h in shapes:
            for sp in (False, True):
                steps = {}
                for overlap in (False, True):
                    torch.manual_seed(0)
                    layer = mp.ColumnParallelLinear(h, 4 * h, sequence_parallel=sp, overlap_comm=overlap)
                    x = torch.randn(s // world if sp else s, b, h, requires_grad=True)
                    dy = torch.randn(s, b, 4 * h // world)

                    def step(layer=layer, x=x, dy=dy):
                        layer.weight.grad = layer.bias.grad = x.grad = None
                        layer(x).backward(dy)

                    steps["overlap" if overlap else "baseline"] = step
                dgrad, total = torch.randn(s, b, h), torch.randn(s * b, h)
                dy2 = dy.reshape(-1, dy.shape[-1])
                group = mp.tp_group()
                if sp:
                    shard = x.detach()

                    def comm_alone():
                        comm.all_gather(shard, 0, group)
                        comm.reduce_scatter(dgrad, 0, group)
                else:

                    def comm_alone():
                        comm.all_reduce(dgrad, group)

                steps["comm"] = comm_alone
                steps["wgrad"] = lambda: dy2.t().matmul(total)
                t = timed_over_ranks(steps, reps)
                rows.append(
                    {
                        "tp": world,
                        "shape": f"{s}x{b}x{h}",
                        "sp": sp,
                        "baseline_ms": t["baseline"] * 1e3,
                        "overlap_ms": t["overlap"] * 1e3,
                        "ratio": t["overlap"] / t["baseline"],
                        "saved_ms": (t["baseline"] - t["overlap"]) * 1e3,
                        "comm_ms": t["comm"] * 1e3,
                        "wgrad_ms": t["wgrad"] * 1e3,
                    }
                )
    finally:
        mp.destroy()
        dist.destroy_process_group()
    if rank == 0:
        results.put(rows)


def run_world(world: int, shapes, reps: int) -> list[dict]:
    """Spawn ``world`` ranks, run the measurements, return rank 0's rows."""
    ctx = mp_.get_context("spawn")
    results = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    os.environ["OMP_NUM_THREADS"] = "1"
    procs = [
        ctx.Process(target=_rank, args=(r, world, store.port, shapes, reps, results), daemon=True) for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        rows = results.get(timeout=1800)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError(
            f"parallel_overlap: a rank of the tp={world} world failed (exit codes {[p.exitcode for p in procs]})"
        )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small shape, few repeats")
    parser.add_argument("--tp", default="2,4", help="tensor-parallel sizes (comma list of 2, 4, 8)")
    parser.add_argument("--shapes", help="s,b,h;... (s divisible by every tp)")
    parser.add_argument("--reps", type=int, help="timed steps per measurement")
    parser.add_argument("--out", help="write DIR/parallel_overlap.json")
    args = parser.parse_args(argv)
    tps = [int(t) for t in parse_choices(parser, "--tp", args.tp, ["2", "4", "8"])]
    shapes = parse_shapes(parser, args.shapes, "s,b,h") if args.shapes else (QUICK_SHAPES if args.quick else SHAPES)
    for s, _, _ in shapes:
        if any(s % tp for tp in tps):
            parser.error(f"--shapes: sequence length {s} must be divisible by every --tp value {tps}")
    reps = args.reps or (10 if args.quick else 20)
    info = start(parser, "cpu")
    print(f"# ColumnParallelLinear(h, 4h) forward+backward, gloo, 1 thread/rank, median of {reps} steps")
    print(
        f"{'tp':<4}{'s x b x h':<16}{'sp':<7}{'waited ms':>11}{'overlap ms':>12}{'ratio':>8}{'saved ms':>10}"
        f"{'comm ms':>10}{'wgrad ms':>10}"
    )
    rows = []
    for tp in tps:
        for r in run_world(tp, shapes, reps):
            rows.append(r)
            print(
                f"{r['tp']:<4}{r['shape']:<16}{str(r['sp']):<7}{r['baseline_ms']:>11.2f}{r['overlap_ms']:>12.2f}"
                f"{r['ratio']:>8.3f}{r['saved_ms']:>10.2f}{r['comm_ms']:>10.2f}{r['wgrad_ms']:>10.2f}"
            )
    write_json(args.out, "parallel_overlap.json", {"machine": info, "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
