"""The CUDA tests are collected without a GPU, so a broken import or fixture in them fails CI here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cuda_marked_tests_collect_without_errors():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "--collect-only", "-q", "-p",
                           "no:cacheprovider", "tests"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    tail = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    assert "error" not in proc.stdout.lower().splitlines()[-1], tail
    assert " collected" in proc.stdout, tail
