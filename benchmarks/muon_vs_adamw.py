"""Muon against AdamW at the same steps on the embedded corpus, each optimizer's learning rate swept.

    python -m benchmarks.muon_vs_adamw [--presets gpt-tiny,llama-tiny] [--lrs 1e-3,3e-3,1e-2] [--steps 150]
                                       [--eval-steps 8] [--out DIR]

Every (preset, optimizer, learning rate) trains in this process from the same seed, on the same global batches,
with the trainer's defaults otherwise (fp32, cosine decay to a tenth of the peak after a tenth of the steps of
warmup, weight decay 0.1, clipping at 1); ``--optimizer muon`` takes Muon's defaults (momentum 0.95 with Nesterov,
5 Newton-Schulz steps, Moonlight's update scale, so the learning rates are AdamW's). The validation loss is the mean
over ``--eval-steps`` batches of the validation split after the last step. The table gives, per preset and
optimizer, each rate's final training and validation loss and the best one.
"""

from __future__ import annotations

import argparse
import time

from megakernels.bench.common import machine, machine_line, write_json


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.muon_vs_adamw",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--presets", default="gpt-tiny,llama-tiny")
    parser.add_argument("--lrs", default="1e-3,3e-3,1e-2")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eval-steps", type=int, default=8)
    parser.add_argument("--out", help="write DIR/muon_vs_adamw.json")
    ns = parser.parse_args(argv)
    from megakernels.parallel.launch import single_process_world
    from megakernels_models.arguments import TrainArgs
    from megakernels_models.training.train import train

    info = machine("cpu")
    print(machine_line(info))
    lrs = [float(v) for v in ns.lrs.split(",")]
    rows = []
    print(f"{'preset':>12} {'optimizer':>9} {'lr':>8} {'train loss':>11} {'val loss':>9} {'seconds':>8}", flush=True)
    for preset in ns.presets.split(","):
        for optimizer in ("adamw", "muon"):
            for lr in lrs:
                args = TrainArgs(
                    preset=preset,
                    optimizer=optimizer,
                    lr=lr,
                    min_lr=lr / 10,
                    steps=ns.steps,
                    eval_interval=ns.steps,
                    eval_steps=ns.eval_steps,
                    progress=False,
                )
                t0 = time.perf_counter()
                with single_process_world():
                    records = train(args)
                seconds = time.perf_counter() - t0
                last = records[-1]
                rows.append(
                    {
                        "preset": preset,
                        "optimizer": optimizer,
                        "lr": f"{lr:g}",  # a setting (a string), not a figure of the run
                        "train_loss": last["loss"],
                        "val_loss": last["val_loss"],
                        "wall_s": seconds,
                        "train_losses": [r["loss"] for r in records],
                    }
                )
                print(
                    f"{preset:>12} {optimizer:>9} {lr:>8.0e} {last['loss']:>11.4f} {last['val_loss']:>9.4f} "
                    f"{seconds:>8.0f}",
                    flush=True,
                )
    print("\nbest validation loss per preset and optimizer:")
    for preset in ns.presets.split(","):
        for optimizer in ("adamw", "muon"):
            best = min(
                (r for r in rows if r["preset"] == preset and r["optimizer"] == optimizer), key=lambda r: r["val_loss"]
            )
            print(f"{preset:>12} {optimizer:>9} lr {best['lr']}: {best['val_loss']:.4f}")
    write_json(ns.out, "muon_vs_adamw.json", {"machine": info, "settings": vars(ns), "results": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
