"""Zero-bubble pipeline schedules: the simulator's bubble fractions beside the paper's, and the activation memory each
schedule holds, measured.

    python -m benchmarks.zero_bubble --out DIR [--pp 4] [--microbatches 8] [--skip-memory]

1. Bubble fractions (``megakernels.parallel.pipeline.schedules.simulate``, idle time over useful time of one
   synchronous step) of 1f1b, zb-h1 and zb-v for pp in {4, 8, 16, 32} and m in {3·pp, 4·pp, 8·pp}: at the zero-bubble
   paper's T_F = T_B = T_W, and at a GPT's own forward, input- and weight-gradient times (``config.stage_times`` of
   gpt-1.3b, without and with full recomputation). Beside them the published closed forms (Qi et al. 2023; the
   sea-ai-lab/sail-sg zero-bubble-pipeline-parallelism README's table, at T_F = T_B = T_W: 1F1B (p-1)/m, ZB-1P
   (p-1)/(3m) — the automatic schedule with 1F1B's memory, whose value ZB-H1's (p-1)(T_F+T_B-T_W) also gives — and
   ZB-V 0) and ours (``bubble_fraction``).
2. Memory: one training step of a small GPT (8 layers, hidden 256, 8 heads, sequence 256, micro-batch 2, fp32) at pp
   (default 4) in a spawned gloo world, under 1f1b, gpipe, zb-h1 and zb-v, each rank's peak activation bytes measured
   by the executor (``forward_backward(stats=...)``: the tensors autograd saves plus what deferred weight gradients
   hold, each storage once) and its peak of micro-batches in flight; beside them the simulator's.

Writes ``DIR/zero_bubble.json`` (the ``results`` layout of ``benchmarks.results_table``) and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from megakernels.parallel.pipeline.schedules import TRAINER_SCHEDULES, ZERO_BUBBLE

SCHEDULES = ("1f1b", *ZERO_BUBBLE)
PPS = (4, 8, 16, 32)


def paper(name: str, p: int, m: int) -> float:
    """The README's bubble rates at T_F = T_B = T_W (ZB-H1 = ZB-1P's (p-1)/(3m); ZB-V 0)."""
    return {"1f1b": (p - 1) / m, "zb-h1": (p - 1) / (3 * m), "zb-v": 0.0}[name]


def bubbles() -> list[dict]:
    from megakernels.parallel.pipeline import schedules
    from megakernels_models.models.config import preset, stage_times

    cfg = preset("gpt-1.3b")
    times = {
        "equal": (1.0, 2.0, 1.0),
        "gpt-1.3b": stage_times(cfg),
        "gpt-1.3b-recompute-full": stage_times(cfg, "full"),
    }
    rows = []
    for label, t in times.items():
        for p in PPS:
            for m in (3 * p, 4 * p, 8 * p):
                if label != "equal" and p > 16:
                    continue  # the model's times at the longest pipelines: minutes of simulation, same story
                for name in SCHEDULES:
                    sim = schedules.simulate(name, p, m, None, *t)
                    row = {
                        "name": f"bubble {name}",
                        "kind": "predicted",  # simulated and closed forms, not timed
                        "times": label,
                        "t_forward_backward_weight": "/".join(f"{x:g}" for x in t),
                        "pp": p,
                        "microbatches": m,
                        "simulated_bubble_fraction": sim["bubble_fraction"],
                        "closed_form_bubble_fraction": schedules.bubble_fraction(name, p, m, None, *t),
                        "peak_in_flight_microbatches": int(max(sim["peak_activations"])),
                    }
                    if label == "equal":
                        row["paper_bubble_fraction"] = paper(name, p, m)
                    rows.append(row)
    return rows


def _memory_world(rank, world_size, schedules, m):
    import torch

    import megakernels.parallel as mpu
    from megakernels.parallel.ddp import finalize_model_grads, wrap_model
    from megakernels_models.arguments import TrainArgs, validate
    from megakernels_models.data.build import build_datasets
    from megakernels_models.models.registry import task_for
    from megakernels_models.training.timers import StepTimers
    from megakernels_models.training.train import PipelineStep, build_model_chunks

    torch.set_num_threads(1)
    out = {}
    for schedule in schedules:
        args = TrainArgs(
            preset=None,
            model="gpt",
            num_layers=8,
            hidden_size=256,
            num_heads=8,
            seq_length=256,
            dropout=0.0,
            micro_batch_size=2,
            global_batch_size=2 * m,
            pp=world_size,
            nproc=world_size,
            schedule=schedule,
            corpus_bytes=1 << 20,
            eval_interval=0,
            progress=False,
            seed=3,
        )
        cfg = validate(args, check_memory=False)
        mpu.initialize(1, world_size, placement=args.pipeline_placement())
        try:
            task = task_for(cfg)
            mpu.model_parallel_seed(args.seed, "cpu")
            chunks = build_model_chunks(task, args, torch.device("cpu"))
            wrappers = [wrap_model(c) for c in chunks]
            train_ds, _, _ = build_datasets(args, cfg)
            step = PipelineStep(task, chunks, wrappers, args, torch.device("cpu"), StepTimers(False, "cpu"))
            for _ in range(2):  # the second step measured (the first builds caches)
                for d in (d for ws in wrappers for d in ws):
                    d.zero_grad_buffer()
                step.stats = {}
                t0 = time.perf_counter()
                loss = step(train_ds, 0)
                finalize_model_grads([d for ws in wrappers for d in ws])
                seconds = time.perf_counter() - t0
            out[schedule] = dict(step.stats, step_s=seconds, loss=float(loss))
        finally:
            mpu.destroy()
    return out


def memory(pp: int, m: int) -> list[dict]:
    from megakernels.parallel.launch import run_world
    from megakernels.parallel.pipeline import schedules

    names = TRAINER_SCHEDULES
    per_rank = run_world(pp, _memory_world, names, m, timeout=1800)
    rows = []
    for name in names:
        sim = schedules.simulate(name, pp, m)
        for r, got in enumerate(per_rank):
            s = got[name]
            rows.append(
                {
                    "name": f"memory {name}",
                    "pp": pp,
                    "microbatches": m,
                    "rank": r,
                    "peak_activation_mib": s["peak_activation_bytes"] / 2**20,
                    "peak_live_microbatches": s["peak_live_microbatches"],
                    "simulated_peak_in_flight": int(sim["peak_in_flight"][r]),
                    "peak_deferred_w": s["peak_deferred"],
                }
            )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--skip-memory", action="store_true")
    ns = ap.parse_args(argv)

    t0 = time.perf_counter()
    results = bubbles()
    print(f"bubbles: {len(results)} rows in {time.perf_counter() - t0:.0f} s", flush=True)
    if not ns.skip_memory:
        results += memory(ns.pp, ns.microbatches)
    from megakernels.bench import common

    report = {
        "machine": common.machine(),
        "commands": [f"python -m benchmarks.zero_bubble --out {ns.out} --pp {ns.pp} --microbatches {ns.microbatches}"],
        "load": f"load average {os.getloadavg()[0]:.1f} at the end",
        "results": results,
    }
    os.makedirs(ns.out, exist_ok=True)
    with open(os.path.join(ns.out, "zero_bubble.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    for row in results:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
