"""HuggingFace GPT-2 and BERT <-> megakernels: a randomly initialised small GPT2LMHeadModel (built here, nothing
downloaded) converted to a megakernels checkpoint gives the same logits in megakernels' GPT (at tp 1 and, via the
layout-independent checkpoint, any layout), and converting back gives transformers the same model."""

from __future__ import annotations

import os
import re

import pytest
import torch
import transformers  # noqa: E402  (the test extra)

from megakernels_models import convert  # noqa: E402
from megakernels_models.cli import main  # noqa: E402
from megakernels_models.training import checkpoint  # noqa: E402


def _hf_gpt2(path, **kw):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=300, n_positions=24, bos_token_id=299, eos_token_id=299, **kw
    )
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in model.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return model


def _our_logits(ckpt_dir, ids):
    from megakernels_models.models.gpt.model import GPTModel

    meta, _ = convert.read_checkpoint(ckpt_dir)
    cfg = convert.ModelConfig.from_dict(meta["config"]).replace(dropout=0.0, attention_dropout=0.0)
    model = GPTModel(cfg, seed=0).eval()
    checkpoint.load(checkpoint.read_latest(ckpt_dir), [model], None, cfg)
    with torch.no_grad():
        return model(ids).transpose(0, 1)[..., : cfg.vocab_size]


def test_gpt2_round_trip_gives_the_same_logits(single_world, tmp_path):
    hf = _hf_gpt2(tmp_path / "hf")
    ids = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        ref = hf(ids).logits
    assert (
        main(["convert", "hf-to-megakernels", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "mk")]) == 0
    )
    torch.testing.assert_close(_our_logits(tmp_path / "mk", ids), ref, rtol=1e-4, atol=1e-4)
    assert (
        main(["convert", "megakernels-to-hf", "--input", str(tmp_path / "mk"), "--output", str(tmp_path / "back")]) == 0
    )
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_converted_checkpoint_trains_from_the_hf_weights(tmp_path, tp):
    """The trainer resumes from the converted GPT-2 (at tp 1, and tp 2 through the layout-free checkpoint): its
    first step's loss is transformers' loss on the same global batch, and training lowers it."""
    import dataclasses

    import torch.nn.functional as F

    from megakernels_models.arguments import TrainArgs, validate
    from megakernels_models.data.build import build_datasets
    from megakernels_models.data.datasets import collate
    from megakernels_models.training.train import run

    hf = _hf_gpt2(tmp_path / "hf")
    convert.hf_to_megakernels(str(tmp_path / "hf"), str(tmp_path / "mk"))
    args = TrainArgs(
        preset=None,
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        seq_length=24,
        vocab_size=300,
        steps=6,
        micro_batch_size=2,
        global_batch_size=4,
        eval_interval=0,
        progress=False,
        lr=1e-2,
        corpus_bytes=1 << 18,
        load=str(tmp_path / "mk"),
        dropout=0.0,
        tp=tp,
        nproc=tp,
    )
    cfg = validate(dataclasses.replace(args))
    batch = collate([build_datasets(args, cfg)[0][i] for i in range(4)])
    with torch.no_grad():
        logits = hf(batch["ids"]).logits
    expected = F.cross_entropy(logits.reshape(-1, 300), batch["labels"].reshape(-1)).item()
    losses = [r["loss"] for r in run(args)]
    assert losses[0] == pytest.approx(expected, rel=1e-5)
    assert losses[-1] < losses[0] - 0.05


def test_unconvertible_inputs_are_refused(tmp_path, capsys):
    _hf_gpt2(tmp_path / "erf", activation_function="gelu")
    assert (
        main(["convert", "hf-to-megakernels", "--input", str(tmp_path / "erf"), "--output", str(tmp_path / "o")]) == 2
    )
    assert "activation_function 'gelu'" in capsys.readouterr().err
    assert (
        main(["convert", "hf-to-megakernels", "--input", str(tmp_path / "none"), "--output", str(tmp_path / "o")]) == 2
    )
    assert "expected a HuggingFace model directory" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o" / "step-00000000")


