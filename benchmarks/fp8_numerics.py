"""FP8 training's numerics, measured on the CPU: per-op error against bf16 and training curves in fp8 vs bf16.

    python -m benchmarks.fp8_numerics [--steps 300] [--presets gpt-tiny,llama-tiny,llama-moe-tiny] [--out DIR]
    python -m benchmarks.fp8_numerics --ops-only --out DIR

1. Per-op error (``--ops-only`` runs just this): for each recipe, the relative Frobenius error against an fp64
   product of the unrounded operands of (a) the forward GEMM, (b) the input gradient, (c) the weight gradient of a
   linear layer (``ops.fp8_linear``) and of the bf16 ``F.linear`` beside it, at Llama-like shapes (4096 tokens,
   h 1024 -> 2816 and back) with activations whose rows vary in scale (a few large-norm tokens, as real
   activations have), and the experts' grouped GEMM forward.
2. Curves: each preset trained ``--steps`` steps in one process in bf16, fp8 tensorwise and fp8 blockwise (same seed,
   data and schedule); the figure is the final loss (the mean of the last 10 steps' losses) and fp8's relative
   difference from bf16's. The per-step losses go into the report and a plot (``fp8_curves.png``).

Everything is computed on this machine's CPU, where FP8 quantisation uses the real e4m3/e5m2 dtypes and gives the
bits a GPU would (ops/fp8.py); only the order of fp32 sums differs from a GPU's. Never asserts on time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megakernels.bench.common import machine, machine_line, write_json

PRESETS = ("gpt-tiny", "llama-tiny", "llama-moe-tiny")
MODES = (("bf16", None), ("fp8", "tensorwise"), ("fp8", "blockwise"))


def _relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.detach().double() - ref).norm() / ref.norm())


def op_errors(tokens: int = 4096, hidden: int = 1024, ffn: int = 2816, seed: int = 0) -> list[dict]:
    """Relative errors of the FP8 recipes' GEMMs and of bf16's against fp64 (section 1 of the docstring)."""
    from megakernels.ops import fp8

    g = torch.Generator().manual_seed(seed)
    rows = []
    for k, n in ((hidden, ffn), (ffn, hidden)):
        scale = torch.exp(torch.randn(tokens, 1, generator=g))  # token norms spread over ~e^±2
        x = torch.randn(tokens, k, generator=g) * scale
        w = torch.randn(n, k, generator=g) / k**0.5
        dy = torch.randn(tokens, n, generator=g) * 1e-3 * torch.exp(torch.randn(tokens, 1, generator=g))
        ref_y = x.double() @ w.double().t()
        ref_dx, ref_dw = dy.double() @ w.double(), dy.double().t() @ x.double()
        xb, wb, dyb = x.bfloat16(), w.bfloat16(), dy.bfloat16()
        shape = f"{tokens}x{k}->{n}"
        bf16 = {
            "forward": _relative(xb @ wb.t(), ref_y),
            "input_grad": _relative(dyb @ wb, ref_dx),
            "weight_grad": _relative(dyb.t() @ xb, ref_dw),
        }
        rows.append(
            {"name": "linear", "recipe": "bf16", "shape": shape, **{f"{p}_error_fraction": v for p, v in bf16.items()}}
        )
        for name in fp8.RECIPES:
            xr, wr = xb.clone().requires_grad_(), wb.clone().requires_grad_()
            y = fp8.fp8_linear(xr, wr, recipe=name)
            y.backward(dyb)
            errs = {
                "forward": _relative(y, ref_y),
                "input_grad": _relative(xr.grad, ref_dx),
                "weight_grad": _relative(wr.grad, ref_dw),
            }
            rows.append(
                {
                    "name": "linear",
                    "recipe": name,
                    "shape": shape,
                    **{f"{p}_error_fraction": v for p, v in errs.items()},
                }
            )
    # the experts' grouped GEMM (forward), 8 groups of uneven sizes
    sizes = torch.tensor([700, 300, 0, 900, 512, 1000, 84, 600])
    e, t = len(sizes), int(sizes.sum())
    x = torch.randn(t, hidden, generator=g) * torch.exp(torch.randn(t, 1, generator=g))
    w = torch.randn(e, ffn, hidden, generator=g) / hidden**0.5
    ref = torch.cat([x[a:b].double() @ w[i].double().t() for i, a, b in _bounds(sizes)])
    got = torch.cat([x[a:b].bfloat16() @ w[i].bfloat16().t() for i, a, b in _bounds(sizes)])
    rows.append(
        {
            "name": "grouped_gemm",
            "recipe": "bf16",
            "shape": f"{t}x{hidden}->{ffn}x{e}",
            "forward_error_fraction": _relative(got, ref),
        }
    )
    for name, rec in fp8.RECIPES.items():
        a, sa, _, _ = fp8.fp8_quantize(x.bfloat16(), rec.input_format, rec.input_granularity)
        qs = [fp8.fp8_quantize(w[i].bfloat16(), rec.weight_format, rec.weight_granularity) for i in range(e)]
        b, sb = torch.stack([q[0] for q in qs]), torch.stack([q[1] for q in qs])
        out = fp8.fp8_grouped_gemm(
            a, sa, b, sb, sizes, a_granularity=rec.input_granularity, b_granularity=rec.weight_granularity
        )
        rows.append(
            {
                "name": "grouped_gemm",
                "recipe": name,
                "shape": f"{t}x{hidden}->{ffn}x{e}",
                "forward_error_fraction": _relative(out, ref),
            }
        )
    return rows


def _bounds(sizes):
    start = 0
    for i, n in enumerate(sizes.tolist()):
        yield i, start, start + n
        start += n


def curve(
    preset: str,
    precision: str,
    recipe: str | None,
    steps: int,
    global_batch: int | None = None,
    seed: int | None = None,
) -> dict:
    """One training run of ``preset`` (one process; ``global_batch`` samples a step, the preset's default when None,
    in micro-batches of at most 4; ``seed``: the trainer's, its default when None): its per-step losses and the mean
    step time."""
    from megakernels.parallel.launch import single_process_world
    from megakernels_models.arguments import TrainArgs, validate
    from megakernels_models.training.train import train

    batch = (
        {} if global_batch is None else {"global_batch_size": global_batch, "micro_batch_size": min(4, global_batch)}
    )
    seeded = {} if seed is None else {"seed": seed}
    args = TrainArgs(
        preset=preset, steps=steps, precision=precision, eval_interval=0, progress=False, **batch, **seeded
    )
    if recipe:
        args = TrainArgs(**{**vars(args), "fp8_recipe": recipe})
    validate(args)
    start = time.perf_counter()
    with single_process_world():
        records = train(args)
    seconds = time.perf_counter() - start
    losses = [r["loss"] for r in records]
    return {
        "name": preset,
        "precision": _mode_name(precision, recipe),
        "steps": steps,
        "global_batch_size": args.global_batch_size,
        "seed": args.seed,
        "final_loss": statistics.fmean(losses[-10:]),
        "step_s": seconds / steps,
        "losses": losses,
    }


def _mode_name(precision: str, recipe: str | None) -> str:
    return precision if recipe is None else f"{precision}-{recipe}"


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = sorted({r["name"] for r in rows}, key=list(PRESETS).index)
    fig, axes = plt.subplots(1, len(presets), figsize=(5 * len(presets), 4), squeeze=False)
    for ax, preset in zip(axes[0], presets):
        for r in rows:
            if r["name"] == preset:
                ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["precision"], linewidth=0.8)
        ax.set_title(preset)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.fp8_numerics",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--ops-only", action="store_true", help="only the per-op errors")
    parser.add_argument("--no-ops", action="store_true", help="only the curves")
    parser.add_argument("--global-batch-size", type=int, help="samples a step (default: the preset's)")
    parser.add_argument("--seed", type=int, help="the trainer's seed (default: its own)")
    parser.add_argument(
        "--modes",
        default=",".join(_mode_name(*m) for m in MODES),
        help="the runs of each preset, of bf16, fp8-tensorwise, fp8-blockwise (default: all three)",
    )
    parser.add_argument("--out", help="write DIR/fp8_numerics.json (and DIR/fp8_curves.png)")
    args = parser.parse_args(argv)
    unknown = set(args.modes.split(",")) - {_mode_name(*m) for m in MODES}
    if unknown:
        parser.error(f"--modes: unknown {', '.join(sorted(unknown))} (bf16, fp8-tensorwise, fp8-blockwise)")
    info = machine("cpu")
    print(machine_line(info))
    ops = [] if args.no_ops else op_errors()
    print(f"{'op':>13} {'recipe':>10} {'shape':>22} {'forward':>9} {'input grad':>11} {'weight grad':>12}")
    for r in ops:
        cols = [r.get(f"{p}_error_fraction") for p in ("forward", "input_grad", "weight_grad")]
        print(
            f"{r['name']:>13} {r['recipe']:>10} {r['shape']:>22} "
            + " ".join(f"{c:>10.3%}" if c is not None else f"{'':>10}" for c in cols)
        )
    rows = []
    if not args.ops_only:
        for preset in args.presets.split(","):
            modes = [m for m in MODES if _mode_name(*m) in args.modes.split(",")]
            runs = [curve(preset, p, r, args.steps, args.global_batch_size, args.seed) for p, r in modes]
            if runs and runs[0]["precision"] == "bf16":
                for run in runs[1:]:
                    run["final_loss_difference_fraction"] = run["final_loss"] / runs[0]["final_loss"] - 1
            rows += runs
            for run in runs:
                diff = run.get("final_loss_difference_fraction")
                print(
                    f"{preset:>15} {run['precision']:>16} final loss {run['final_loss']:.4f}"
                    + (f" ({diff:+.2%} vs bf16)" if diff is not None else "")
                    + f"  {run['step_s']:.2f} s/step",
                    flush=True,
                )
    # the per-step losses are traces (beside the results, not figures of the table)
    traces = {f"{r['name']} {r['precision']}": r["losses"] for r in rows}
    figures = [{k: v for k, v in r.items() if k != "losses"} for r in rows]
    report = {"machine": info, "settings": vars(args), "results": ops + figures, "traces": traces}
    path = write_json(args.out, "fp8_numerics.json", report)
    if path and rows:
        _plot(rows, path.replace("fp8_numerics.json", "fp8_curves.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
