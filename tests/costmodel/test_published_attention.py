"""``python -m costmodel.published``: the published-attention CSV reader and our predictions beside
the published throughputs (the FlashAttention-3 paper's H100 figures and the FlashAttention-2 paper's A100 ones,
benchmarks/published)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from costmodel import model, published

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
CSV = os.path.join(ROOT, "benchmarks", "published", "flash_attention_fa3_h100.csv")
CSV_A100 = os.path.join(ROOT, "benchmarks", "published", "flash_attention_fa2_a100.csv")


def test_the_shipped_csv_reads_with_its_source():
    rows = published.read(CSV)
    assert len(rows) == 55
    assert {r["implementation"] for r in rows} == {"FlashAttention-2", "FlashAttention-3", "Triton", "cuDNN"}
    for r in rows:
        assert int(r["batch"]) * int(r["seqlen"]) == 16384 and int(r["heads"]) * int(r["head_dim"]) == 2048
        assert "2407.08608" in r["source"] and float(r["published_tflops"]) > 0


def test_the_a100_csv_reads_with_its_source():
    rows = published.read(CSV_A100)
    assert len(rows) == 113
    assert {r["implementation"] for r in rows} == {
        "FlashAttention-2",
        "FlashAttention",
        "FlashAttention Triton",
        "xformers",
        "Pytorch",
    }
    assert {(r["gpu"], r["pass"]) for r in rows} == {("NVIDIA A100-SXM4-80GB", "fwd_bwd")}
    for r in rows:
        assert int(r["batch"]) * int(r["seqlen"]) == 16384 and int(r["heads"]) * int(r["head_dim"]) == 2048
        assert "2307.08691" in r["source"] and float(r["published_tflops"]) > 0
    bars = {(r["implementation"], int(r["head_dim"]), int(r["seqlen"]), int(r["causal"])): r for r in rows}
    assert float(bars["FlashAttention-2", 128, 16384, 0]["published_tflops"]) == 203  # the figure's tallest bar
    assert float(bars["Pytorch", 64, 512, 1]["published_tflops"]) == 15


def test_a_missing_column_is_named(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text("gpu,pass,head_dim\nNVIDIA H100 80GB HBM3,fwd,128\n")
    with pytest.raises(ValueError, match="seqlen"):
        published.read(str(p))


def _run_command(tmp_path, rows: str) -> tuple[str, list[dict]]:
    """The command on a CSV of ``rows`` (after the header), in a process of its own (this one imported Triton in
    interpreter mode: tests/conftest.py): its stdout and the JSON's shapes."""
    import triton  # noqa: F401  (the cost model compiles with it)

    from costmodel import compiled, sass

    if compiled.nvcc() is None or sass.find_tool("cuobjdump") is None:
        pytest.skip("static analysis needs nvcc and cuobjdump")
    p = tmp_path / "rows.csv"
    p.write_text("gpu,pass,head_dim,seqlen,batch,heads,causal,implementation,published_tflops\n" + rows)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "costmodel.published", "--csv", str(p), "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads((tmp_path / "attention_published.json").read_text())["shapes"]


def test_ours_beside_each_published_implementation(tmp_path):
    stdout, (row,) = _run_command(
        tmp_path,
        "NVIDIA H100 80GB HBM3,fwd,128,4096,4,16,0,FlashAttention-3,638\n"
        "NVIDIA H100 80GB HBM3,fwd,128,4096,4,16,0,Triton,389\n",
    )
    assert "FlashAttention-3" in stdout.splitlines()[0] and "Triton" in stdout.splitlines()[0]
    ours = row["ours"]["predicted_tflops"]
    m = model.machine_for("NVIDIA H100 80GB HBM3")
    assert 0 < ours < m.mma_dense_bf16 / 1e12
    assert row["ours"]["predicted_fraction"] == pytest.approx(ours * 1e12 / m.mma_dense_bf16)
    assert row["ours_over"] == pytest.approx({"FlashAttention-3": ours / 638, "Triton": ours / 389})
    assert row["ours"]["spill_bytes"] == 0 and row["ours"]["mma"] == "wgmma"
    assert published.table([row])[1].split()[:4] == ["fwd", "128", "4096", "full"]


def test_a100_forward_plus_backward_is_compiled_for_sm80(tmp_path):
    """An A100 row is predicted with the sm_80 default configs compiled for sm_80 (mma.sync, no TMA), and a
    ``fwd_bwd`` row is 3.5 forward FLOPs over the forward's time plus the backward's (2.5 forward FLOPs)."""
    _, shapes = _run_command(
        tmp_path,
        "".join(
            f"NVIDIA A100-SXM4-80GB,{ps},128,4096,4,16,1,FlashAttention-2,{v}\n"
            for ps, v in (("fwd", 190), ("bwd", 160), ("fwd_bwd", 173))
        ),
    )
    rows = {r["pass"]: r["ours"] for r in shapes}
    assert {r["mma"] for r in rows.values()} == {"mma.sync"}
    m = model.machine_for("NVIDIA A100-SXM4-80GB")
    fwd, bwd, both = (rows[k]["predicted_tflops"] for k in ("fwd", "bwd", "fwd_bwd"))
    assert both == pytest.approx(3.5 / (1 / fwd + 2.5 / bwd))
    assert rows["fwd_bwd"]["predicted_fraction"] == pytest.approx(both * 1e12 / m.mma_dense_bf16)
    assert 0 < both < m.mma_dense_bf16 / 1e12
