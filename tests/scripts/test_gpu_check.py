"""scripts/gpu_check.sh, the parts that run without a GPU: argument handling, the no-GPU refusal and the summary
rendered from a recorded OUTDIR (``--summary-only``)."""

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
