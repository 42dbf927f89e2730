"""The grouped GEMM's default configs compile for sm_90 as launched (the real Triton compiler and ptxas, no GPU):
no spills, shared memory within 227 KiB, and the 16-bit products on wgmma."""

import json
import os
import subprocess
import sys

import pytest

from megakernels.machines import ARCHS

SHARED_LIMIT_SM90 = ARCHS[90].smem_per_block


@pytest.fixture(scope="module")
def compiled():
    import triton  # noqa: F401  (the cost model compiles with it)

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.costmodel.grouped_gemm_sm90"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert {(r["pass"], r["dtype"]) for r in rows} == {
        (p, d) for p in ("fwd", "dx", "dw") for d in ("bfloat16", "float16", "float32")
    }
    return rows


def test_grouped_gemm_default_configs_do_not_spill(compiled):
    assert [r for r in compiled if r["spill_bytes"]] == []


def test_grouped_gemm_default_configs_fit_sm90_shared_memory(compiled):
    assert [r for r in compiled if r["shared_bytes"] > SHARED_LIMIT_SM90] == []


def test_grouped_gemm_16bit_products_run_on_wgmma(compiled):
    assert [r for r in compiled if r["dtype"] != "float32" and r["mma"] != "wgmma"] == []
