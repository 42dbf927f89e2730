"""The machine table (``megakernels.machines``): every figure has its source, the dense rating's clock is the one the
architecture's FLOPs per clock imply, and torch's device names find their parts."""

from __future__ import annotations

import dataclasses

import pytest

from megakernels import machines

FIGURES = [f.name for f in dataclasses.fields(machines.GPU) if f.name not in ("key", "name", "torch_names", "family")]
FIGURES.remove("arch")
FIGURES.remove("sources")


@pytest.mark.parametrize("gpu", machines.GPUS.values(), ids=lambda g: g.key)
def test_every_figure_names_its_source(gpu):
    named = {f.strip() for fields, _ in gpu.sources for f in fields.split(",")}
    assert [f for f in FIGURES if f not in named] == []
    assert gpu.key in machines.GPUS and machines.GPUS[gpu.key] is gpu


@pytest.mark.parametrize("gpu", [g for g in machines.GPUS.values() if g.arch in machines.ARCHS], ids=lambda g: g.key)
def test_the_rating_clock_is_the_architectures_flops_per_clock(gpu):
    assert gpu.bf16_dense / (gpu.sms * gpu.clock_hz) == pytest.approx(gpu.limits.mma_per_clk, rel=0.01)
    assert gpu.clock_hz <= gpu.boost_clock_hz * 1.001 and gpu.copy <= gpu.hbm


def test_torch_names_find_their_parts():
    assert machines.gpu_named("NVIDIA H100 80GB HBM3").key == "H100-SXM"
    assert machines.gpu_named("NVIDIA H100 NVL").key == "H100-NVL"
    assert machines.gpu_named("NVIDIA H100 PCIe").key == "H100-PCIe"
    assert machines.gpu_named("NVIDIA H200").key == "H200"
    assert machines.gpu_named("NVIDIA A100-SXM4-40GB") is None  # another part: its HBM differs
    assert machines.gpu_named("NVIDIA A100-SXM4-40GB", exact=False).key == "A100-SXM4-80GB"  # the same peaks
    assert machines.gpu_named("NVIDIA H100 NVL", exact=False).key == "H100-NVL"
    assert machines.gpu_named("NVIDIA GeForce RTX 4090", exact=False) is None


def test_peaks_by_precision():
    h = machines.H200
    assert (h.peak_flops("bf16"), h.peak_flops("fp8"), h.peak_flops("fp32")) == (989e12, 1979e12, 67e12)
    assert machines.GPUS["A100-SXM4-80GB"].peak_flops("fp8") == 312e12  # no FP8 tensor cores: the 16-bit rate
    with pytest.raises(ValueError, match="precision"):
        h.peak_flops("int4")
