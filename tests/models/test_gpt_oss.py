"""gpt-oss: the presets' parameter counts against transformers' own GptOssForCausalLM built on the meta device and
the published totals (the dry run's), the alternating layer pattern of transformers' config, the pieces the family
switches on in the shared layers, conversion both ways with transformers' logits and gradients (MXFP4-packed experts
included). gpt-oss-tiny's training on the embedded data is test_train's."""

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
    assert rep["active_parameters_without_embedding"] == pytest.approx(active, rel=0.01)
    assert rep["active_parameters"] - rep["active_parameters_without_embedding"] == cfg.vocab_size * cfg.hidden_size


def test_the_family_switches_on_gpt_oss_pieces_and_takes_its_flags(single_world):
    from megakernels_models.arguments import validate

    cfg = validate(parse_train_args(["--preset", "gpt-oss-tiny", "--swiglu-limit", "3", "--swiglu-alpha", "1.5"]))
    assert (cfg.swiglu_limit, cfg.swiglu_alpha) == (3.0, 1.5)
    model = GptOssModel(cfg, seed=0, device="meta")
    assert [layer.attention.window for layer in model.layers] == [64, None, 64, None]
    moe = model.layers[0].mlp
    assert moe.router.softmax_topk and moe.router.bias is not None and moe.top_k == 4
    assert (moe.experts.swiglu_limit, moe.experts.swiglu_alpha) == (3.0, 1.5)
    assert moe.experts.fc1_bias.shape == (8, 256) and moe.experts.fc2_bias.shape == (8, 128)
    assert model.layers[0].attention.sinks.dtype == torch.float32 and model.output_layer is not None
    with pytest.raises(ValueError, match="swiglu_limit must be a finite number > 0"):
        cfg.replace(swiglu_limit=0.0)
    with pytest.raises(ValueError, match="num_experts must be > 0"):
        cfg.replace(num_experts=0)
    with pytest.raises(ValueError, match="no shared experts"):
        cfg.replace(moe_shared_experts=1)
    from megakernels.parallel.moe import GroupedMLP

    with pytest.raises(ValueError, match="swiglu_limit is the clamped SwiGLU's; activation is 'gelu'"):
        GroupedMLP(8, 8, 2, 0, 2, activation="gelu", swiglu_limit=1.0, device="meta")


SHAPES = {
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64, num_local_experts=4),
    "clamped": dict(
        num_attention_heads=2, num_key_value_heads=1, head_dim=24, intermediate_size=32, num_local_experts=6,
        num_experts_per_tok=3, swiglu_limit=0.05, swiglu_alpha=2.5, tie_word_embeddings=True,
    ),
    "plain-rope": dict(
        num_attention_heads=4, num_key_value_heads=4, head_dim=8, intermediate_size=32, num_local_experts=4,
        num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, num_hidden_layers=2,
    ),
}  # fmt: skip


def _hf_tiny(**kw) -> transformers.GptOssForCausalLM:
    """A random transformers gpt-oss (eager attention with its sinks, eager experts), every bias and norm set away
    from its start so that each matters."""
    torch.manual_seed(0)
    config = dict(
        vocab_size=300,
        hidden_size=32,
        num_hidden_layers=4,
        max_position_embeddings=64,  # YaRN's factor 4 over 16 positions
        sliding_window=8,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 100.0,  # a ramp whose bounds fall between pair indices: truncate matters
            "factor": 4.0,
            "beta_fast": 8.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 16,
        },
        attn_implementation="eager",
        experts_implementation="eager",  # the per-expert loop (its grouped GEMMs take no fp64)
    )
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**config, **kw})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name or "sinks" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def _ours(path, dtype=torch.float32):
    from megakernels_models import convert
    from megakernels_models.training import checkpoint

    meta, _ = convert.read_checkpoint(str(path))
    cfg = convert.ModelConfig.from_dict(meta["config"])
    model = GptOssModel(cfg, seed=0, dtype=dtype).eval()
    checkpoint.load(checkpoint.read_latest(str(path)), [model], None, cfg)
    return cfg, model


@pytest.mark.parametrize("shape", list(SHAPES))
def test_gpt_oss_converts_both_ways_with_transformers_logits(single_world, tmp_path, shape):
    from megakernels_models import convert

    hf = _hf_tiny(**SHAPES[shape])
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ids = torch.randint(0, 300, (2, 32))
    convert.hf_to_megakernels(str(tmp_path / "hf"), str(tmp_path / "mk"))
    cfg, model = _ours(tmp_path / "mk")
    assert cfg.model == "gpt_oss" and cfg.layer_types == pattern(cfg.num_layers) and cfg.sinks
    assert (cfg.swiglu_limit, cfg.swiglu_alpha) == (hf.config.swiglu_limit, hf.config.swiglu_alpha)
    with torch.no_grad():
        ref = hf(ids).logits
        ours = model(ids).transpose(0, 1)[..., : cfg.vocab_size]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    convert.megakernels_to_hf(str(tmp_path / "mk"), str(tmp_path / "back"))
    back = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "back").state_dict()
    for name, p in hf.state_dict().items():
        assert torch.equal(back[name], p), name
    convert.hf_to_megakernels(str(tmp_path / "back"), str(tmp_path / "again"))
    first, second = convert.read_checkpoint(str(tmp_path / "mk"))[1], convert.read_checkpoint(str(tmp_path / "again"))
    assert second[0]["config"] == convert.read_checkpoint(str(tmp_path / "mk"))[0]["config"]
    assert first.keys() == second[1].keys() and all(torch.equal(first[k], second[1][k]) for k in first)


