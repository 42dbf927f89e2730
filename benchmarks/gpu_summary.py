"""The closing table of scripts/gpu_check.sh: each stage's result, the measured numbers against the targets of
docs/benchmarks.md, and every measurement beside what the static cost model predicted for it (costmodel/README.md,
``megakernels bench --static``; the ratio calibrates the model), read back from the JSON files the benchmarks
wrote into OUTDIR and its subfolders.

    python -m benchmarks.gpu_summary OUTDIR [--title TEXT]

Targets (H200):
- FlashAttention d128 bf16, s >= 4k: forward >= 550 TFLOP/s, backward >= 420 TFLOP/s (the backward's own rate,
  ``bwd_TFLOPs`` of the fwd+bwd rows); one line per pass and masking, the worst sequence length shown;
- memory-bound kernels (norm family, softmax family, cross-entropy), rows >= 4k: >= 90% of the copy bandwidth
  measured in the same run; one line per op and pass, the worst shape shown;
- AdamW: >= 85% of the copy bandwidth (worst config);
- GPT-1.3B on one GPU: >= 55% MFU (the trainer's run, else the one-device model step).

A target with no matching measurement is shown as "n/a" (not a pass). Benchmarks never fail on time: the exit
status is 0 whatever the results (gpu_check's own status is that of its stages). Imports nothing but the standard
library, so it renders even where the build failed.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

MEMORY_BOUND = (
    "layer_norm",
    "layer_norm_gelu",
    "rms_norm",
    "bias_gelu",
    "scaled_softmax",
    "scaled_masked_softmax",
    "scaled_causal_softmax",
    "cross_entropy",
)
STAGES_FILE = "stages.tsv"


def _payloads(out_dir: str):
    for path in sorted(glob.glob(os.path.join(out_dir, "*.json")) + glob.glob(os.path.join(out_dir, "*", "*.json"))):
        try:
            with open(path) as f:
                payload = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(payload, dict):
            yield payload


def load_static(out_dir: str) -> list[dict]:
    """The kernel rows of every static report (``static.json``: a ``kernels`` list) in ``out_dir``."""
    return [
        k
        for p in _payloads(out_dir)
        for k in p.get("kernels") or []
        if isinstance(k, dict) and isinstance(k.get("bench"), dict) and "predicted_fraction" in k
    ]


def load(out_dir: str) -> tuple[list[dict], list[dict]]:
    """(kernel result rows, e2e entries) from every ``*.json`` in ``out_dir`` and its subfolders (unreadable files
    are skipped)."""
    rows, e2e = [], []
    for payload in _payloads(out_dir):
        for r in payload.get("rows", []):
            if isinstance(r, dict) and "op" in r and "rates" in r:
                rows.append(r)
            elif isinstance(r, dict) and ("trainer" in r or "baseline" in r):
                e2e.append(r)
        e2e += [r for r in payload.get("e2e") or [] if isinstance(r, dict)]
    return rows, e2e


def _case(r: dict) -> str:
    return " ".join(x for x in (r.get("dtype", ""), r.get("shape", ""), r.get("pass", ""), r.get("variant", "")) if x)


def _worst(label: str, candidates: list[tuple[float, str]], target: float, unit: str) -> dict:
    if not candidates:
        return {"target": label, "value": None, "goal": target, "unit": unit, "case": "no measurement"}
    value, case = min(candidates, key=lambda c: c[0])
    return {
        "target": label,
        "value": value,
        "goal": target,
        "unit": unit,
        "case": f"worst of {len(candidates)}: {case}" if len(candidates) > 1 else case,
    }


def evaluate(rows: list[dict], e2e: list[dict]) -> list[dict]:
    """One entry per target group: ``{target, value, goal, unit, case}`` (value None: nothing measured)."""
    out = []
    fa = [
        r
        for r in rows
        if r["op"] == "flash_attention"
        and r.get("dtype") == "bfloat16"
        and r.get("head_dim") == 128
        and r.get("seqlen", 0) >= 4096
        and not r.get("documents")  # the targets are about one sequence; packed documents are their own rows
    ]
    for causal in (False, True):
        mask = "causal" if causal else "full"
        fwd = [(r["rates"]["megakernels"], _case(r)) for r in fa if r["pass"] == "fwd" and r.get("causal") == causal]
        bwd = [
            (r["bwd_TFLOPs"]["megakernels"], _case(r))
            for r in fa
            if r["pass"] == "fwd+bwd" and r.get("causal") == causal and "megakernels" in r.get("bwd_TFLOPs", {})
        ]
        out.append(_worst(f"FlashAttention fwd d128 bf16 s>=4k {mask}", fwd, 550.0, "TFLOP/s"))
        out.append(_worst(f"FlashAttention bwd d128 bf16 s>=4k {mask}", bwd, 420.0, "TFLOP/s"))
    for op in MEMORY_BOUND:
        for pass_ in ("fwd", "fwd+bwd"):
            cands = [
                (r["fraction_of_ceiling"], _case(r))
                for r in rows
                if r["op"] == op
                and r["pass"] == pass_
                and r.get("rows", 0) >= 4096
                and r.get("fraction_of_ceiling") is not None
            ]
            if cands or op != "cross_entropy" or pass_ == "fwd+bwd":  # cross-entropy is measured fwd+bwd only
                out.append(_worst(f"{op} {pass_} rows>=4k, of copy bw", cands, 0.90, "fraction"))
    cands = [
        (r["fraction_of_ceiling"], _case(r))
        for r in rows
        if r["op"] == "adamw" and r.get("fraction_of_ceiling") is not None
    ]
    out.append(_worst("AdamW step, of copy bandwidth", cands, 0.85, "fraction"))
    cands = []
    for e in e2e:
        if e.get("name") != "gpt-1.3b":
            continue
        if e.get("trainer"):
            cands.append(
                (
                    e["trainer"]["mfu"],
                    f"trainer, {e.get('precision', '')} b{e['trainer']['layout']['micro_batch_size']}",
                )
            )
        elif e.get("baseline"):
            cands.append((e["baseline"]["megakernels"]["mfu"], f"one-device step, b{e.get('micro_batch_size')}"))
    out.append(_worst("GPT-1.3B MFU on one GPU", cands, 0.55, "fraction"))
    return out


_PASSES = {"fwd": ["fwd"], "fwd+bwd": ["fwd", "bwd"], "step": ["update"]}
_DTYPE = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float16"}


def predicted(row: dict, static: list[dict]) -> tuple[float, str] | None:
    """What the static model predicted for a measured row: (value, unit) — TFLOP/s for attention (the backward's
    own rate for fwd+bwd rows), else the fraction of the copy bandwidth — or None when it has no prediction.
    Among several configs of one kernel the best is taken (the GPU's autotuner picks the fastest)."""

    def best(pass_: str) -> dict | None:
        hits = [
            k
            for k in static
            if k["bench"].get("op") == row["op"]
            and k["bench"].get("pass") == pass_
            and k["bench"].get("shape") == row.get("shape")
            and k["bench"].get("dtype") == row.get("dtype")
            and k["bench"].get("variant", "") == row.get("variant", "")
            and "error" not in k
        ]
        return max(hits, key=lambda k: k["predicted_fraction"]) if hits else None

    if row["op"] == "flash_attention":
        k = best("bwd" if row["pass"] == "fwd+bwd" else "fwd")
        return (k["predicted_tflops"], "TFLOP/s") if k else None
    if row.get("unit") == "TFLOP/s":  # a GEMM (fp8_gemm): the model's rate for the same pass
        k = best(row["pass"])
        return (k["predicted_tflops"], "TFLOP/s") if k and "predicted_tflops" in k else None
    parts = [best(p) for p in _PASSES.get(row["pass"], [])]
    if not parts or any(k is None for k in parts):
        return None
    moved = sum(k["min_bytes_per_element"] * k["elements"] for k in parts)
    time_s = sum(k["predicted_time_us"] for k in parts) * 1e-6
    copy = 4.3e12
    return moved / time_s / copy, "fraction"


def calibration(rows: list[dict], static: list[dict]) -> list[str]:
    """Lines of the measured-beside-predicted table (rows without a prediction are left out)."""
    out = []
    for r in rows:
        pred = predicted(r, static)
        if pred is None:
            continue
        value, unit = pred
        measured = (
            r.get("bwd_TFLOPs", {}).get("megakernels")
            if r["op"] == "flash_attention" and r["pass"] == "fwd+bwd"
            else (r["rates"]["megakernels"] if unit == "TFLOP/s" else r.get("fraction_of_ceiling"))
        )
        if measured is None:
            continue
        out.append(
            f"{r['op'] + ' ' + _case(r):<64}{_fmt(measured, unit):>14}{_fmt(value, unit):>14}"
            f"{measured / value if value else float('nan'):>12.2f}"
        )
    return out


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    return f"{v:.1%}" if unit == "fraction" else f"{v:.0f} {unit}"


def render(out_dir: str, title: str = "") -> str:
    """The summary text: stage results (from ``OUTDIR/stages.tsv``, ``name<TAB>result`` lines, when present) and
    the targets table with pass/fail and % of target."""
    lines = [title] if title else []
    stages_path = os.path.join(out_dir, STAGES_FILE)
    if os.path.exists(stages_path):
        lines.append(f"{'stage':<22}result")
        with open(stages_path) as f:
            for line in f:
                if line.strip():
                    name, _, result = line.rstrip("\n").partition("\t")
                    lines.append(f"{name:<22}{result}")
        lines.append("")
    rows, e2e = load(out_dir)
    results = evaluate(rows, e2e)
    lines.append("docs/benchmarks.md targets (H200)")
    lines.append(f"{'target':<60}{'measured':>14}{'target':>14}{'% of target':>13}  {'result':<7}case")
    met = measured = 0
    for t in results:
        if t["value"] is None:
            verdict, pct = "n/a", "-"
        else:
            measured += 1
            ok = t["value"] >= t["goal"]
            met += ok
            verdict, pct = ("PASS" if ok else "FAIL"), f"{t['value'] / t['goal']:.0%}"
        lines.append(
            f"{t['target']:<60}{_fmt(t['value'], t['unit']):>14}{_fmt(t['goal'], t['unit']):>14}{pct:>13}"
            f"  {verdict:<7}{t['case']}"
        )
    lines.append(f"{met} of {measured} measured targets met ({len(results) - measured} not measured)")
    static = load_static(out_dir)
    if static:
        table = calibration(rows, static)
        lines.append("")
        lines.append(
            "measured beside the static model's prediction (costmodel/README.md; bandwidth fractions of the "
            "copy ceiling, attention and FP8 GEMMs in TFLOP/s, the backward's own rate for fwd+bwd)"
        )
        lines.append(f"{'kernel':<64}{'measured':>14}{'predicted':>14}{'meas/pred':>12}")
        lines += table or ["(no measurement has a prediction)"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", metavar="OUTDIR", help="the folder gpu_check.sh wrote (its *.json and stages.tsv)")
    p.add_argument("--title", default="", help="a first line (GPU, commit, date)")
    args = p.parse_args(argv)
    if not os.path.isdir(args.out_dir):
        p.error(f"OUTDIR: {args.out_dir!r} is not a directory")
    print(render(args.out_dir, args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
