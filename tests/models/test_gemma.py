"""Gemma 3 (text): the presets' parameter counts against transformers' own Gemma3ForCausalLM built on the meta
device, the 5:1 local/global pattern of transformers' config, the pieces the family switches on in the shared
layers (gemma-tiny's training on the embedded data is test_train's)."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from megakernels_models.models.config import PRESETS
from megakernels_models.models.gemma import pattern
from megakernels_models.models.gemma.model import GemmaModel


def _hf_config(cfg) -> transformers.Gemma3TextConfig:
    scaling = {"rope_type": "linear", "factor": cfg.rope_scaling_factor} if cfg.rope_scaling else None
    return transformers.Gemma3TextConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        query_pre_attn_scalar=cfg.query_pre_attn_scalar,
        sliding_window=cfg.sliding_window,
        rope_scaling=scaling,
    )


@pytest.mark.parametrize("name", ["gemma-tiny", "gemma3-1b", "gemma3-4b", "gemma3-12b", "gemma3-27b"])
def test_presets_count_what_transformers_counts_and_follow_its_layer_pattern(single_world, name):
    cfg = PRESETS[name]
    hf = _hf_config(cfg)
    assert cfg.layer_types == tuple(hf.layer_types) == pattern(cfg.num_layers)
    with torch.device("meta"):
        theirs = sum(p.numel() for p in transformers.Gemma3ForCausalLM(hf).parameters())  # tied: counted once
    model = GemmaModel(cfg, seed=0, device="meta")
    padding = (model.padded_vocab_size - cfg.vocab_size) * cfg.hidden_size  # the GEMM-friendly rows of the table
    assert sum(p.numel() for p in model.parameters()) - padding == theirs
    assert hf.rope_parameters["sliding_attention"]["rope_theta"] == cfg.local_rope_theta
    assert hf.rope_parameters["full_attention"]["rope_theta"] == cfg.rope_theta


def test_the_family_switches_on_gemmas_pieces(single_world):
    cfg = PRESETS["gemma-tiny"]
    model = GemmaModel(cfg, seed=3)
    layer = model.layers[0]
    assert layer.attention.core.softmax_scale == pytest.approx(48**-0.5)
    assert layer.attention_output_norm is not None and layer.mlp_output_norm is not None
    assert layer.attention.q_norm is not None and model.output_layer is None
    assert [lay.attention.window for lay in model.layers] == [64] * 5 + [None]
    ids = torch.randint(0, cfg.vocab_size, (1, 8))
    word = model.embedding.word(ids.t())
    embedded = model.embedding(ids.t())
    torch.testing.assert_close(embedded, word * math.sqrt(cfg.hidden_size))
    capped = GemmaModel(cfg.replace(final_logit_softcapping=2.0), seed=3)
    with torch.no_grad():
        logits = capped(ids)[..., : cfg.vocab_size]
        plain = model(ids)[..., : cfg.vocab_size]
    assert logits.abs().max() < 2.0
    torch.testing.assert_close(logits, 2.0 * torch.tanh(plain / 2.0))
    # the loss of the capped logits, the cap inside the kernels: the fused head and the unfused one
    labels = torch.randint(0, cfg.vocab_size, (1, 8))
    want = torch.nn.functional.cross_entropy(logits[:, 0].double(), labels[0], reduction="none")
    for fused in (True, False):
        head = GemmaModel(cfg.replace(final_logit_softcapping=2.0), seed=3, fused_linear_ce=fused)
        with torch.no_grad():
            torch.testing.assert_close(head(ids, labels)[:, 0].double(), want, rtol=1e-5, atol=1e-5)


def _hf_tiny(path, **kw):
    torch.manual_seed(0)
    config = dict(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=32,
        sliding_window=8,
        query_pre_attn_scalar=24,
        rope_local_base_freq=5000.0,
    )
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**{**config, **kw})).eval()
    with torch.no_grad():  # norms away from their zero (a weight of one)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"rope_scaling": {"rope_type": "linear", "factor": 8.0}, "final_logit_softcapping": 3.0},
        # another shape: 7 layers (a full one then a sliding one after it), one kv head, wider heads
        {"hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 7, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 32, "query_pre_attn_scalar": 32},
    ],
)  # fmt: skip
def test_gemma3_converts_both_ways_with_transformers_logits(single_world, tmp_path, extra):
    from megakernels_models import convert
    from megakernels_models.training import checkpoint

    hf = _hf_tiny(tmp_path / "hf", **extra)
    ids = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        ref = hf(ids).logits
    convert.hf_to_megakernels(str(tmp_path / "hf"), str(tmp_path / "mk"))
    meta, _ = convert.read_checkpoint(str(tmp_path / "mk"))
    cfg = convert.ModelConfig.from_dict(meta["config"])
    assert cfg.model == "gemma" and cfg.layer_types == pattern(hf.config.num_hidden_layers)
    model = GemmaModel(cfg, seed=0).eval()
    checkpoint.load(checkpoint.read_latest(str(tmp_path / "mk")), [model], None, cfg)
    with torch.no_grad():
        ours = model(ids).transpose(0, 1)[..., : cfg.vocab_size]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    convert.megakernels_to_hf(str(tmp_path / "mk"), str(tmp_path / "back"))
    back = transformers.Gemma3ForCausalLM.from_pretrained(tmp_path / "back").eval()
    theirs = back.state_dict()
    assert theirs.keys() == hf.state_dict().keys()
    for name, p in hf.state_dict().items():  # HF -> ours -> HF: bit-exact (the norms' weights too)
        assert torch.equal(theirs[name], p), name
    convert.hf_to_megakernels(str(tmp_path / "back"), str(tmp_path / "mk2"))  # ours -> HF -> ours: bit-exact
    first, second = convert.read_checkpoint(str(tmp_path / "mk"))[1], convert.read_checkpoint(str(tmp_path / "mk2"))[1]
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_attention_logit_soft_capping_is_refused_by_name(tmp_path, capsys):
    from megakernels_models.cli import main

    _hf_tiny(tmp_path / "hf", attn_logit_softcapping=50.0)
    assert main(["convert", "hf-to-megakernels", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "o")]) == 2
    assert "attn_logit_softcapping=50.0" in capsys.readouterr().err
