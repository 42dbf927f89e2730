"""``megakernels bench --static --peer-csv``: the CSV reader, row selection, the error summary, and the command end
to end on three rows of Liger-Kernel's published data (needs liger-kernel 0.2.1 installed where
``MEGAKERNELS_PEER_PATH`` or the default peer directory points; skipped, not passed, without it)."""

from __future__ import annotations

import json
import os

import pytest

from megakernels.bench.static import peer

HERE = os.path.dirname(__file__)
TINY = os.path.join(HERE, "data", "liger_tiny.csv")


def test_reader_keeps_the_published_columns():
    rows = peer.read_csv(TINY)
    assert len(rows) == 3
    assert {r["kernel_provider"] for r in rows} == {"liger", "huggingface"}
    assert all(set(peer.FIELDS) <= set(r) for r in rows)
    assert rows[0]["gpu_name"] == "NVIDIA A100-SXM4-80GB" and rows[0]["liger_version"] == "0.2.1"


def test_reader_rejects_another_format(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="kernel_name"):
        peer.read_csv(str(p))


def test_select_by_kernel_gpu_provider_and_metric():
    rows = [
        {
            "kernel_name": "rms_norm",
            "metric_name": "speed",
            "gpu_name": "NVIDIA H100 80GB HBM3",
            "kernel_provider": "liger",
        },
        {
            "kernel_name": "rms_norm",
            "metric_name": "memory",
            "gpu_name": "NVIDIA H100 80GB HBM3",
            "kernel_provider": "liger",
        },
        {
            "kernel_name": "rope",
            "metric_name": "speed",
            "gpu_name": "NVIDIA A100-SXM4-80GB",
            "kernel_provider": "huggingface",
        },
    ]
    assert peer.select(rows) == [rows[0], rows[2]]
    assert peer.select(rows, kernels=["rope"]) == [rows[2]]
    assert peer.select(rows, gpus=["H100"]) == [rows[0]]
    assert peer.select(rows, providers=["liger"]) == [rows[0]]


def test_summary_against_a_hand_computation():
    errs = [0.1, -0.2, 0.05, -0.4, 0.3]
    rows = [{"gpu_name": "A" if i < 3 else "B", "rel_error": e} for i, e in enumerate(errs)]
    rows.append({"gpu_name": "B", "rel_error": None, "reason": "x"})
    s = peer.summarise(rows)
    # |e| sorted: 0.05 0.1 0.2 0.3 0.4 -> median 0.2; p90 at position 0.9 * 4 = 3.6: 0.3 + 0.6 * 0.1 = 0.36
    assert s["overall"]["rows"] == 5
    assert s["overall"]["median_abs_rel_error"] == pytest.approx(0.2)
    assert s["overall"]["p90_abs_rel_error"] == pytest.approx(0.36)
    # GPU A: 0.05 0.1 0.2 -> median 0.1, p90 at 1.8: 0.1 + 0.8 * 0.1 = 0.18; GPU B: 0.3 0.4 -> 0.35, 0.39
    assert s["per_gpu"]["A"]["median_abs_rel_error"] == pytest.approx(0.1)
    assert s["per_gpu"]["A"]["p90_abs_rel_error"] == pytest.approx(0.18)
    assert s["per_gpu"]["B"]["median_abs_rel_error"] == pytest.approx(0.35)
    assert s["per_gpu"]["B"]["p90_abs_rel_error"] == pytest.approx(0.39)
    assert s["not_modelled"] == 1


def test_a_missing_version_is_a_reason_with_the_install_command(tmp_path):
    row = dict(peer.read_csv(TINY)[0], liger_version="0.0.0")
    p = peer.predict_row(row, str(tmp_path), {})
    assert p["predicted_ms"] is None
    assert "pip install --no-deps --target" in p["reason"] and "liger-kernel==0.0.0" in p["reason"]


def _peer_path() -> str:
    path = os.environ.get("MEGAKERNELS_PEER_PATH")
    if peer.peer_dir("0.2.1", path) is None:
        pytest.skip(peer.install_hint("0.2.1", path) + " (or set MEGAKERNELS_PEER_PATH)")
    pytest.importorskip("triton")
    return path


def test_the_command_end_to_end(tmp_path):
    path = _peer_path()
    from megakernels.bench.__main__ import main

    args = ["--static", "--peer-csv", TINY, "--out", str(tmp_path)] + (["--peer-path", path] if path else [])
    assert main(args) == 0
    payload = json.loads((tmp_path / "calibration.json").read_text())
    rows = payload["rows"]
    assert len(rows) == 3
    hf = [r for r in rows if r["kernel_provider"] == "huggingface"]
    assert hf[0]["predicted_ms"] is None and "provider" in hf[0]["reason"]
    done = [r for r in rows if r["rel_error"] is not None]
    assert len(done) == 2
    for r in done:
        assert r["predicted_ms"] > 0
        assert r["rel_error"] == pytest.approx((r["predicted_ms"] - r["published_ms"]) / r["published_ms"])
        assert {
            "kernel_name",
            "kernel_provider",
            "kernel_operation_mode",
            "gpu_name",
            "x_value",
            "extra_benchmark_config_str",
            "liger_version",
            "published_ms",
        } <= set(r)
    swiglu = next(r for r in done if r["kernel_name"] == "swiglu")
    kinds = [q["kernel"] for q in swiglu["launches"]]
    assert "_swiglu_forward_kernel" in kinds and kinds.count("aten.mm") == 3  # the MLP's three projections
    assert payload["summary"]["overall"]["rows"] == 2
