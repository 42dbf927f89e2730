"""The shipped GPU kernel configs, compiled for sm_90 exactly as a launch gets them (``megakernels bench --static``
on the key configs): none spills, each fits the 227 KiB of shared memory a block may use, and every sm_90
attention kernel runs on wgmma. Predictions are reported by the report, never asserted here.

Needs nvcc (the CUDA families), Triton's compiler and ptxas, and cuobjdump; no GPU. The compiles run once per
session in a subprocess (this process imported Triton in interpreter mode), in parallel, cached on disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from costmodel import compiled, model, sass

SCRIPT = """
import json, os, sys
from costmodel import report
rows = report.run(report.select(key_only=True), jobs=os.cpu_count() or 1, log=lambda line: None)
with open(sys.argv[1], "w") as f:
    json.dump(rows, f)
"""


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


@pytest.fixture(scope="session")
def key_rows(tmp_path_factory) -> list[dict]:
    import triton  # noqa: F401  (the cost model compiles with it)

    if compiled.nvcc() is None or sass.find_tool("cuobjdump") is None:
        pytest.skip("static analysis needs nvcc and cuobjdump")
    out = tmp_path_factory.mktemp("static") / "rows.json"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(out)], env=_env(), capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _launches(row: dict) -> list[dict]:
    return row.get("launches") or [row]


def _what(row: dict, launch: dict) -> str:
    return f"{row['name']} {row['config']} {row['shape']} {row['dtype']} ({launch.get('kernel', '')[:80]})"


def test_every_key_config_is_analysed(key_rows):
    assert key_rows
    failed = [f"{r['name']} {r['config']} {r['shape']} {r['dtype']}: {r['error']}" for r in key_rows if "error" in r]
    assert not failed, "\n".join(failed)


def test_no_shipped_config_spills(key_rows):
    spills = [
        f"{_what(r, ln)}: {ln['spill_bytes']} B"
        for r in key_rows
        if "error" not in r
        for ln in _launches(r)
        if ln["spill_bytes"]
    ]
    assert not spills, "\n".join(spills)


def test_every_shipped_config_fits_the_shared_memory_of_a_block(key_rows):
    limit = model.H200.smem_per_block
    over = [
        f"{_what(r, ln)}: {ln['shared_bytes']} B"
        for r in key_rows
        if "error" not in r
        for ln in _launches(r)
        if ln["shared_bytes"] > limit
    ]
    assert not over, "\n".join(over)


def test_sm90_attention_kernels_run_on_wgmma(key_rows):
    rows = [r for r in key_rows if r.get("needs_wgmma") and "error" not in r]
    assert rows
    not_wgmma = [
        f"{_what(r, ln)}: {ln['mma']}"
        for r in rows
        for ln in _launches(r)
        if ln["mma"] != "wgmma" and ln.get("per_iteration")
    ]
    assert not not_wgmma, "\n".join(not_wgmma)


def test_static_report_writes_the_documented_json(tmp_path, key_rows):
    proc = subprocess.run(
        [sys.executable, "-m", "megakernels_models.cli", "bench", "--static", "--ops", "adamw", "--out", str(tmp_path)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "adamw.update" in proc.stdout and "pred" in proc.stdout
    data = json.loads((tmp_path / "static.json").read_text())
    assert data["machine"]["sms"] == 132 and data["kernels"]
    for row in data["kernels"]:
        for field in (
            "name",
            "config",
            "shape",
            "dtype",
            "arch",
            "registers",
            "spill_bytes",
            "shared_bytes",
            "mma",
            "tma",
            "instructions_per_element",
            "predicted_fraction",
        ):
            assert field in row, field
        assert row["arch"] == "sm_90" and 0 < row["predicted_fraction"] <= 1


def test_attention_forward_shared_memory_traffic_matches_its_tiles(key_rows):
    """Shared-memory bytes of a forward iteration, read from the SASS, against the tile shapes: every 64-row query
    tile's wgmmas read the K and the V tile at least once, and TMA writes both; the d128 default (128 queries x 32
    keys, two warpgroups) reads Q too (QK^T takes its A operand from shared memory, PV takes P from registers)."""
    rows = [r for r in key_rows if r["name"] == "flash_attention.fwd" and "error" not in r]
    assert rows
    for r in rows:
        (bm, bn), d = map(int, r["config"].split()[0].split("x")), int(r["shape"].split(" d")[1].split()[0])
        tiles, kv = bm // 64, bn * d * 2
        it = r["launches"][0]["per_iteration"]["full"]
        assert it["shared_bytes"] >= tiles * 2 * kv + (2 * kv if r["tma"] else 0), (r["config"], r["shape"])
        if (r["config"], d) == ("128x32 w8 s4", 128):
            assert it["shared_bytes"] == tiles * (64 * d * 2 + kv) + tiles * kv + 2 * kv
