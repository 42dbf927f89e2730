"""The DeepSeek-V3 family: the presets' parameter counts against transformers' DeepseekV3ForCausalLM built on the
meta device and the published totals (the dry run's), the FLOPs of latent attention, training on the embedded
data, and conversion both ways with transformers' logits on random tiny configurations (with and without the
query latent, interleaved rotary dims or not, group-limited routing, dense first layers)."""

from __future__ import annotations

import pytest
import torch
import transformers

from megakernels_models.cli import parse_train_args
from megakernels_models.models.config import PRESETS
from megakernels_models.models.deepseek.model import DeepseekModel
from megakernels_models.planning.dryrun import report


def _hf_config(cfg, **kw) -> transformers.DeepseekV3Config:
    return transformers.DeepseekV3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        moe_intermediate_size=cfg.moe_ffn_hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads, n_shared_experts=cfg.moe_shared_experts,
        n_routed_experts=cfg.num_experts, routed_scaling_factor=cfg.moe_routed_scaling, kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim, n_group=cfg.moe_n_group, topk_group=cfg.moe_topk_group,
        num_experts_per_tok=cfg.moe_top_k, first_k_dense_replace=cfg.moe_first_dense, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("name", ["deepseek-tiny", "deepseek-v3", "moonlight-16b-a3b", "kimi-k2"])
def test_presets_count_what_transformers_counts(single_world, name):
    cfg = PRESETS[name]
    with torch.device("meta"):
        theirs = sum(p.numel() for p in transformers.DeepseekV3ForCausalLM(_hf_config(cfg)).parameters())
    model = DeepseekModel(cfg, seed=0, device="meta")
    padding = 2 * (model.padded_vocab_size - cfg.vocab_size) * cfg.hidden_size  # the GEMM rows of both tables
    assert sum(p.numel() for p in model.parameters()) - padding == theirs


@pytest.mark.parametrize(
    "name,total,active,rel",
    # the model cards: V3 671 B / 37 B, V2-Lite 15.7 B / 2.4 B, Kimi K2 1 T / 32 B (rounded); active without the
    # input embedding (the output layer, untied, is in it)
    [("deepseek-v3", 671e9, 37e9, 0.02), ("deepseek-v2-lite", 15.7e9, 2.4e9, 0.03), ("kimi-k2", 1.0e12, 32e9, 0.03)],
)
def test_the_dry_run_prints_the_published_totals(name, total, active, rel):
    rep = report(
        parse_train_args(
            [
                "--preset",
                name,
                "--nproc",
                "64",
                "--ep",
                "64",
                "--micro-batch-size",
                "1",
                "--global-batch-size",
                "64",
                "--dry-run",
            ]  # fmt: skip
        ),
        out=lambda s: None,
    )
    assert rep["parameters"] == pytest.approx(total, rel=rel)
    assert rep["active_parameters_without_embedding"] == pytest.approx(active, rel=rel)


def test_latent_attention_flops_follow_its_projections(single_world):
    """The forward FLOPs per token: the GEMMs are twice the active matrices' parameters per layer (latent
    attention's projections counted as they are), the scores and weighted values ``2·a·(d_qk + d_v)`` per key."""
    cfg = PRESETS["deepseek-tiny"]
    model = DeepseekModel(cfg, seed=0, device="meta")
    attention = sum(p.numel() for n, p in model.named_parameters() if ".attention." in n and "norm" not in n)
    flops = cfg.forward_flops_per_token()
    mlp = flops["layers_gemm"] - 2.0 * attention
    dense = 3 * cfg.hidden_size * cfg.ffn_hidden_size
    moe = cfg.hidden_size * cfg.num_experts + (cfg.moe_top_k + cfg.moe_shared_experts) * 3 * cfg.hidden_size * 64
    assert mlp == 2.0 * (dense * cfg.moe_first_dense + moe * (cfg.num_layers - cfg.moe_first_dense))
    a, d_qk, d_v = cfg.num_heads, cfg.head_dim, cfg.v_head_dim
    assert flops["attention"] == 2.0 * a * (d_qk + d_v) * cfg.seq_length * cfg.num_layers


SHAPES = {
    "latent-query-interleaved": dict(q_lora_rank=24, rope_interleave=True, n_group=2, topk_group=1),
    "direct-query": dict(q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1),
    "grouped-two-dense": dict(q_lora_rank=16, rope_interleave=True, n_group=4, topk_group=2, first_k_dense_replace=2),
}


