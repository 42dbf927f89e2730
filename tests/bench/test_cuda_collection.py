"""The CUDA tests are collected without a GPU, so a broken import or fixture in them fails CI here (on a GPU
machine, scripts/gpu_check.sh runs them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Collects `-m cuda` in a fresh interpreter and prints what pytest itself reports: collected node ids and the
# collection errors (a module that fails to import, a missing fixture module, ...).
_COLLECT = r"""
import json, sys
import pytest

class Report:
    items, errors = [], []
    def pytest_collection_modifyitems(self, items):
        self.items = [i.nodeid for i in items]
    def pytest_collectreport(self, report):
        if report.failed:
            self.errors.append([report.nodeid, str(report.longrepr)[-2000:]])

r = Report()
code = pytest.main(["-m", "cuda", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"], plugins=[r])
print("@@" + json.dumps({"code": int(code), "items": r.items, "errors": r.errors}))
"""

# Tests that exist only for a GPU, one per family that has them: each must be among the collected cuda tests.
KNOWN = [
    "tests/optim/test_fused_adamw.py::test_loss_scaled_step_and_grad_norm_do_not_synchronize_the_gpu",
    "tests/ops/test_norms.py::",
    "tests/ops/test_softmax.py::",
]


def test_cuda_marked_tests_collect_without_errors():
    proc = subprocess.run([sys.executable, "-c", _COLLECT], cwd=ROOT, capture_output=True, text=True, timeout=600)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("@@")), None)
    assert line is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads(line[2:])
    assert rep["errors"] == [], rep["errors"]
    assert rep["code"] == 0, rep
    missing = [k for k in KNOWN if not any(i.startswith(k) for i in rep["items"])]
    assert not missing, f"cuda tests not collected: {missing}"
