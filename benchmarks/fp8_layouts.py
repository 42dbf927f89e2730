"""FP8 training of the tiny presets at tp 2 × pp 2 (× ep 2 for the MoE preset) against one process, on the CPU.

    python -m benchmarks.fp8_layouts [--steps 10] [--base fp32|bf16] [--out DIR]

For each preset (gpt-tiny, llama-tiny, llama-moe-tiny) and recipe (tensorwise, blockwise) the same run is trained in
one process and in a spawned gloo world of 4 (tp 2 × pp 2) or 8 (tp 2 × pp 2 × ep 2 over dp 2), ``--steps`` steps
with dropout 0; the figure is the largest relative difference of the per-step losses. With ``--base fp32`` (the
default) everything FP8 does not cover is fp32, so the difference measures the layout's effect on FP8 alone (fp32
sums in another order; docs/design.md §4 "FP8 training"); with ``--base bf16`` it also holds bf16's own layout
differences. tests/models/test_layouts.py checks the same at the layout suite's small shapes.
"""

from __future__ import annotations

import argparse

from megakernels.bench.common import machine, machine_line, write_json

RUNS = (
    ("gpt-tiny", dict(tp=2, pp=2), 4),
    ("llama-tiny", dict(tp=2, pp=2), 4),
    ("llama-moe-tiny", dict(tp=2, pp=2, ep=2), 8),
)


def _args(preset: str, recipe: str, base: str, steps: int, nproc: int = 1, **layout):
    from megakernels_models.arguments import TrainArgs

    return TrainArgs(
        preset=preset,
        steps=steps,
        precision="fp8",
        fp8_recipe=recipe,
        fp8_base_precision=base,
        dropout=0.0,
        eval_interval=0,
        progress=False,
        nproc=nproc,
        **layout,
    )


def _world(rank: int, world_size: int, cases):
    from megakernels_models.training.train import train

    out = {}
    for key, args in cases:
        records = train(args)
        if records is not None:
            out[key] = [r["loss"] for r in records]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.fp8_layouts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--base", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--out", help="write DIR/fp8_layouts.json")
    ns = parser.parse_args(argv)
    from megakernels.parallel.launch import run_world, single_process_world
    from megakernels_models.training.train import train

    info = machine("cpu")
    print(machine_line(info))
    single = {}
    with single_process_world():
        for preset, _, _ in RUNS:
            for recipe in ("tensorwise", "blockwise"):
                single[(preset, recipe)] = [r["loss"] for r in train(_args(preset, recipe, ns.base, ns.steps))]
    rows, traces = [], {}
    for size in sorted({n for _, _, n in RUNS}):
        cases = [
            ((preset, recipe), _args(preset, recipe, ns.base, ns.steps, size, **layout))
            for preset, layout, n in RUNS
            if n == size
            for recipe in ("tensorwise", "blockwise")
        ]
        got = run_world(size, _world, cases, timeout=3600)[-1]
        for (preset, recipe), args in cases:
            ref, losses = single[(preset, recipe)], got[(preset, recipe)]
            diff = max(abs(a - b) / b for a, b in zip(losses, ref))
            layout = f"tp{args.tp}-pp{args.pp}" + (f"-ep{args.ep}" if args.ep > 1 else "")
            rows.append(
                {
                    "name": preset,
                    "recipe": recipe,
                    "layout": layout,
                    "base_precision": ns.base,
                    "steps": ns.steps,
                    "max_loss_difference_fraction": float(diff),
                }
            )
            traces[f"{preset} {recipe} {layout}"] = {"layout": losses, "single_process": ref}
            print(f"{preset:>15} {recipe:>10} {layout:>12}: max |loss - single| / single = {diff:.2e}", flush=True)
    write_json(ns.out, "fp8_layouts.json", {"machine": info, "settings": vars(ns), "results": rows, "traces": traces})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
