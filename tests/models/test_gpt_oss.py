"""gpt-oss: the presets' parameter counts against transformers' own GptOssForCausalLM built on the meta device and
the published totals (the dry run's) and the alternating layer pattern of transformers' config."""

from __future__ import annotations

import pytest
import torch
import transformers

from megakernels_models.cli import parse_train_args
from megakernels_models.models.config import PRESETS
from megakernels_models.models.gpt_oss import pattern
from megakernels_models.models.gpt_oss.model import GptOssModel
from megakernels_models.planning.dryrun import report


def _hf_config(cfg) -> transformers.GptOssConfig:
    return transformers.GptOssConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.moe_ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.moe_top_k,
        sliding_window=cfg.sliding_window,
    )


@pytest.mark.parametrize("name", ["gpt-oss-tiny", "gpt-oss-20b", "gpt-oss-120b"])
def test_presets_count_what_transformers_counts_and_follow_its_layer_pattern(single_world, name):
    cfg = PRESETS[name]
    hf = _hf_config(cfg)
    assert cfg.layer_types == tuple(hf.layer_types) == pattern(cfg.num_layers)
    with torch.device("meta"):
        theirs = sum(p.numel() for p in transformers.GptOssForCausalLM(hf).parameters())
    model = GptOssModel(cfg, seed=0, device="meta")
    padding = 2 * (model.padded_vocab_size - cfg.vocab_size) * cfg.hidden_size  # the GEMM rows of both tables
    assert sum(p.numel() for p in model.parameters()) - padding == theirs
    rope = hf.rope_parameters
    assert (rope["rope_type"], rope["factor"], rope["truncate"]) == ("yarn", cfg.rope_scaling_factor, cfg.rope_truncate)
    if name != "gpt-oss-tiny":
        assert (rope["rope_theta"], rope["original_max_position_embeddings"]) == (
            cfg.rope_theta,
            cfg.rope_original_max_positions,
        )


@pytest.mark.parametrize("name,total,active", [("gpt-oss-20b", 20.9e9, 3.6e9), ("gpt-oss-120b", 116.8e9, 5.1e9)])
def test_the_dry_run_prints_the_published_totals(name, total, active):
    rep = report(
        parse_train_args(["--preset", name, "--nproc", "8", "--ep", "8", "--micro-batch-size", "1", "--dry-run"]),
        out=lambda s: None,
    )
    assert rep["parameters"] == pytest.approx(total, rel=0.01)
    cfg = PRESETS[name]
    # the published active count leaves the input embedding out (the output layer, untied, is in it)
    assert rep["active_parameters"] - cfg.vocab_size * cfg.hidden_size == pytest.approx(active, rel=0.01)

