"""``megakernels bench --e2e``: the trainer measured on a layout (tokens/s, TFLOP/s, MFU, peak memory, the time
split) beside the one-device eager-GPT baseline; and the trainer's optional step timers."""

from __future__ import annotations

import json
import time

import pytest
import torch

from megakernels_models.cli import main
from megakernels_models.training.timers import FIELDS, PHASES, StepTimers


def test_quick_e2e_reports_the_trainer_and_the_baseline(tmp_path, capsys):
    assert main(["bench", "--e2e", "gpt-tiny", "--quick", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "megakernels train" in printed and "eager GPT (PyTorch)" in printed and "trainer step split" in printed
    (entry,) = json.loads((tmp_path / "bench.json").read_text())["e2e"]
    t = entry["trainer"]
    assert t["steps"] == 2 and t["tokens_per_s"] > 0 and t["tflops_per_device"] > 0 and 0 < t["mfu"]
    assert set(t["time_split_s"]) == set(PHASES) and t["time_split_s"]["forward"] > 0
    assert sum(t["time_split_s"].values()) == pytest.approx(t["time_split_per_rank_s"][0]["total"], rel=1e-6)
    assert len(t["peak_memory_bytes_per_rank"]) == 1 and t["peak_memory_bytes_per_rank"][0] > 0
    assert t["layout"]["microbatches"] == 1 and t["schedule_bubble_fraction"] == 0.0
    base = entry["baseline"]
    assert base["eager"]["tokens_per_s"] > 0 and base["speedup"] > 0


def test_pipeline_layout_measures_the_bubble_on_every_rank(capsys):
    assert main(["bench", "--e2e", "gpt-tiny", "--quick", "--pp", "2", "--no-baseline"]) == 0
    out = capsys.readouterr().out
    assert "tp1 pp2 dp1, b2x4" in out and "peak memory per rank" in out
    assert "ideal bubble fraction 0.250" in out


def test_e2e_json_has_one_entry_per_rank(tmp_path):
    from argparse import Namespace

    from megakernels_models.bench import e2e

    ns = Namespace(
        e2e="gpt-tiny",
        device="cpu",
        quick=True,
        precision=None,
        tp=1,
        pp=2,
        vpp=None,
        dp=None,
        nproc=None,
        micro_batch_size=None,
        global_batch_size=None,
        steps=2,
        warmup=1,
        sequence_parallel=False,
        distributed_optimizer=False,
        recompute="none",
        schedule="1f1b",
        attention="flash",
        peak_tflops=1.0,
        no_baseline=True,
        no_trainer=False,
    )
    (entry,) = e2e.run(ns, log=lambda s: None)
    t = entry["trainer"]
    assert len(t["time_split_per_rank_s"]) == 2 and len(t["peak_memory_bytes_per_rank"]) == 2
    assert all(r["bubble"] > 0 for r in t["time_split_per_rank_s"])  # each stage waits for the other
    assert t["device_peak_tflops"] == pytest.approx(1.0)


def test_disabled_timers_change_nothing():
    timers = StepTimers(False, torch.device("cpu"))

    def f():
        return 1

    assert timers.wrap_forward(f) is f and timers.exchange_hook is None
    rec = {}
    timers.start(), timers.mark("pipeline"), timers.finish(rec)
    assert rec == {}


def test_enabled_timers_split_a_step_into_phases():
    timers = StepTimers(True, torch.device("cpu"))
    fwd = timers.wrap_forward(lambda: time.sleep(0.02))
    exchange = timers.exchange_hook(lambda: time.sleep(0.01))  # what the pipeline executor wraps
    timers.start()
    fwd()
    exchange()
    time.sleep(0.01)  # "backward"
    timers.mark("pipeline")
    time.sleep(0.01)
    timers.mark("communication")
    timers.mark("optimizer")
    rec = {}
    timers.finish(rec)
    (mine,) = rec["step_timers"]["per_rank"]
    v = dict(zip(rec["step_timers"]["fields"], mine))
    assert list(rec["step_timers"]["fields"]) == list(FIELDS)
    assert v["forward"] >= 0.02 and v["backward"] >= 0.01 and v["communication"] >= 0.01 and v["bubble"] >= 0.01
    assert v["total"] == pytest.approx(sum(v[p] for p in PHASES)) and v["peak_memory_bytes"] > 0
    fwd()  # outside a step: not counted
