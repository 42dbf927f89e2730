"""scripts/gpu_check.sh, the parts that run without a GPU: argument handling and the no-GPU refusal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


def run(*args, **env):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable, **env})


def test_usage_error_without_outdir():
    proc = run()
    assert proc.returncode == 2 and "usage: scripts/gpu_check.sh OUTDIR" in proc.stderr


def test_refuses_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = run(str(tmp_path / "out"))
    assert proc.returncode == 1 and "torch sees no CUDA device" in proc.stderr
