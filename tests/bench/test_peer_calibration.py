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


# ---- side by side: our kernels at the peer's shapes ------------------------------------------------------------

SIDE = os.path.join(HERE, "data", "liger_side.csv")


def test_substitute_puts_our_launches_where_the_peer_function_ran():
    Op = peer.Op
    ops = [
        Op("torch", func="mm"),
        Op("call", func="forward"),
        Op("triton", launch="peer fwd"),
        Op("torch", func="sum"),
        Op("return"),
        Op("torch", func="mm"),
        Op("call", func="backward"),
        Op("triton", launch="peer bwd"),
        Op("return"),
    ]
    out = peer.substitute(ops, {"fwd": ["a"], "bwd": ["b", "c"]})
    assert [(o.kind, o.launch if o.kind == "ours" else o.func) for o in out] == [
        ("torch", "mm"),
        ("call", "forward"),
        ("ours", "a"),
        ("torch", "mm"),
        ("call", "backward"),
        ("ours", "b"),
        ("ours", "c"),
    ]
    with pytest.raises(ValueError, match="bwd"):
        peer.substitute(ops, {"fwd": ["a"]})


def test_side_by_side_ratios_and_summary():
    shape = {"kernel_operation_mode": "forward", "gpu_name": "NVIDIA A100-SXM4-80GB", "x_value": "1024"}
    shape["extra_benchmark_config_str"] = "{}"
    rows = [
        {**shape, "kernel_name": "rms_norm", "kernel_provider": "liger", "published_ms": 0.02, "predicted_ms": 0.02}
        | {"ours_predicted_ms": 0.01, "ours_over_peer": 0.5},
        {**shape, "kernel_name": "rms_norm", "kernel_provider": "huggingface", "published_ms": 0.08},
        {**shape, "kernel_name": "rope", "kernel_provider": "liger", "published_ms": 0.1, "predicted_ms": 0.1}
        | {"ours_predicted_ms": 0.15, "ours_over_peer": 1.5, "ours_bound": "host"},
        {**shape, "kernel_name": "geglu", "kernel_provider": "liger", "published_ms": 9.0, "predicted_ms": 9.0}
        | {"ours_predicted_ms": None, "ours_reason": "megakernels has no GeGLU kernel"},
    ]
    side = peer.side_by_side(rows)
    by = {s["kernel_name"]: s for s in side["shapes"]}
    assert len(by) == 3  # the peer's shapes, not the HuggingFace row
    assert by["rms_norm"]["huggingface_ms"] == 0.08
    assert by["rms_norm"]["ours_over_hf"] == pytest.approx(0.01 / 0.08)
    assert by["rms_norm"]["torch_compile_ms"] is None and "ours_bound" not in by["rms_norm"]
    assert by["rope"]["ours_bound"] == "host" and by["rope"]["ours_over_hf"] is None
    assert by["geglu"]["ours_over_peer"] is None and "GeGLU" in by["geglu"]["reason"]
    sm = side["summary"]
    assert (sm["compared"], sm["ahead"], sm["behind"]) == (2, 1, 1)
    assert sm["worst"]["kernel_name"] == "rope" and sm["behind_by_bound"] == {"host": 1}
    lines = peer.side_by_side_table(side)
    assert any(line.startswith("rope") and "host" in line for line in lines)
    assert any("not compared" in line and "GeGLU" in line for line in lines)


def test_side_by_side_end_to_end(tmp_path):
    path = _peer_path()
    from megakernels.bench.__main__ import main

    args = ["--static", "--peer-csv", SIDE, "--out", str(tmp_path)] + (["--peer-path", path] if path else [])
    assert main(args) == 0
    payload = json.loads((tmp_path / "calibration.json").read_text())
    rows = {(r["kernel_name"], r["kernel_provider"]): r for r in payload["rows"]}
    rms = rows[("rms_norm", "liger")]
    assert rms["ours_predicted_ms"] > 0 and rms["predicted_ms"] > 0
    assert rms["ours_over_peer"] == pytest.approx(rms["ours_predicted_ms"] / rms["predicted_ms"])
    ours = [q["kernel"] for q in rms["ours_launches"] if q.get("ours")]
    assert any("norm_fwd_rows_kernel" in k for k in ours) and any("norm_bwd_rows_kernel" in k for k in ours)
    assert (rms["ours_over_peer"] > 1) == ("ours_bound" in rms)
    geglu = rows[("geglu", "liger")]
    assert geglu["predicted_ms"] > 0  # the peer is still modelled
    assert geglu["ours_predicted_ms"] is None and "no GeGLU kernel" in geglu["ours_reason"]
    side = {s["kernel_name"]: s for s in payload["side_by_side"]["shapes"]}
    assert side["rms_norm"]["ours_over_hf"] == pytest.approx(
        rms["ours_predicted_ms"] / rows[("rms_norm", "huggingface")]["published_ms"]
    )


def test_our_launch_plans_take_the_machine():
    from megakernels.bench.static import elementwise, model, streaming

    a100, h200 = model.MACHINES["A100-SXM4-80GB"], model.H200
    # a grid capped at resident blocks per SM scales with the SM count
    assert (
        streaming.rows_plan(1 << 20, 1024, 8, 4, 0, a100.sms, a100.smem)[2]
        < streaming.rows_plan(1 << 20, 1024, 8, 4, 0)[2]
    )
    assert elementwise._rope_parts("bf16", 16384, 32, 8, 128, a100)[0].grid == a100.sms * 8
    assert elementwise._rope_parts("bf16", 16384, 32, 8, 128, h200)[0].grid == h200.sms * 8


TTIR = """
module {
  tt.func public @k(%X_ptr: !tt.ptr<f32>, %L_ptr: !tt.ptr<f32>, %n_cols: i32) {
    %c0_i32 = arith.constant 0 : i32
    %c1024_i32 = arith.constant 1024 : i32
    %y = tt.load %L_ptr : !tt.ptr<f32>
    scf.for %i = %c0_i32 to %n_cols step %c1024_i32  : i32 {
      %a = tt.load %p, %m : tensor<1024x!tt.ptr<f32>>
      scf.for %j = %c0_i32 to %n_cols step %c1024_i32  : i32 {
        %b = tt.load %q : tensor<8x128x!tt.ptr<bf16>>
      }
      tt.store %p, %a, %m : tensor<1024x!tt.ptr<f32>>
    }
    tt.store %L_ptr, %y : !tt.ptr<f32>
    tt.return
  }
}
"""


def test_ir_loops_know_the_bytes_of_their_own_tiles():
    ir = peer.IR(TTIR, {"X_ptr": None, "L_ptr": None, "n_cols": 4096})
    assert ir.trips() == [(4, 2), (4, 3)]
    # the outer loop loads and stores a 1024-float tile (its inner loop's 8x128 bf16 tile is the inner loop's);
    # the scalar load and store outside the loops belong to no loop
    assert ir.loop_bytes == [2 * 1024 * 4, 8 * 128 * 2]
    assert peer._access_bytes("tt.store %L_ptr, %y : !tt.ptr<f32>") == 4
