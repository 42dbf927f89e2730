"""``megakernels bench --measure-peers FILE``: our kernels (and the peer's, on CUDA) timed at a
Liger-format CSV's shapes, written back in that format; the timer counts exactly the regions a driver records."""

from __future__ import annotations

import csv
import json

import pytest

from costmodel.peers import measure as peer_measure
from costmodel.peers import table


def _row(kernel, mode, x, cfg):
    return {
        "kernel_name": kernel,
        "kernel_provider": "liger",
        "kernel_operation_mode": mode,
        "metric_name": "speed",
        "metric_unit": "ms",
        "x_name": "x",
        "x_label": "x",
        "x_value": str(x),
        "y_value_50": "1.0",
        "y_value_20": "1.0",
        "y_value_80": "1.0",
        "extra_benchmark_config_str": json.dumps(cfg),
        "gpu_name": "NVIDIA H100 80GB HBM3",
        "timestamp": "2025-01-01 00:00:00",
        "liger_version": "0.5.0",
    }


ROWS = [
    _row("rms_norm", "full", 64, {"M": 32, "dtype": "torch.float32", "eps": 1e-6}),
    _row("layer_norm", "backward", 64, {"M": 32, "dtype": "torch.float32"}),
    _row("cross_entropy", "full", 128, {"B": 2, "T": 8}),
    _row("rope", "forward", 64, {"dtype": "torch.float32", "seq_len": 16, "num_q_heads": 4, "num_kv_heads": 2}),
    _row("swiglu", "full", 8, {"B": 2, "hidden_size": 32, "dtype": "torch.float32", "intermediate_size": 48}),
    _row("geglu", "forward", 8, {"B": 2, "hidden_size": 32, "dtype": "torch.float32", "intermediate_size": 48}),
]


@pytest.fixture
def tiny_csv(tmp_path):
    path = tmp_path / "liger.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(peer_measure.COLUMNS))
        w.writeheader()
        w.writerows(ROWS + [dict(ROWS[0], kernel_provider="huggingface"), ROWS[0]])  # others and a repeat
    return str(path)


def test_ours_are_timed_at_every_peer_shape_and_written_in_the_peers_format(tiny_csv, tmp_path):
    res = peer_measure.measure(tiny_csv, "cpu", repeats=3, warmup=1, log=None)
    got = [(r["kernel_name"], r["kernel_operation_mode"], r["kernel_provider"]) for r in res["rows"]]
    assert got == [(r["kernel_name"], r["kernel_operation_mode"], "megakernels") for r in ROWS[:5]]  # no GeGLU of ours
    assert any("only our kernels" in n for n in res["notes"])
    for r in res["rows"]:
        assert 0 < r["y_value_20"] <= r["y_value_50"] <= r["y_value_80"]
        assert r["gpu_name"].startswith("cpu") and r["metric_unit"] == "ms"
    out = tmp_path / "measured.csv"
    peer_measure.write_csv(str(out), res["rows"])
    back = table.read_csv(str(out))  # the static model's reader takes it
    assert [r["extra_benchmark_config_str"] for r in back] == [r["extra_benchmark_config_str"] for r in ROWS[:5]]
    assert next(csv.reader(open(out))) == list(peer_measure.COLUMNS)


def test_the_timer_counts_only_the_recorded_regions(monkeypatch):
    clock = iter([0.0, 1.5, 10.0, 12.25])
    monkeypatch.setattr(peer_measure.time, "perf_counter", lambda: next(clock))
    t = peer_measure.Timer("cpu")
    with t.recording(True):
        pass
    with t.recording(False):  # setup for a backward: not timed, reads no clock
        pass
    with t.recording(True):
        pass
    assert t.elapsed_s == pytest.approx(1.5 + 2.25)


def test_the_command_measures_and_refuses_what_is_not_a_peer_csv(tiny_csv, tmp_path, capsys):
    from megakernels_models.cli import main

    assert main(["bench", "--measure-peers", tiny_csv, "--quick", "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "measured.csv").exists()
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    assert main(["bench", "--measure-peers", str(bad)]) == 2
    assert "not a Liger-Kernel benchmark CSV" in capsys.readouterr().err
    assert main(["bench", "--peer-csv", tiny_csv]) == 2  # predicting needs --static; measuring is its own flag
    assert "--measure-peers" in capsys.readouterr().err