def _hf_tiny(**kw) -> transformers.DeepseekV3ForCausalLM:
    """A random transformers DeepSeek-V3 (eager attention and experts), its norms and correction biases set away
    from their start so that each matters."""
    torch.manual_seed(0)
    config = dict(
        vocab_size=300, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
        kv_lora_rank=12, qk_rope_head_dim=4, v_head_dim=6, qk_nope_head_dim=8, num_experts_per_tok=2,
        first_k_dense_replace=1, max_position_embeddings=64, attn_implementation="eager",
        experts_implementation="eager",
    )  # fmt: skip
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**config, **kw})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            if name.endswith("gate.weight"):
                p.normal_(0.0, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    return model


def _ours(path):
    from megakernels_models import convert
    from megakernels_models.training import checkpoint

    meta, _ = convert.read_checkpoint(str(path))
    cfg = convert.ModelConfig.from_dict(meta["config"])
    model = DeepseekModel(cfg, seed=0).eval()
    checkpoint.load(checkpoint.read_latest(str(path)), [model], None, cfg)
    return cfg, model


@pytest.mark.parametrize("shape", list(SHAPES))
def test_deepseek_v3_converts_both_ways_with_transformers_logits(single_world, tmp_path, shape):
    from megakernels_models import convert

    hf = _hf_tiny(**SHAPES[shape])
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ids = torch.randint(0, 300, (2, 32))
    convert.hf_to_megakernels(str(tmp_path / "hf"), str(tmp_path / "mk"))
    cfg, model = _ours(tmp_path / "mk")
    assert cfg.model == "deepseek" and cfg.moe_first_dense == hf.config.first_k_dense_replace
    with torch.no_grad():
        ref = hf(ids).logits
        ours = model(ids).transpose(0, 1)[..., : cfg.vocab_size]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    convert.megakernels_to_hf(str(tmp_path / "mk"), str(tmp_path / "back"))
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "back").state_dict()
    for name, p in hf.state_dict().items():
        assert torch.equal(back[name], p), name
    convert.hf_to_megakernels(str(tmp_path / "back"), str(tmp_path / "again"))
    first, second = convert.read_checkpoint(str(tmp_path / "mk"))[1], convert.read_checkpoint(str(tmp_path / "again"))
    assert first.keys() == second[1].keys() and all(torch.equal(first[k], second[1][k]) for k in first)


def test_what_deepseek_v3_cannot_express_is_refused_by_name():
    import dataclasses

    from megakernels_models.convert import deepseek_v3
    from megakernels_models.convert.common import ConversionError

    cfg = PRESETS["deepseek-tiny"]
    with pytest.raises(ConversionError, match="moe_score='softmax'"):
        deepseek_v3.config_to_theirs(dataclasses.replace(cfg, moe_score="softmax"))
    with pytest.raises(ConversionError, match="moe_capacity_factor"):
        deepseek_v3.config_to_theirs(dataclasses.replace(cfg, moe_capacity_factor=1.0))
    with pytest.raises(ConversionError, match="topk_method"):
        deepseek_v3.config_to_ours({"topk_method": "greedy", "hidden_act": "silu"})


V2_SHAPES = {
    "latent-query": dict(q_lora_rank=24, first_k_dense_replace=1),
    "direct-query-two-dense": dict(q_lora_rank=None, first_k_dense_replace=2),  # V2-Lite's form
}


