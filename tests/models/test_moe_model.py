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


def test_the_trainer_balances_experts_without_an_auxiliary_loss_and_checkpoints_the_bias(world1, tmp_path):
    """DeepSeek-V3's routing in the trainer: the first layer dense, sigmoid scores, group-limited top-k and the
    balancing bias moved after each step (its norm logged); the bias is in the checkpoint, so a resumed run's
    next step is the uninterrupted run's."""
    import dataclasses

    from megakernels_models.arguments import TrainArgs, validate
    from megakernels_models.training.train import train

    args = TrainArgs(
        model="llama", preset=None, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, seq_length=32,
        ffn_hidden_size=96, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32, moe_first_dense=1,
        moe_score="sigmoid", moe_n_group=2, moe_topk_group=2, moe_routed_scaling=2.0, moe_expert_bias=True,
        moe_aux_loss_coeff=0.0, moe_bias_update_rate=0.1, dropout=0.0, steps=3, lr_decay_steps=3, micro_batch_size=4,
        global_batch_size=8, eval_interval=0, progress=False, corpus_bytes=1 << 18, seed=3,
    )  # fmt: skip
    cfg = validate(args)
    assert [cfg.is_moe_layer(i) for i in range(2)] == [False, True]
    whole = train(args)
    norms = [r["moe_expert_bias_norm"] for r in whole]
    # each step moves each of 4 biases by 0.1 or not at all: the norm is 0.1 * sqrt(moved) after one step; later
    # every bias is a multiple of 0.1 of magnitude <= 0.1 * step, so norm^2 is a multiple of 0.01
    assert norms[0] == pytest.approx(0.2)  # all four moved (no expert exactly at the mean)
    assert all(
        n <= 0.1 * step * 2 + 1e-6 and abs(n**2 / 0.01 - round(n**2 / 0.01)) < 1e-4 for step, n in enumerate(norms, 1)
    )
    ckpt = str(tmp_path / "ckpt")
    train(dataclasses.replace(args, steps=1, save=ckpt))  # saved with the bias of step 1 (not zero)
    resumed = train(dataclasses.replace(args, load=ckpt))
    assert [r["step"] for r in resumed] == [2, 3]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole[1:]]
    assert [r["moe_expert_bias_norm"] for r in resumed] == norms[1:]


@pytest.mark.parametrize(
    "change",
    [dict(moe_score="sigmoid"), dict(moe_n_group=2), dict(moe_routed_scaling=2.5), dict(moe_expert_bias=True),
     dict(moe_first_dense=1)],
)  # fmt: skip
def test_softmax_routed_families_refuse_deepseek_routing_on_export(change):
    """Mixtral, Qwen 3 MoE and gpt-oss route by softmax in every layer: a model using one of DeepSeek-V3's routing
    settings is refused, naming it, rather than exported with another routing."""
    import dataclasses

    from megakernels_models.convert import gpt_oss, mixtral, qwen3_moe
    from megakernels_models.convert.common import ConversionError

    for preset, convert in (("llama-moe-tiny", mixtral), ("qwen3-30b-a3b", qwen3_moe), ("gpt-oss-tiny", gpt_oss)):
        cfg = dataclasses.replace(PRESETS[preset], **change)
        with pytest.raises(ConversionError, match="softmax" if convert is not gpt_oss else next(iter(change))):
            convert.config_to_theirs(cfg)
