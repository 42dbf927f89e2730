"""gpu_check's closing table, rendered from a small recorded OUTDIR (tests/bench/data/gpu_check: hand-made JSON in
the format the benchmarks write, with numbers on both sides of each target)."""

from __future__ import annotations

import shutil
from pathlib import Path

from benchmarks import gpu_summary as summary

DATA = Path(__file__).parent / "data" / "gpu_check"


def line_of(text: str, target: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(target))


def test_targets_pass_and_fail_with_their_percentage():
    text = summary.render(str(DATA))
    fwd = line_of(text, "FlashAttention fwd d128 bf16 s>=4k full")
    assert "600 TFLOP/s" in fwd and "550 TFLOP/s" in fwd and "109%" in fwd and "PASS" in fwd
    causal = line_of(text, "FlashAttention bwd d128 bf16 s>=4k causal")
    assert "400 TFLOP/s" in causal and "95%" in causal and "FAIL" in causal
    assert "FAIL" in line_of(text, "layer_norm fwd+bwd rows>=4k") and "88.0%" in line_of(text, "layer_norm fwd+bwd")
    assert "PASS" in line_of(text, "AdamW step") and "87.0%" in line_of(text, "AdamW step")
    assert "PASS" in line_of(text, "GPT-1.3B MFU") and "56.8%" in line_of(text, "GPT-1.3B MFU")


def test_short_rows_below_the_threshold_are_left_out():
    text = summary.render(str(DATA))
    # the s=1024 attention rows and the 1024-row rms_norm row are slow but outside the targets' range
    assert "worst of 2" in line_of(text, "FlashAttention fwd d128 bf16 s>=4k full")
    assert "95.0%" in line_of(text, "rms_norm fwd rows>=4k")


def test_missing_measurements_are_not_passes():
    text = summary.render(str(DATA))
    assert "n/a" in line_of(text, "scaled_softmax fwd rows>=4k")
    assert line_of(text, "7 of 10 measured targets met") == "7 of 10 measured targets met (11 not measured)"


def test_stage_results_come_first_under_the_title():
    lines = summary.render(str(DATA), "gpu_check on a fixture").splitlines()
    assert lines[0] == "gpu_check on a fixture"
    assert lines[1].startswith("stage") and "FAIL (rc 1, see bench_softmax.txt)" in lines[5]


def test_an_empty_folder_renders_every_target_as_not_measured(tmp_path):
    text = summary.render(str(tmp_path))
    assert "PASS" not in text and "FAIL" not in text
    assert text.splitlines()[-1].startswith("0 of 0 measured targets met")


def test_unreadable_json_is_skipped(tmp_path):
    shutil.copy(DATA / "adamw.json", tmp_path)
    (tmp_path / "broken.json").write_text("{not json")
    assert "PASS" in line_of(summary.render(str(tmp_path)), "AdamW step")


def test_command_line_prints_the_table(capsys):
    assert summary.main([str(DATA), "--title", "T"]) == 0
    assert capsys.readouterr().out.startswith("T\nstage")


def test_measurements_are_shown_beside_the_static_prediction():
    text = summary.render(str(DATA))
    assert "measured beside the static model's prediction" in text
    # two configs predicted for this kernel: the better one (600) is what an autotuned launch gets
    fwd = line_of(text, "flash_attention bfloat16 4x16x4096x128 fwd d128 full")
    assert fwd.split()[-5:] == ["600", "TFLOP/s", "600", "TFLOP/s", "1.00"]
    bwd = line_of(text, "flash_attention bfloat16 4x16x4096x128 fwd+bwd d128 full")
    assert bwd.split()[-5:] == ["450", "TFLOP/s", "450", "TFLOP/s", "1.00"]
    # fwd alone: 4 B x 2^25 in 40 us = 78.0% of 4.3 TB/s; fwd+bwd: 10 B x 2^25 in 40 + 60 us = 78.0%
    assert line_of(text, "layer_norm bfloat16 32768x1024 fwd ").split()[-3:] == ["93.0%", "78.0%", "1.19"]
    assert line_of(text, "layer_norm bfloat16 32768x1024 fwd+bwd").split()[-3:] == ["88.0%", "78.0%", "1.13"]


def test_rows_without_a_prediction_are_left_out_of_the_calibration():
    text = summary.render(str(DATA))
    calib = text[text.index("measured beside") :]
    assert "rms_norm" not in calib and "adamw" not in calib


def test_fp8_gemm_rows_are_shown_beside_their_predicted_rate():
    row = {"op": "fp8_gemm", "pass": "fwd", "shape": "8192x14336x4096", "dtype": "e4m3", "variant": "blockwise"}
    row.update(unit="TFLOP/s", rates={"megakernels": 900.0})
    bench = {k: row[k] for k in ("op", "pass", "shape", "dtype", "variant")}
    static = [
        {"bench": bench, "predicted_tflops": 1000.0, "predicted_fraction": 0.5},
        {"bench": bench, "predicted_tflops": 800.0, "predicted_fraction": 0.4},  # a slower config
        {"bench": {**bench, "variant": "tensorwise"}, "predicted_tflops": 1200.0, "predicted_fraction": 0.6},
    ]
    assert summary.predicted(row, static) == (1000.0, "TFLOP/s")
    assert summary.calibration([row], static)[0].split()[-5:] == ["900", "TFLOP/s", "1000", "TFLOP/s", "0.90"]
    assert summary.predicted({**row, "shape": "1x2x3"}, static) is None