@pytest.mark.parametrize("shape", list(V2_SHAPES))
def test_deepseek_v2_converts_both_ways_with_transformers_logits(single_world, tmp_path, shape):
    """DeepSeek-V2's softmax routing (greedy top-k, weights not renormalised, scaled) and complex-number rotary
    dims: our logits equal transformers' to 1e-4, the exported checkpoint is bit-exact, and ours exports as V2."""
    from megakernels_models import convert

    torch.manual_seed(0)
    config = transformers.DeepseekV2Config(
        vocab_size=300, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=1.5, kv_lora_rank=12, qk_rope_head_dim=4, v_head_dim=6, qk_nope_head_dim=8,
        num_experts_per_tok=2, max_position_embeddings=64, attn_implementation="eager",
        experts_implementation="eager", **V2_SHAPES[shape],
    )  # fmt: skip
    hf = transformers.DeepseekV2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            if name.endswith("gate.weight"):
                p.normal_(0.0, 0.3)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ids = torch.randint(0, 300, (2, 32))
    convert.hf_to_megakernels(str(tmp_path / "hf"), str(tmp_path / "mk"))
    cfg, model = _ours(tmp_path / "mk")
    assert (cfg.moe_score, cfg.moe_normalize, cfg.moe_expert_bias) == ("softmax", False, False)
    with torch.no_grad():
        ref = hf(ids).logits
        ours = model(ids).transpose(0, 1)[..., : cfg.vocab_size]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    convert.megakernels_to_hf(str(tmp_path / "mk"), str(tmp_path / "back"))
    back = transformers.DeepseekV2ForCausalLM.from_pretrained(tmp_path / "back")
    assert back.config.model_type == "deepseek_v2"
    back = back.state_dict()
    assert back.keys() == hf.state_dict().keys()
    for name, p in hf.state_dict().items():
        assert torch.equal(back[name], p), name


def test_what_deepseek_v2_cannot_express_is_refused_by_name():
    import dataclasses

    from megakernels_models.convert import deepseek_v2
    from megakernels_models.convert.common import ConversionError

    cfg = PRESETS["deepseek-v2-lite"]
    assert deepseek_v2.config_to_theirs(cfg)["topk_method"] == "greedy"
    for change, name in (
        (dict(moe_normalize=True), "moe_normalize"),
        (dict(mla_rope_interleave=False), "mla_rope_interleave=False"),
        (dict(mtp_layers=1), "mtp_layers"),
    ):
        with pytest.raises(ConversionError, match=name):
            deepseek_v2.config_to_theirs(dataclasses.replace(cfg, **change))
    with pytest.raises(ConversionError, match="moe_score='sigmoid'"):
        deepseek_v2.config_to_theirs(PRESETS["deepseek-tiny"])
    with pytest.raises(ConversionError, match="group_limited_greedy"):
        deepseek_v2.config_to_ours({"topk_method": "group_limited_greedy", "hidden_act": "silu"})


YARN = {
    # mscale apart from mscale_all_dim: the rotary tables' attention factor is their ratio and the softmax scale
    # takes mscale(mscale_all_dim)²; beta_fast / beta_slow and rope_theta put the ramp inside the 8 frequencies
    "mscale-pair": dict(mscale=0.8, mscale_all_dim=0.6),
    "mscale-all-dim-alone": dict(mscale_all_dim=0.6),  # the cos/sin factor 0.1 ln(factor) + 1, the fold kept
    "no-mscale": {},
}


@pytest.mark.parametrize("mscales", list(YARN))
def test_yarn_at_factor_4_matches_transformers_beyond_the_original_context(single_world, tmp_path, mscales):
    """A DeepSeek-V3 with YaRN (factor 4 over 16 original positions) converted to ours: the logits equal
    transformers' on 48 tokens, three times the original context, where the interpolated frequencies and both
    mscale folds (the rotary tables' attention factor, the softmax scale) decide them; converted back, the same
    YaRN settings and logits."""
    from megakernels_models import convert

    rope = dict(
        rope_type="yarn", rope_theta=100.0, factor=4.0, original_max_position_embeddings=16, beta_fast=1.0,
        beta_slow=0.1, **YARN[mscales],
    )  # fmt: skip
    hf = _hf_tiny(qk_rope_head_dim=16, rope_parameters=rope, max_position_embeddings=64, n_group=2, topk_group=1)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    convert.hf_to_megakernels(str(tmp_path / "hf"), str(tmp_path / "mk"))
    cfg, model = _ours(tmp_path / "mk")
    assert cfg.rope_scaling == "yarn" and cfg.rope_scaling_factor == 4.0 and cfg.rope_original_max_positions == 16
    ids = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        ours = model(ids).transpose(0, 1)[..., : cfg.vocab_size]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    convert.megakernels_to_hf(str(tmp_path / "mk"), str(tmp_path / "back"))  # and back: the same YaRN settings
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(
        tmp_path / "back", attn_implementation="eager", experts_implementation="eager"
    ).eval()
    assert {k: back.config.rope_parameters.get(k) for k in rope} == rope
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref, rtol=1e-5, atol=1e-6)
