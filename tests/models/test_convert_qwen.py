"""Qwen 2.5 (q/k/v biases only) and Qwen 3 dense (per-head q/k RMSNorm) <-> megakernels Qwen, against transformers
(random small models built here, nothing downloaded): logits and greedy tokens both ways, training at tp 2 from
transformers' loss, and the published sizes of the presets."""

from __future__ import annotations

import pytest
import torch
import transformers  # noqa: E402  (the test extra)

from megakernels_models import convert  # noqa: E402
from megakernels_models.training import checkpoint  # noqa: E402

V, S = 300, 32
SMALL = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=V,
    max_position_embeddings=S,
    rope_theta=5000.0,
    rms_norm_eps=1e-6,
)
KINDS = {
    "qwen2": (lambda **kw: transformers.Qwen2Config(**SMALL, **kw), transformers.Qwen2ForCausalLM),
    "qwen3": (lambda **kw: transformers.Qwen3Config(**SMALL, head_dim=8, **kw), transformers.Qwen3ForCausalLM),
    # heads of 16 over a 32-wide model (queries 64 wide), 4 experts of 16, top 2
    "qwen3_moe": (
        lambda **kw: transformers.Qwen3MoeConfig(
            **SMALL, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, **kw
        ),
        transformers.Qwen3MoeForCausalLM,
    ),
}


def _hf(kind, path, **kw):
    torch.manual_seed(0)
    make, cls = KINDS[kind]
    model = cls(make(**kw)).eval()
    with torch.no_grad():  # norms away from 1, biases away from 0
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return model


def _ours(ckpt_dir, ids):
    from megakernels_models.models.qwen.model import QwenModel

    meta, _ = convert.read_checkpoint(str(ckpt_dir))
    cfg = convert.ModelConfig.from_dict(meta["config"])
    model = QwenModel(cfg, seed=0).eval()
    checkpoint.load(checkpoint.read_latest(str(ckpt_dir)), [model], None, cfg)
    with torch.no_grad():
        return model(ids).transpose(0, 1)[..., : cfg.vocab_size], cfg


@pytest.mark.parametrize(
    "kind,tied,extra",
    [
        ("qwen2", False, {}),
        ("qwen2", True, {}),
        ("qwen3", False, {}),
        ("qwen3", True, {}),
        ("qwen3_moe", False, {"norm_topk_prob": True}),
        ("qwen3_moe", False, {"norm_topk_prob": False}),
    ],
)
def test_qwen_converts_both_ways_with_transformers_logits_and_tokens(single_world, tmp_path, kind, tied, extra):
    from megakernels_models import load_pretrained
    from megakernels_models.inference.generate import generate

    hf = _hf(kind, tmp_path / "hf", tie_word_embeddings=tied, **extra)
    assert any(n.endswith("q_proj.bias") for n, _ in hf.named_parameters()) == (kind == "qwen2")
    ids = torch.randint(0, V, (2, S))
    with torch.no_grad():
        ref = hf(ids).logits
    convert.hf_to_megakernels(str(tmp_path / "hf"), str(tmp_path / "mk"))
    ours, cfg = _ours(tmp_path / "mk", ids)
    assert (cfg.model, cfg.qkv_bias, cfg.qk_norm, cfg.bias) == ("qwen", kind == "qwen2", kind != "qwen2", False)
    assert (cfg.num_experts, cfg.moe_normalize) == ((4, extra["norm_topk_prob"]) if extra else (0, True))
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    prompt = ids[:1, :8]
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert generate(load_pretrained(str(tmp_path / "mk")), prompt, max_new_tokens=8).tolist() == theirs.tolist()
    convert.megakernels_to_hf(str(tmp_path / "mk"), str(tmp_path / "back"))
    back = KINDS[kind][1].from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kind,first,layouts",
    [
        ("qwen3", dict(tp=2, nproc=2), [dict(tp=1, nproc=1), dict(tp=2, pp=2, nproc=4)]),
        ("qwen3_moe", dict(ep=2, nproc=2), [dict(ep=1, nproc=1), dict(tp=2, ep=2, nproc=4)]),
    ],
)
def test_a_converted_qwen3_trains_at_any_layout_from_transformers_loss(tmp_path, kind, first, layouts):
    """At tp 2 (with ep 2 for the MoE) the q/k norms are replicated over the ranks, each seeing its own heads: the
    first step's loss is transformers' on the same batch, training (their gradients summed over the ranks) lowers
    it, and one process and tp 2 x pp 2 give the same losses."""
    import dataclasses

    import torch.nn.functional as F

    from megakernels_models.arguments import TrainArgs, validate
    from megakernels_models.data.build import build_datasets
    from megakernels_models.data.datasets import collate
    from megakernels_models.training.train import run

    hf = _hf(kind, tmp_path / "hf")
    convert.hf_to_megakernels(str(tmp_path / "hf"), str(tmp_path / "mk"))
    meta, _ = convert.read_checkpoint(str(tmp_path / "mk"))
    args = TrainArgs(
        architecture=meta["config"],  # what --config FILE with the checkpoint's architecture gives
        steps=4,
        lr=1e-2,
        micro_batch_size=2,
        global_batch_size=4,
        eval_interval=0,
        progress=False,
        corpus_bytes=1 << 18,
        load=str(tmp_path / "mk"),
        dropout=0.0,
        **first,
    )
    cfg = validate(dataclasses.replace(args))
    assert cfg.qk_norm and cfg.model == "qwen"
    batch = collate([build_datasets(args, cfg)[0][i] for i in range(4)])
    with torch.no_grad():
        expected = F.cross_entropy(hf(batch["ids"]).logits.reshape(-1, V), batch["labels"].reshape(-1)).item()
    losses = [r["loss"] for r in run(args)]
    assert losses[0] == pytest.approx(expected, rel=1e-5)
    assert losses[-1] < losses[0]
    # the same run on one process and at other layouts: the same losses (the norms' gradients summed over tp)
    for layout in layouts:
        again = [r["loss"] for r in run(dataclasses.replace(args, **layout))]
        assert again == pytest.approx(losses, rel=1e-5), layout


@pytest.mark.parametrize(
    "kind,change,message",
    [
        ("qwen2", dict(use_sliding_window=True, sliding_window=8), "use_sliding_window with sliding_window 8"),
        ("qwen3", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling of type 'yarn'"),
    ],
)
def test_unconvertible_qwens_are_refused_naming_the_setting(tmp_path, capsys, kind, change, message):
    """A per-layer window (Qwen 2's use_sliding_window, windowed from max_window_layers on) and YaRN scaling have
    no megakernels equivalent: the conversion stops naming them and writes nothing."""
    from megakernels_models.cli import main

    _hf(kind, tmp_path / "hf", **change)
    argv = ["convert", "hf-to-megakernels", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "o")]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
