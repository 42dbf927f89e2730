"""scripts/gpu_check.sh, the parts that run without a GPU: argument handling, the no-GPU refusal, the summary
rendered from a recorded OUTDIR (``--summary-only``), and the FP8 GEMM stage's command and its summary lines."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
RECORDED = ROOT / "tests" / "bench" / "data" / "gpu_check"


def run(*args, **env):
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable, **env},
    )


def test_usage_error_without_outdir():
    proc = run()
    assert proc.returncode == 2 and "usage: scripts/gpu_check.sh [--summary-only] OUTDIR" in proc.stderr


@pytest.mark.parametrize("args", [["a", "b"], ["--summary"], ["--summary-only"], ["--bogus", "out"]])
def test_usage_error_for_other_arguments(args):
    assert run(*args).returncode == 2


def test_summary_only_renders_a_recorded_outdir(tmp_path):
    out = tmp_path / "out"
    shutil.copytree(RECORDED, out)
    proc = run("--summary-only", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"gpu_check summary of {out}\nstage")
    assert "FlashAttention fwd d128 bf16 s>=4k full" in proc.stdout and "PASS" in proc.stdout
    assert "FAIL (rc 1, see bench_softmax.txt)" in proc.stdout
    assert (out / "summary.txt").read_text() == proc.stdout


def test_summary_only_needs_an_existing_folder(tmp_path):
    proc = run("--summary-only", str(tmp_path / "missing"))
    assert proc.returncode == 2 and "is not a directory" in proc.stderr


def test_refuses_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = run(str(tmp_path / "out"))
    assert proc.returncode == 1 and "torch sees no CUDA device" in proc.stderr


def test_fp8_stage_times_both_recipes_on_the_gpu():
    text = SCRIPT.read_text()
    stages = text[text.index("STAGES=(") : text.index(")", text.index("STAGES=("))].split()
    assert "bench_fp8" in stages
    line = next(ln for ln in text.splitlines() if "stage bench_fp8 " in ln)
    assert '--ops fp8_gemm --device cuda --out "$OUT/fp8"' in line


def test_summary_shows_the_fp8_gemm_beside_its_prediction(tmp_path):
    """A recorded OUTDIR with the FP8 stage: its rows (``megakernels bench --ops fp8_gemm``'s JSON) are printed
    beside the static report's prediction of the same GEMM (``megakernels bench --static``'s ``bench`` links)."""
    import json

    out = tmp_path / "out"
    shutil.copytree(RECORDED, out)
    with open(out / "stages.tsv", "a") as f:
        f.write("bench_fp8\tok 41s\n")
    key = {"op": "fp8_gemm", "pass": "fwd", "shape": "8192x14336x4096", "dtype": "e4m3", "variant": "blockwise"}
    row = {**key, "unit": "TFLOP/s", "rates": {"megakernels": 1100.0, "matmul_bf16": 700.0}, "times_ms": {}}
    (out / "fp8").mkdir()
    (out / "fp8" / "bench.json").write_text(json.dumps({"rows": [row]}))
    static = json.loads((out / "static" / "static.json").read_text())
    static["kernels"].append({"bench": key, "predicted_fraction": 0.55, "predicted_tflops": 1085.0})
    (out / "static" / "static.json").write_text(json.dumps(static))
    proc = run("--summary-only", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "bench_fp8             ok 41s" in proc.stdout
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("fp8_gemm e4m3 8192x14336x4096"))
    assert line.split()[-5:] == ["1100", "TFLOP/s", "1085", "TFLOP/s", "1.01"]