def _hf_bert(path):
    torch.manual_seed(1)
    cfg = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=300,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = transformers.BertForPreTraining(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return model


def test_hf_bert_converts_exactly_to_post_norm_and_back(single_world, tmp_path):
    from megakernels_models.models.bert.model import BertModel

    hf = _hf_bert(tmp_path / "hf")
    ids = torch.randint(0, 300, (2, 16))
    types = (torch.arange(16) >= 9).long().expand(2, 16)
    keep = torch.ones(2, 16, dtype=torch.long)
    keep[1, 12:] = 0  # padding
    with torch.no_grad():
        ref = hf(input_ids=ids, token_type_ids=types, attention_mask=keep)
    assert (
        main(["convert", "hf-to-megakernels", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "mk")]) == 0
    )
    meta, _ = convert.read_checkpoint(str(tmp_path / "mk"))
    cfg = convert.ModelConfig.from_dict(meta["config"]).replace(dropout=0.0, attention_dropout=0.0)
    assert (cfg.norm_position, cfg.activation) == ("post", "gelu")
    model = BertModel(cfg, seed=0).eval()
    checkpoint.load(checkpoint.read_latest(str(tmp_path / "mk")), [model], None, cfg)
    with torch.no_grad():
        mlm, sop = model(ids, types, keep == 0)
    real = keep.bool()
    torch.testing.assert_close(mlm.transpose(0, 1)[..., :300][real], ref.prediction_logits[real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sop, ref.seq_relationship_logits, rtol=1e-4, atol=1e-4)
    assert (
        main(["convert", "megakernels-to-hf", "--input", str(tmp_path / "mk"), "--output", str(tmp_path / "back")]) == 0
    )
    back = transformers.BertForPreTraining.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        again = back(input_ids=ids, token_type_ids=types, attention_mask=keep)
    torch.testing.assert_close(again.prediction_logits, ref.prediction_logits, rtol=1e-5, atol=1e-5)


def test_a_pre_norm_bert_does_not_convert_to_hf(single_world, tmp_path, capsys):
    from megakernels_models.models.bert.model import BertModel

    cfg = convert.ModelConfig("bert", num_layers=1, hidden_size=16, num_heads=2, seq_length=8)
    model = BertModel(cfg, seed=0)
    tensors = {
        k: v.detach()[: cfg.vocab_size] if k in ("embedding.word.weight", "mlm_bias") else v.detach()
        for k, v in model.named_parameters()
    }
    convert.write_checkpoint(tensors, cfg, str(tmp_path / "mk"), "test")
    assert (
        main(["convert", "megakernels-to-hf", "--input", str(tmp_path / "mk"), "--output", str(tmp_path / "hf")]) == 2
    )
    assert "pre-norm" in capsys.readouterr().err


def test_an_untied_gpt2_keeps_its_own_head_both_ways(single_world, tmp_path):
    """``tie_word_embeddings=False``: the head is ``lm_head.weight``, not the word embedding (it was tied before,
    logits off by ~1)."""
    hf = _hf_gpt2(tmp_path / "hf", tie_word_embeddings=False)
    assert not torch.equal(hf.lm_head.weight, hf.transformer.wte.weight)
    ids = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        ref = hf(ids).logits
    convert.hf_to_megakernels(str(tmp_path / "hf"), str(tmp_path / "mk"))
    torch.testing.assert_close(_our_logits(tmp_path / "mk", ids), ref, rtol=1e-4, atol=1e-4)
    convert.megakernels_to_hf(str(tmp_path / "mk"), str(tmp_path / "back"))
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "back").eval()
    assert not back.config.tie_word_embeddings
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref, rtol=1e-5, atol=1e-5)


def _add_tensors(hf_dir, extra: dict):
    from safetensors.torch import load_file, save_file

    path = hf_dir / "model.safetensors"
    tensors = {**load_file(path), **extra}
    save_file(tensors, path, metadata={"format": "pt"})


def test_a_tensor_no_rule_maps_is_an_error_naming_it(tmp_path):
    _hf_gpt2(tmp_path / "hf")
    _add_tensors(tmp_path / "hf", {"transformer.h.0.adapter.weight": torch.zeros(3)})
    err = "1 input tensor(s) that no rule of this model maps: 'transformer.h.0.adapter.weight'"
    with pytest.raises(convert.ConversionError, match=re.escape(err)):
        convert.hf_to_megakernels(str(tmp_path / "hf"), str(tmp_path / "mk"))
    assert not (tmp_path / "mk" / "step-00000000").exists()


def test_documented_buffers_and_equal_tied_copies_are_accepted_and_a_differing_copy_refused(single_world, tmp_path):
    hf = _hf_gpt2(tmp_path / "hf")
    wte = hf.transformer.wte.weight.detach().clone()
    # an old checkpoint's causal-mask buffer and a stored copy of the tied head
    _add_tensors(tmp_path / "hf", {"transformer.h.1.attn.bias": torch.ones(1, 1, 24, 24), "lm_head.weight": wte})
    convert.hf_to_megakernels(str(tmp_path / "hf"), str(tmp_path / "ok"))
    _add_tensors(tmp_path / "hf", {"lm_head.weight": wte + 1})
    with pytest.raises(convert.ConversionError, match="'lm_head.weight' differs from 'transformer.wte.weight'"):
        convert.hf_to_megakernels(str(tmp_path / "hf"), str(tmp_path / "bad"))
