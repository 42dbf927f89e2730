"""Device ceilings measured on the spot: copy bandwidth and GEMM FLOP/s per dtype."""

from __future__ import annotations

import pytest

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
