"""Published FlashAttention measurements beside our kernels' static predictions: a comparison, not a calibration.

``python -m costmodel.published [--csv FILE ...] [--out DIR]`` reads CSVs of published attention
throughputs (``gpu, pass, head_dim, seqlen, batch, heads, causal, dtype, implementation, published_tflops, source``;
``benchmarks/published/flash_attention_fa3_h100.csv`` holds the FlashAttention-3 paper's H100 figures,
``flash_attention_fa2_a100.csv`` the FlashAttention-2 paper's A100 ones) and, for each (GPU, pass, head dim,
sequence, mask), predicts our FlashAttention kernel's TFLOP/s at that shape with its default config for that GPU's
architecture, compiled for it (``model.machine_for``; FLOPs counted as the papers count them: 4 b h s^2 d forward,
2.5 times that backward, 3.5 times for ``fwd_bwd`` over the forward's time plus the backward's, halved under a
causal mask), and prints it beside every published implementation with ours over each. The tiled-MMA model has
never been fitted to a measurement: where it predicts more than the best published kernel reaches on the same GPU,
it is the model that is optimistic (costmodel/README.md).
"""

from __future__ import annotations

import argparse
import csv
import json
import os

from costmodel import model

FIELDS = ("gpu", "pass", "head_dim", "seqlen", "batch", "heads", "causal", "implementation", "published_tflops")


def read(path: str) -> list[dict]:
    """The rows of a published-attention CSV; a missing column is an error naming it."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    missing = [c for c in FIELDS if rows and c not in rows[0]]
    if missing:
        raise ValueError(f"{path}: missing column(s) {', '.join(missing)} (need {', '.join(FIELDS)})")
    return rows


def _key(r: dict) -> tuple:
    return (r["gpu"], r["pass"], int(r["head_dim"]), int(r["seqlen"]), int(r["causal"]))


def predict(gpu: str, passname: str, d: int, s: int, causal: bool) -> dict:
    """Our kernel's static prediction at the shape (batch 16k / s, heads 2048 / d, the static report's convention)."""
    from costmodel import attention

    m = model.machine_for(gpu)
    if m is None:
        raise ValueError(f"GPU {gpu!r} is not in model.MACHINES")
    keys = ("config", "predicted_tflops", "predicted_fraction", "bound", "spill_bytes", "mma")
    if passname != "fwd_bwd":
        row = attention.default_prediction(passname, s, d, causal, m)
        return {k: row[k] for k in keys}
    fwd, bwd = (attention.default_prediction(p, s, d, causal, m) for p in ("fwd", "bwd"))
    t_f, t_b = (r["predicted_time_us"] for r in (fwd, bwd))
    tflops = (fwd["predicted_tflops"] * t_f + bwd["predicted_tflops"] * t_b) / (t_f + t_b)
    return {
        "config": f"{fwd['config']} / {bwd['config']}",
        "predicted_tflops": tflops,
        "predicted_fraction": tflops * fwd["predicted_fraction"] / fwd["predicted_tflops"],
        "bound": f"{fwd['bound']} / {bwd['bound']}",
        "spill_bytes": max(fwd["spill_bytes"], bwd["spill_bytes"]),
        "mma": fwd["mma"] if fwd["mma"] == bwd["mma"] else f"{fwd['mma']} / {bwd['mma']}",
    }


def compare(rows: list[dict]) -> list[dict]:
    """One entry per shape: our prediction and every published implementation's TFLOP/s, with ours over each."""
    shapes: dict = {}
    for r in rows:
        shapes.setdefault(_key(r), {})[r["implementation"]] = float(r["published_tflops"])
    out = []
    for (gpu, passname, d, s, causal), published in sorted(shapes.items()):
        ours = predict(gpu, passname, d, s, bool(causal))
        out.append(
            {
                "gpu": gpu,
                "pass": passname,
                "head_dim": d,
                "seqlen": s,
                "causal": bool(causal),
                "ours": ours,
                "published_tflops": published,
                "ours_over": {k: ours["predicted_tflops"] / v for k, v in published.items()},
            }
        )
    return out


def table(out: list[dict]) -> list[str]:
    impls = sorted({k for o in out for k in o["published_tflops"]})
    width = {i: max(18, len(i) + 2) for i in impls}
    head = f"{'pass':<8}{'d':>4}{'seq':>7} {'mask':<7}{'ours (pred.)':>13}" + "".join(f"{i:>{width[i]}}" for i in impls)
    lines = [head]
    for o in out:
        cells = "".join(
            f"{o['published_tflops'][i]:>{width[i] - 9}.0f} ({o['ours_over'][i]:4.2f}x)"
            if i in o["published_tflops"]
            else f"{'-':>{width[i]}}"
            for i in impls
        )
        lines.append(
            f"{o['pass']:<8}{o['head_dim']:>4}{o['seqlen']:>7} {'causal' if o['causal'] else 'full':<7}"
            f"{o['ours']['predicted_tflops']:>13.0f}{cells}"
        )
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--csv",
        nargs="+",
        default=[
            os.path.join("benchmarks", "published", name)
            for name in ("flash_attention_fa3_h100.csv", "flash_attention_fa2_a100.csv")
        ],
    )
    ap.add_argument("--out", default=None, help="write DIR/attention_published.json")
    args = ap.parse_args(argv)
    out = compare([r for path in args.csv for r in read(path)])
    for line in table(out):
        print(line)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        from megakernels.bench.common import git_commit

        with open(os.path.join(args.out, "attention_published.json"), "w") as f:
            gpus = sorted({o["gpu"] for o in out})
            payload = {
                "kind": "static vs published attention",
                "machine": {"name": "published measurements on " + ", ".join(gpus)},
                "commit": git_commit(),
                "date": __import__("time").strftime("%Y-%m-%d"),
                "csv": args.csv,
                "shapes": out,
            }
            json.dump(payload, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
