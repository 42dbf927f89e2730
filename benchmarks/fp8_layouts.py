"""FP8 training of the tiny presets at tp 2 × pp 2 (× ep 2 for the MoE preset) against one process, on the CPU.

    python -m benchmarks.fp8_layouts [--steps 10] [--base fp32|bf16] [--out DIR]

For each preset (gpt-tiny, llama-tiny, llama-moe-tiny) and recipe (tensorwise, blockwise) the same run is trained in
one process and in a spawned gloo world of 4 (tp 2 × pp 2) or 8 (tp 2 × pp 2 × ep 2 over dp 2), ``--steps`` steps
with dropout 0; the figure is the largest relative difference of the per-step losses. With ``--base fp32`` (the
default) everything FP8 does not cover is fp32, so the difference measures the layout's effect on FP8 alone (fp32
sums in another order; docs/parallelism.md); with ``--base bf16`` it also holds bf16's own layout
differences. tests/models/test_layouts.py checks the same at the layout suite's small shapes.

Two baselines stand beside each figure, so that it can be read:

- ``perturbed``: the same single process again with every initial weight moved by one fp32 ulp (up or down at
  random) — a change of the size a layout's other order of fp32 sums makes. Casting to FP8 is a step function, so
  an input that moves by an ulp across a rounding boundary moves by an FP8 ulp (6 % in e4m3), and after the first
  update the runs part by what such flips add up to. A layout difference of that size is this effect, not the
  layout's; one far above it would be a layout bug.
- ``fp32``: the same layouts in fp32 throughout (no FP8): the layout's own effect on smooth arithmetic.
"""

from __future__ import annotations

import argparse
import math

import torch

from megakernels.bench.common import machine, machine_line, write_json
from megakernels.ops import fp8

RECIPES = (*fp8.RECIPES, None)  # None: fp32 throughout, the baseline
RUNS = (
    ("gpt-tiny", dict(tp=2, pp=2), 4),
    ("llama-tiny", dict(tp=2, pp=2), 4),
    ("llama-moe-tiny", dict(tp=2, pp=2, ep=2), 8),
)


def _args(preset: str, recipe: str | None, base: str, steps: int, nproc: int = 1, **layout):
    """``recipe`` None: fp32 throughout (the baseline without FP8)."""
    from megakernels_models.arguments import TrainArgs

    fp8_args = {} if recipe is None else {"fp8_recipe": recipe, "fp8_base_precision": base}
    return TrainArgs(
        preset=preset,
        steps=steps,
        precision="fp32" if recipe is None else "fp8",
        **fp8_args,
        dropout=0.0,
        eval_interval=0,
        progress=False,
        nproc=nproc,
        **layout,
    )


def _perturbed_losses(args) -> list[float]:
    """One single-process run of ``args`` whose initial weights are each moved by one fp32 ulp, up or down at random
    (a fixed generator, so the run is repeatable)."""
    import megakernels_models.training.train as trainer

    build = trainer.build_model_chunks

    def perturbed(task, a, device):
        chunks = build(task, a, device)
        g = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            for chunk in chunks:
                for p in chunk.parameters():
                    up = torch.rand(p.shape, generator=g) < 0.5
                    away = torch.where(up, torch.full_like(p, math.inf), torch.full_like(p, -math.inf))
                    p.copy_(torch.nextafter(p, away))
        return chunks

    trainer.build_model_chunks = perturbed
    try:
        return [r["loss"] for r in trainer.train(args)]
    finally:
        trainer.build_model_chunks = build


def _world(rank: int, world_size: int, cases):
    from megakernels_models.training.train import train

    out = {}
    for key, args in cases:
        records = train(args)
        if records is not None:
            out[key] = [r["loss"] for r in records]
    return out


def _max_rel(losses: list[float], ref: list[float]) -> float:
    return float(max(abs(a - b) / b for a, b in zip(losses, ref)))


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
    single, perturbed = {}, {}
    with single_process_world():
        for preset, _, _ in RUNS:
            for recipe in RECIPES:
                args = _args(preset, recipe, ns.base, ns.steps)
                single[(preset, recipe)] = [r["loss"] for r in train(args)]
                perturbed[(preset, recipe)] = _perturbed_losses(args)
    rows, traces = [], {}
    for size in sorted({n for _, _, n in RUNS}):
        cases = [
            ((preset, recipe), _args(preset, recipe, ns.base, ns.steps, size, **layout))
            for preset, layout, n in RUNS
            if n == size
            for recipe in RECIPES
        ]
        got = run_world(size, _world, cases, timeout=3600)[-1]
        for (preset, recipe), args in cases:
            ref, losses = single[(preset, recipe)], got[(preset, recipe)]
            diff, noise = _max_rel(losses, ref), _max_rel(perturbed[(preset, recipe)], ref)
            name, step0 = recipe or "fp32", abs(losses[0] - ref[0]) / ref[0]
            layout = f"tp{args.tp}-pp{args.pp}" + (f"-ep{args.ep}" if args.ep > 1 else "")
            rows.append(
                {
                    "name": preset,
                    "recipe": name,
                    "layout": layout,
                    "base_precision": ns.base if recipe else "fp32",
                    "steps": ns.steps,
                    "max_loss_difference_fraction": diff,
                    "perturbed_max_loss_difference_fraction": noise,
                    "step0_loss_difference_fraction": step0,
                }
            )
            traces[f"{preset} {name} {layout}"] = {
                "layout": losses,
                "single_process": ref,
                "single_process_perturbed": perturbed[(preset, recipe)],
            }
            print(
                f"{preset:>15} {name:>10} {layout:>12}: max |loss - single| / single = {diff:.2e} "
                f"(one-ulp perturbed single process: {noise:.2e}; step 0: {step0:.1e})",
                flush=True,
            )
    write_json(ns.out, "fp8_layouts.json", {"machine": info, "settings": vars(ns), "results": rows, "traces": traces})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
