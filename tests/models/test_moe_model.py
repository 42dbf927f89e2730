"""Mixture-of-experts models: the Mixtral 8x7B preset's published sizes (46.7 B total, 12.9 B active per token)
and FLOPs from the active parameters; the dry run's expert memory per device follows ep."""

from __future__ import annotations

import pytest

from megakernels_models.cli import parse_train_args
from megakernels_models.models.config import PRESETS
from megakernels_models.planning.dryrun import report


def _dry(*flags):
    return report(parse_train_args([*flags, "--dry-run"]), out=lambda s: None)


def test_mixtral_8x7b_has_the_published_total_and_active_parameters():
    rep = _dry(
        "--preset",
        "mixtral-8x7b",
        "--seq-length",
        "4096",
        "--nproc",
        "64",
        "--tp",
        "8",
        "--ep",
        "8",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "64",
    )
    assert rep["parameters"] == pytest.approx(46.7e9, rel=0.01)
    assert rep["active_parameters"] == pytest.approx(12.9e9, rel=0.01)


def test_flops_per_token_count_the_active_experts():
    cfg = PRESETS["mixtral-8x7b"]
    h, l, s, kv, f, V = (
        cfg.hidden_size,
        cfg.num_layers,
        cfg.seq_length,
        cfg.kv_size,
        cfg.moe_ffn_hidden_size,
        cfg.vocab_size,
    )
    per_layer = 2 * (2 * h * h + 2 * h * kv + cfg.num_experts * h + cfg.moe_top_k * 3 * h * f)
    assert cfg.flops_per_token() == pytest.approx(3 * (l * per_layer + 4 * s * h * l + 2 * h * V), rel=1e-12)


def test_expert_memory_per_device_shrinks_with_ep():
    flags = [
        "--preset",
        "mixtral-8x7b",
        "--seq-length",
        "4096",
        "--nproc",
        "64",
        "--tp",
        "8",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "64",
        "--precision",
        "bf16",
    ]
    ep1, ep8 = _dry(*flags), _dry(*flags, "--ep", "8")
    assert ep8["expert_memory_per_device_bytes"] == pytest.approx(ep1["expert_memory_per_device_bytes"] / 8, rel=1e-6)
    assert ep8["memory_per_device_bytes"] < ep1["memory_per_device_bytes"]


@pytest.mark.parametrize(
    "name,published",
    [
        ("llama3.1-8b", 8.03e9),
        ("llama3.1-70b", 70.6e9),
        ("llama3.2-1b", 1.24e9),
        ("llama3.2-3b", 3.21e9),
        ("qwen2.5-7b", 7.61e9),
        ("qwen3-8b", 8.19e9),
        ("qwen3-30b-a3b", 30.5e9),
    ],
)
def test_open_model_presets_have_the_published_parameter_counts(name, published):
    rep = _dry("--preset", name, "--nproc", "8", "--tp", "4", "--micro-batch-size", "1", "--global-batch-size", "8")
    assert rep["parameters"] == pytest.approx(published, rel=0.01)


def test_qwen3_moe_preset_has_the_published_active_parameters():
    rep = _dry("--preset", "qwen3-30b-a3b", "--nproc", "8", "--ep", "8", "--micro-batch-size", "1")
    assert rep["active_parameters"] == pytest.approx(3.3e9, rel=0.02)  # published as "3.3B activated"
