"""MFU's denominator: the CPU peak is measured once per machine, thread count and dtype and cached; a step faster
than the cached peak raises it, so MFU never exceeds 1; GPUs use the table; --peak-tflops wins."""

from __future__ import annotations

import json

import pytest
import torch

from megakernels_models.training import mfu


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAKERNELS_CACHE", str(tmp_path))
    return tmp_path / "cpu_peak_tflops.json"


def test_the_cpu_peak_is_measured_once_and_cached(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(mfu, "measure_cpu_tflops", lambda dtype: calls.append(dtype) or 0.5)
    assert mfu.cpu_peak_tflops(torch.float32) == 0.5
    assert mfu.cpu_peak_tflops(torch.float32) == 0.5 and calls == [torch.float32]
    key = next(iter(json.loads(cache.read_text())))
    assert f"threads={torch.get_num_threads()}" in key and key.endswith("float32")


def test_a_step_faster_than_the_peak_raises_it_and_mfu_stays_at_most_one(cache, monkeypatch):
    monkeypatch.setattr(mfu, "measure_cpu_tflops", lambda dtype: 1.0)
    meter = mfu.MFUMeter(flops_per_token=1e12, tokens_per_step=3, world=1, precision="fp32", device=torch.device("cpu"))
    fast = meter.measure(1.0)  # 3 TFLOP/s against a cached 1.0
    assert fast["tflops_per_device"] == pytest.approx(3.0) and fast["mfu"] == pytest.approx(1.0)
    assert mfu.cpu_peak_tflops(torch.float32) == pytest.approx(3.0)  # the cache learnt it
    assert meter.measure(2.0)["mfu"] == pytest.approx(0.5)


def test_given_and_table_peaks(monkeypatch):
    assert mfu.device_peak_tflops("bf16", torch.device("cpu"), given=123.0) == (123.0, "given")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert mfu.device_peak_tflops("bf16", torch.device("cuda", 0)) == (989.0, "table")
    assert mfu.device_peak_tflops("fp32", torch.device("cuda", 0)) == (67.0, "table")


def test_the_measurement_leaves_the_default_generator_alone():
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    mfu.measure_cpu_tflops(torch.float32, n=64, trials=1)
    assert torch.equal(torch.rand(3), expected)
