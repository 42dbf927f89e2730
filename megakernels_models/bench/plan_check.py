"""Does ``megakernels plan`` order layouts as this machine runs them? Four layouts of a small GPT on 4 local gloo
processes are predicted with a CPU device profile measured here and then trained; the two orders are compared.

The CPU profile (``cpu_device``): the GEMM rate of one rank (the machine's measured fp32 GEMM rate shared by the
ranks), an efficiency of 0.5 for these small GEMMs, and gloo's measured all-reduce bandwidth and latency between
two local processes (loopback TCP), used for every link (all ranks are on one node).
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch
import torch.distributed as dist

from megakernels_models.planning import costs

LAYOUTS = {"dp4": dict(), "tp2-dp2": dict(tp=2), "pp2-dp2": dict(pp=2), "tp4": dict(tp=4)}
EFFICIENCY = 0.5


def _collective_times(rank: int, world: int) -> tuple[float, float]:
    small, big = torch.zeros(1), torch.zeros(1 << 20)  # 4 B and 4 MiB
    for t in (small, big):
        dist.all_reduce(t)
    out = []
    for t, reps in ((small, 50), (big, 10)):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(t)
        out.append((time.perf_counter() - t0) / reps)
    return out[0], out[1]


def cpu_device(nproc: int) -> costs.Device:
    """The CPU profile for ``nproc`` local ranks (see the module docstring)."""
    from megakernels.parallel.launch import run_world
    from megakernels_models.training.mfu import cpu_peak_tflops

    cores = os.cpu_count() or 1
    threads = torch.get_num_threads()
    torch.set_num_threads(cores)
    try:
        machine = cpu_peak_tflops(torch.float32)
    finally:
        torch.set_num_threads(threads)
    latency, big = run_world(2, _collective_times, timeout=120)[0]
    gbps = 2 * 0.5 * (4 << 20) / max(big - latency, 1e-9) / 1e9  # a 2-rank ring moves half the bytes each way
    per_rank = machine / nproc
    return costs.Device("CPU", per_rank, per_rank, EFFICIENCY, 1e6, gbps, gbps, latency)


def _kendall(a: list, b: list) -> float:
    pairs = [(i, j) for i in range(len(a)) for j in range(i + 1, len(a))]
    score = sum(
        1 if (a.index(x) - a.index(y)) * (b.index(x) - b.index(y)) > 0 else -1
        for x, y in ((a[i], a[j]) for i, j in pairs)
    )
    return score / len(pairs)


def default_args(steps: int):
    """``args_for`` of ``run``: gpt-tiny on 4 local processes for ``steps`` optimizer steps (global batch 16)."""
    from megakernels_models.arguments import TrainArgs

    base = TrainArgs(
        preset="gpt-tiny",
        nproc=4,
        steps=steps,
        micro_batch_size=2,
        global_batch_size=16,
        eval_interval=0,
        progress=False,
        warmup_steps=0,
        corpus_bytes=1 << 20,
        dropout=0.0,
    )
    return lambda changes: dataclasses.replace(base, **changes)


def run(args_for, warmup: int = 1, log=print) -> dict:
    """Predict and measure ``LAYOUTS``; ``args_for(changes)`` gives the ``TrainArgs`` of a layout (4 processes);
    the first ``warmup`` steps of each are not timed. Returns ``{"device", "predicted": {layout: s},
    "measured": {...}, "predicted_order", "measured_order", "kendall_tau",
    "agree"}``."""
    from megakernels_models.arguments import validate
    from megakernels_models.training.train import run as train_run

    device = cpu_device(4)
    log(
        f"# CPU profile: {device.tflops_32:.3g} TFLOP/s per rank, gloo {device.intra_gbps:.3g} GB/s, "
        f"latency {device.latency_s * 1e6:.0f} µs"
    )
    predicted, measured = {}, {}
    meta = None
    for name, changes in LAYOUTS.items():
        args = args_for(changes)
        cfg = validate(args)
        meta = meta if meta is not None and meta.config == cfg else costs.MetaModel(cfg)
        predicted[name] = costs.predict(meta, costs.Layout.of(args, cfg), device, gpus_per_node=4)["step_s"]
        records = train_run(args)
        warm = min(warmup, len(records) - 1)
        tokens = args.global_batch_size * cfg.seq_length
        measured[name] = sum(tokens / r["tokens_per_s"] for r in records[warm:]) / len(records[warm:])
        log(f"{name:>8}: predicted {predicted[name]:.3f} s/step, measured {measured[name]:.3f} s/step")
    p_order = sorted(predicted, key=predicted.get)
    m_order = sorted(measured, key=measured.get)
    out = {
        "device": dataclasses.asdict(device),
        "predicted": predicted,
        "measured": measured,
        "predicted_order": p_order,
        "measured_order": m_order,
        "kendall_tau": _kendall(p_order, m_order),
        "agree": p_order == m_order,
    }
    log(f"predicted order {p_order}; measured {m_order}; Kendall tau {out['kendall_tau']:.2f}")
    return out
