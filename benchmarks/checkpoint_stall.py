"""How long a checkpoint stops training: a synchronous save vs ``--async-save``, for a model of a few hundred MB.

    python -m benchmarks.checkpoint_stall [--quick] [--hidden 512 --layers 8] [--saves 3] [--out DIR]

Trains a GPT (fp32, one process) twice with the same settings, saving every ``--every`` steps, once synchronously
and once with ``--async-save``, and reads each step's wall time from the trainer's JSONL log (``elapsed_s`` is
taken before the step's save, so a save shows up in the next step's interval). The stall of a save is that
interval minus the median interval of steps without a save; the table shows the median stall over the saves and
the checkpoint's size (model + Adam moments, what each save writes: nothing is frozen, so incremental saving
references nothing). An asynchronous save stalls for the staging copy only, but its writer thread shares the
CPU with training, so on a CPU the following steps slow down a little: the table also shows the mean interval of
all steps, the cost that remains. Writes DIR/checkpoint_stall.json with --out. Never asserts on time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from megakernels.bench.common import machine, machine_line, write_json


def _run(mode: str, args, root: str) -> dict:
    from megakernels.parallel.launch import single_process_world
    from megakernels_models.arguments import TrainArgs
    from megakernels_models.training.train import train

    log = os.path.join(root, f"{mode}.jsonl")
    steps = args.every * (args.saves + 1)
    ta = TrainArgs(
        preset="none",
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_heads=8,
        seq_length=64,
        micro_batch_size=2,
        global_batch_size=2,
        steps=steps,
        eval_interval=0,
        progress=False,
        corpus_bytes=1 << 20,
        save=os.path.join(root, mode),
        save_interval=args.every,
        keep_checkpoints=1,
        async_save=mode == "async",
        log_jsonl=log,
        peak_tflops=1.0,
    )
    with single_process_world():
        records = train(ta)
    t = [r["elapsed_s"] for r in records]
    gaps = [b - a for a, b in zip(t, t[1:])]  # gaps[i]: from step i+1's record to step i+2's
    after_save = {i for i in range(len(gaps)) if (i + 1) % args.every == 0}  # step i+1 saved
    plain = [g for i, g in enumerate(gaps) if i not in after_save and i > 0]  # the first step warms up
    base = statistics.median(plain)
    stalls = [gaps[i] - base for i in sorted(after_save)]
    with open(os.path.join(root, mode, "latest")) as f:
        ckpt = os.path.join(root, mode, f.read().strip())
    size = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))
    return {
        "mode": mode,
        "median_stall_s": statistics.median(stalls),
        "stalls_s": stalls,
        "step_s": base,
        "mean_interval_s": statistics.mean(gaps[1:]),
        "checkpoint_mb": size / 1e6,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.checkpoint_stall",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="a small model, one save each (a smoke run)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--every", type=int, default=4, help="steps between saves")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--out", help="write DIR/checkpoint_stall.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.every, args.saves = 64, 2, 3, 1
    info = machine("cpu")
    print(machine_line(info))
    rows = []
    with tempfile.TemporaryDirectory(prefix="megakernels-stall-") as root:
        for mode in ("sync", "async"):
            rows.append(_run(mode, args, root))
    print(f"{'save':>6} {'checkpoint MB':>14} {'step s':>8} {'stall s (median)':>17} {'mean step s':>12}")
    for r in rows:
        print(
            f"{r['mode']:>6} {r['checkpoint_mb']:>14.1f} {r['step_s']:>8.3f} {r['median_stall_s']:>17.3f} "
            f"{r['mean_interval_s']:>12.3f}"
        )
    sync, async_ = rows
    if sync["median_stall_s"] > 0:
        print(f"async stall / sync stall = {async_['median_stall_s'] / sync['median_stall_s']:.2f}")
    write_json(args.out, "checkpoint_stall.json", {"machine": info, "results": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