@pytest.mark.parametrize("shape", ["gqa", "clamped"])
def test_gpt_oss_in_fp64_matches_transformers_logits_and_gradients(single_world, tmp_path, shape):
    """Every parameter's gradient too (transformers' mapped by the conversion's own rules). Transformers' gpt-oss in
    fp64 still takes its RMSNorm and rotary table through fp32: equal to that rounding."""
    from megakernels_models import convert
    from megakernels_models.convert import gpt_oss
    from megakernels_models.convert.common import apply

    hf = _hf_tiny(**SHAPES[shape])
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    convert.hf_to_megakernels(str(tmp_path / "hf"), str(tmp_path / "mk"))
    cfg, model = _ours(tmp_path / "mk", torch.float64)
    hf = hf.double()
    ids, weights = torch.randint(0, 300, (2, 32)), torch.randn(2, 32, 300, dtype=torch.float64)
    ref = hf(ids).logits
    ours = model(ids).transpose(0, 1)[..., : cfg.vocab_size]
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    (ref * weights).sum().backward()
    (ours * weights).sum().backward()
    theirs = apply(gpt_oss.rules(cfg), {n: p.grad for n, p in hf.named_parameters()}, "to_ours", (), gpt_oss.tied(cfg))
    for name, p in model.named_parameters():
        head, _, leaf = name.rpartition(".")
        if head.endswith("mlp.experts"):  # stacked over the experts; the rules name each
            expected = torch.stack([theirs[f"{head}.{e}.{leaf}"] for e in range(cfg.num_experts)])
        else:
            expected = theirs[name]
        rows = expected.shape[0]  # the vocabulary's padding rows have no gradient
        torch.testing.assert_close(
            p.grad[:rows], expected.to(p.dtype), rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}"
        )


def _pack(tmp_path, hf, quant_method="mxfp4"):
    """Save ``hf`` with its experts' matrices as random MXFP4 blocks and scales (``hf`` takes their values, as
    transformers dequantises them); returns the directory."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from megakernels_models.convert.gpt_oss import dequantize_mxfp4

    path = tmp_path / "packed"
    hf.save_pretrained(path, safe_serialization=True)
    tensors = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    for name in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, rows_in, rows_out = tensors.pop(name).shape
        blocks = torch.randint(0, 256, (E, rows_out, rows_in // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(118, 123, (E, rows_out, rows_in // 32), dtype=torch.uint8, generator=g)
        values = dequantize_mxfp4(blocks, scales)
        assert torch.equal(values, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        with torch.no_grad():
            hf.get_parameter(name).copy_(values)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": quant_method,
        "modules_to_not_convert": ["model.layers.*.self_attn"],
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_mxfp4_packed_experts_are_dequantised_on_import(single_world, tmp_path, capsys):
    from megakernels_models import convert

    hf = _hf_tiny(**SHAPES["gqa"])
    packed = _pack(tmp_path, hf)
    convert.hf_to_megakernels(str(packed), str(tmp_path / "mk"))
    assert "dequantising 8 MXFP4-packed expert tensors" in capsys.readouterr().err
    cfg, model = _ours(tmp_path / "mk")
    ids = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        ref = hf(ids).logits
        ours = model(ids).transpose(0, 1)[..., : cfg.vocab_size]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda d: _pack(d, _hf_tiny(**SHAPES["gqa"]), "bitsandbytes"), "quant_method 'bitsandbytes'"),
        (
            lambda d: _hf_dir(d, rope_parameters={"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.5,
                                                  "original_max_position_embeddings": 8, "rope_theta": 1e4}),
            "rope_parameters.attention_factor=0.5",
        ),
        (lambda d: _hf_dir(d, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "type 'longrope'"),
    ],
    ids=["quantisation", "attention-factor", "longrope"],
)  # fmt: skip
def test_what_megakernels_cannot_represent_is_refused_by_name(tmp_path, capsys, change, message):
    from megakernels_models.cli import main

    path = change(tmp_path)
    assert main(["convert", "hf-to-megakernels", "--input", str(path), "--output", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err


def _hf_dir(tmp_path, **rope):
    """A saved tiny gpt-oss whose config.json then takes ``rope`` (transformers would refuse to build some)."""
    import json

    path = tmp_path / "hf"
    _hf_tiny(**SHAPES["gqa"]).save_pretrained(path, safe_serialization=True)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **rope}))
    return path


def test_an_unpaired_mxfp4_tensor_and_an_inexpressible_export_are_refused_by_name():
    from megakernels_models.convert import gpt_oss
    from megakernels_models.convert.common import ConversionError

    with pytest.raises(ConversionError, match="'model.x.gate_up_proj_scales' has no blocks/scales partner"):
        gpt_oss.normalize({"model.x": torch.zeros(1), "x.gate_up_proj_scales": torch.zeros(1, dtype=torch.uint8)})
    cfg = PRESETS["gpt-oss-tiny"]
    with pytest.raises(ConversionError, match="sinks=False"):
        gpt_oss.config_to_theirs(cfg.replace(sinks=False))
    with pytest.raises(ConversionError, match="moe_capacity_factor"):
        gpt_oss.config_to_theirs(cfg.replace(moe_capacity_factor=1.0))
