"""HuggingFace Mixtral <-> megakernels MoE Llama: a randomly initialised small MixtralForCausalLM (built here; 4
experts, top 2, grouped-query attention) converts to a checkpoint whose logits equal transformers' and back, and
the trainer resumes it with its experts split over ep 2 from transformers' loss."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import transformers  # noqa: E402  (the test extra)

from megakernels_models import convert  # noqa: E402
from megakernels_models.cli import main  # noqa: E402
from megakernels_models.training import checkpoint  # noqa: E402

V, S = 300, 16


def _hf_mixtral(path, **kw):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        max_position_embeddings=S,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_theta=10000.0,
        **{"sliding_window": None, **kw},
    )
    model = transformers.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            if "gate.weight" in name:  # a router that actually prefers some experts
                p.mul_(20.0)
    model.save_pretrained(path, safe_serialization=True)
    return model


def test_mixtral_round_trip_gives_the_same_logits(single_world, tmp_path):
    from megakernels_models.models.llama.model import LlamaModel

    hf = _hf_mixtral(tmp_path / "hf")
    ids = torch.randint(0, V, (2, S))
    with torch.no_grad():
        ref = hf(ids).logits
    assert (
        main(["convert", "hf-to-megakernels", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "mk")]) == 0
    )
    meta, tensors = convert.read_checkpoint(str(tmp_path / "mk"))
    assert "layers.1.mlp.experts.3.fc1" in tensors and tensors["layers.1.mlp.experts.3.fc1"].shape == (48, 32)
    cfg = convert.ModelConfig.from_dict(meta["config"])
    assert (cfg.num_experts, cfg.moe_top_k, cfg.moe_normalize) == (4, 2, True)
    model = LlamaModel(cfg, seed=0).eval()
    checkpoint.load(checkpoint.read_latest(str(tmp_path / "mk")), [model], None, cfg)
    with torch.no_grad():
        ours = model(ids).transpose(0, 1)[..., :V]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    assert (
        main(["convert", "megakernels-to-hf", "--input", str(tmp_path / "mk"), "--output", str(tmp_path / "back")]) == 0
    )
    back = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref, rtol=1e-5, atol=1e-5)


def test_a_converted_mixtral_trains_with_experts_split_over_ep2(tmp_path):
    from megakernels_models.arguments import TrainArgs, validate
    from megakernels_models.data.build import build_datasets
    from megakernels_models.data.datasets import collate
    from megakernels_models.training.train import run

    hf = _hf_mixtral(tmp_path / "hf")
    convert.hf_to_megakernels(str(tmp_path / "hf"), str(tmp_path / "mk"))
    args = TrainArgs(
        model="llama",
        preset=None,
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        seq_length=S,
        vocab_size=V,
        ffn_hidden_size=24,
        num_experts=4,
        moe_top_k=2,
        moe_ffn_hidden_size=24,
        moe_aux_loss_coeff=0.001,
        rope_theta=10000.0,
        steps=3,
        lr=1e-2,
        micro_batch_size=2,
        global_batch_size=4,
        eval_interval=0,
        progress=False,
        corpus_bytes=1 << 18,
        load=str(tmp_path / "mk"),
        dropout=0.0,
        nproc=2,
        ep=2,
    )
    cfg = validate(dataclasses.replace(args))
    assert cfg.moe_normalize
    train_ds = build_datasets(args, cfg)[0]
    batch = collate([train_ds[i] for i in range(4)])
    with torch.no_grad():
        expected = F.cross_entropy(hf(batch["ids"]).logits.reshape(-1, V), batch["labels"].reshape(-1)).item()
    records = run(args)
    assert records[0]["loss"] == pytest.approx(expected, rel=1e-5)
    assert {"moe_aux_loss", "moe_z_loss", "max_expert_load", "mean_expert_load", "dropped_fraction"} <= set(records[0])
    assert records[0]["dropped_fraction"] == 0.0  # dropless


@pytest.mark.parametrize(
    "change,message",
    [(dict(router_jitter_noise=0.1), "router_jitter_noise")],
)
def test_unconvertible_mixtrals_are_refused(tmp_path, capsys, change, message):
    _hf_mixtral(tmp_path / "hf", **change)
    assert main(["convert", "hf-to-megakernels", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err
