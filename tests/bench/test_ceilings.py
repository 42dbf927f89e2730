"""Device ceilings measured on the spot: copy bandwidth and GEMM FLOP/s per dtype."""

from __future__ import annotations

import pytest
import torch

from megakernels.bench import ceilings


def test_quick_ceilings_are_positive_for_every_dtype_asked():
    c = ceilings.measure("cpu", ("float32", "bfloat16"), quick=True, log=lambda s: None)
    assert c["copy_GBps"] > 0 and c["copy_bytes"] == 64 << 20
    assert set(c["gemm_TFLOPs"]) == {"float32", "bfloat16"} and min(c["gemm_TFLOPs"].values()) > 0


def test_rows_are_held_against_the_ceiling_of_their_unit_and_dtype():
    c = {"copy_GBps": 40.0, "gemm_TFLOPs": {"float32": 0.2}}
    assert ceilings.for_unit(c, "GB/s", "bfloat16") == (40.0, "copy bandwidth")
    assert ceilings.for_unit(c, "TFLOP/s", "float32") == (0.2, "float32 GEMM rate")
    assert ceilings.for_unit(c, "TFLOP/s", "bfloat16")[0] is None
    assert ceilings.for_unit(None, "GB/s", "float32") == (None, "")


def test_unknown_gemm_dtype_names_the_argument():
    with pytest.raises(ValueError, match="dtype must be one of"):
        ceilings.gemm_tflops("cpu", "float8", n=16)
    with pytest.raises(ValueError, match="best_of must be at least 1"):
        ceilings.gemm_tflops("cpu", "float32", n=16, best_of=0)


def test_best_of_takes_the_fastest_call(monkeypatch):
    """The trainer's CPU peak is the fastest of several single calls: a scripted clock gives calls of 3, 1 and 2
    seconds, and the rate is that of the 1-second call (of the one product a 16 x 16 GEMM takes)."""
    ticks = iter([0.0, 3.0, 10.0, 11.0, 20.0, 22.0])
    monkeypatch.setattr(ceilings.time, "perf_counter", lambda: next(ticks))
    assert ceilings.gemm_tflops("cpu", "float32", n=16, best_of=3) == pytest.approx(2 * 16**3 / 1.0 / 1e12)


def test_the_trainers_cpu_peak_is_this_measurement(monkeypatch):
    from megakernels_models.training import mfu

    seen = []
    monkeypatch.setattr(ceilings, "gemm_tflops", lambda *a, **k: seen.append((a, k)) or 0.25)
    assert mfu.measure_cpu_tflops(torch.bfloat16, trials=4) == 0.25
    assert seen == [(("cpu", "bfloat16", 1024), {"best_of": 4})]
