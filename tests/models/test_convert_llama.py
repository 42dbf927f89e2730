"""HuggingFace Llama <-> megakernels: a randomly initialised small LlamaForCausalLM (built here, nothing downloaded;
grouped-query attention, rope theta 5000, untied and tied, saved as sharded safetensors) converts to a megakernels
checkpoint whose logits equal transformers' — also with the interleaved rotary layout, which permutes the query and
key rows — and back; its tokenizer travels with it; it trains at another layout starting from transformers' loss,
and `megakernels eval` scores it as transformers does."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
import transformers  # noqa: E402  (the test extra)

from megakernels_models import convert  # noqa: E402
from megakernels_models.cli import main  # noqa: E402
from megakernels_models.training import checkpoint  # noqa: E402

V, S = 300, 32


def _hf_llama(path, **kw):
    torch.manual_seed(0)
    fields = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        max_position_embeddings=S,
        rope_theta=5000.0,
        rms_norm_eps=1e-5,
    )
    cfg = transformers.LlamaConfig(**{**fields, **kw})
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="20KB")  # several shards + an index
    return model


def _our_logits(ckpt_dir, ids):
    from megakernels_models.models.llama.model import LlamaModel

    meta, _ = convert.read_checkpoint(str(ckpt_dir))
    cfg = convert.ModelConfig.from_dict(meta["config"])
    model = LlamaModel(cfg, seed=0).eval()
    checkpoint.load(checkpoint.read_latest(str(ckpt_dir)), [model], None, cfg)
    with torch.no_grad():
        return model(ids).transpose(0, 1)[..., : cfg.vocab_size], cfg


@pytest.mark.parametrize("tied", [False, True])
def test_llama_round_trip_gives_the_same_logits(single_world, tmp_path, tied):
    hf = _hf_llama(tmp_path / "hf", tie_word_embeddings=tied)
    assert os.path.exists(tmp_path / "hf" / "model.safetensors.index.json")
    ids = torch.randint(0, V, (2, S))
    with torch.no_grad():
        ref = hf(ids).logits
    assert (
        main(["convert", "hf-to-megakernels", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "mk")]) == 0
    )
    ours, cfg = _our_logits(tmp_path / "mk", ids)
    assert (cfg.num_kv_heads, cfg.rope_theta, cfg.tie_embeddings) == (2, 5000.0, tied)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    assert (
        main(["convert", "megakernels-to-hf", "--input", str(tmp_path / "mk"), "--output", str(tmp_path / "back")]) == 0
    )
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref, rtol=1e-5, atol=1e-5)


def test_the_interleaved_rotary_layout_permutes_query_and_key_rows(single_world, tmp_path):
    hf = _hf_llama(tmp_path / "hf")
    ids = torch.randint(0, V, (2, S))
    with torch.no_grad():
        ref = hf(ids).logits
    convert.hf_to_megakernels(str(tmp_path / "hf"), str(tmp_path / "mk"), rope_interleaved=True)
    _, plain = convert.read_checkpoint(str(tmp_path / "mk"))
    hf_q = hf.model.layers[0].self_attn.q_proj.weight.detach()
    assert not torch.equal(plain["layers.0.attention.q.weight"], hf_q)  # rows permuted...
    d = 8
    torch.testing.assert_close(plain["layers.0.attention.q.weight"][1], hf_q[d // 2])  # row 1 = HF row d/2
    ours, cfg = _our_logits(tmp_path / "mk", ids)
    assert cfg.rope_interleaved
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)  # ... and the model computes the same
    convert.megakernels_to_hf(str(tmp_path / "mk"), str(tmp_path / "back"))
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    torch.testing.assert_close(back.model.layers[0].self_attn.q_proj.weight, hf_q)


def _tokenizer_json(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<unk>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok.save(str(path))


def test_a_converted_llama_trains_at_tp2_and_evaluates_like_transformers(tmp_path, capsys):
    import dataclasses

    from megakernels_models.arguments import TrainArgs, validate
    from megakernels_models.data.build import build_datasets
    from megakernels_models.data.datasets import collate
    from megakernels_models.data.tokenizer import build_tokenizer
    from megakernels_models.training.train import run

    hf = _hf_llama(tmp_path / "hf")
    _tokenizer_json(tmp_path / "hf" / "tokenizer.json")
    convert.hf_to_megakernels(str(tmp_path / "hf"), str(tmp_path / "mk"))
    assert os.path.exists(tmp_path / "mk" / "tokenizer.json")  # the tokenizer travels with the checkpoint

    # eval: one window, so its loss is transformers' mean cross-entropy over the text's tokens
    text = "the lazy dog jumps over the quick brown fox"
    (tmp_path / "t.txt").write_text(text)
    assert main(["eval", "--load", str(tmp_path / "mk"), "--task", "ppl", "--data", str(tmp_path / "t.txt")]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ids = torch.as_tensor(build_tokenizer(f"hf:{tmp_path / 'mk' / 'tokenizer.json'}").encode(text), dtype=torch.long)
    with torch.no_grad():
        logits = hf(ids[None, :-1]).logits[0]
    assert res["loss"] == pytest.approx(F.cross_entropy(logits, ids[1:]).item(), rel=1e-5)
    assert res["ppl"] == pytest.approx(math.exp(res["loss"]), rel=1e-9)

    # training at tp 2 (the key/value heads split) starts from transformers' loss on the first global batch
    args = TrainArgs(
        model="llama",
        preset=None,
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        seq_length=S,
        vocab_size=V,
        ffn_hidden_size=48,
        rope_theta=5000.0,
        steps=4,
        lr=1e-2,
        micro_batch_size=2,
        global_batch_size=4,
        eval_interval=0,
        progress=False,
        corpus_bytes=1 << 18,
        load=str(tmp_path / "mk"),
        save=str(tmp_path / "tuned"),
        dropout=0.0,
        tp=2,
        nproc=2,
    )
    cfg = validate(dataclasses.replace(args))
    batch = collate([build_datasets(args, cfg)[0][i] for i in range(4)])
    with torch.no_grad():
        expected = F.cross_entropy(hf(batch["ids"]).logits.reshape(-1, V), batch["labels"].reshape(-1)).item()
    losses = [r["loss"] for r in run(args)]
    assert losses[0] == pytest.approx(expected, rel=1e-5)
    assert losses[-1] < losses[0]
    # the converted model's special tokens stay with the fine-tuned checkpoints
    assert json.loads((tmp_path / "tuned" / "generation_config.json").read_text()) == {
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_scaling of type 'dynamic'"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(attention_bias=True), "attention_bias=True with mlp_bias=False"),
    ],
)
def test_unconvertible_llamas_are_refused_naming_the_setting(tmp_path, capsys, change, message):
    _hf_llama(tmp_path / "hf", **change)
    assert main(["convert", "hf-to-megakernels", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err


def test_special_tokens_travel_both_ways_and_generation_stops_on_any_eos(single_world, tmp_path):
    """bos/eos/pad (several eos ids in generation_config.json, as Llama 3.1's instruction models have) go into the
    checkpoint's directory, back into the exported config.json and generation_config.json, and stop greedy
    generation as transformers' does."""
    from megakernels_models import load_pretrained
    from megakernels_models.inference.generate import generate

    _hf_llama(tmp_path / "hf", bos_token_id=1, eos_token_id=2, pad_token_id=0)
    prompt = torch.tensor([[5, 17, 42, 9]])
    lm = None
    convert.hf_to_megakernels(str(tmp_path / "hf"), str(tmp_path / "plain"))
    free = generate(load_pretrained(str(tmp_path / "plain")), prompt, max_new_tokens=8)[0, 4:].tolist()
    stop = [299, free[2]]  # the third generated token (and one never generated) end the text
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": stop}))
    convert.hf_to_megakernels(str(tmp_path / "hf"), str(tmp_path / "mk"))
    lm = load_pretrained(str(tmp_path / "mk"))
    assert lm.eos_token_ids == stop
    ours = generate(lm, prompt, max_new_tokens=8, eos_token_id=lm.eos_token_ids)[0].tolist()
    assert ours[4:] == free[: free.index(free[2]) + 1]

    convert.megakernels_to_hf(str(tmp_path / "mk"), str(tmp_path / "back"))
    back_cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (back_cfg["bos_token_id"], back_cfg["eos_token_id"], back_cfg["pad_token_id"]) == (1, stop, 0)
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "back").eos_token_id == stop
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        theirs = back.generate(prompt, max_new_tokens=8, do_sample=False)[0].tolist()
    assert theirs == ours


def test_load_pretrained_needs_no_tokenizer_for_logits(single_world, tmp_path):
    """A converted model whose vocabulary is below the byte tokenizer's 261 ids, without tokenizer.json, loads and
    gives transformers' logits (its tokenizer is None)."""
    from megakernels_models import load_pretrained

    hf = _hf_llama(tmp_path / "hf", vocab_size=100)
    convert.hf_to_megakernels(str(tmp_path / "hf"), str(tmp_path / "mk"))
    lm = load_pretrained(str(tmp_path / "mk"))
    assert lm.tokenizer is None
    ids = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(lm(ids), hf(ids).logits, rtol=1e-4, atol=1e-4)
    assert main(["generate", "--load", str(tmp_path / "mk"), "--prompt", "x"]) == 2


@pytest.mark.parametrize(
    "scaling",
    [
        # Llama 3.1's kind, at a small original context so that every regime (kept, blended, divided) is hit
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        {"rope_type": "linear", "factor": 4.0},
    ],
    ids=lambda s: s["rope_type"],
)
def test_rope_scaled_llamas_convert_both_ways_with_transformers_logits(single_world, tmp_path, scaling):
    hf = _hf_llama(tmp_path / "hf", rope_scaling=scaling)
    ids = torch.randint(0, V, (2, S))
    with torch.no_grad():
        ref = hf(ids).logits
    convert.hf_to_megakernels(str(tmp_path / "hf"), str(tmp_path / "mk"))
    ours, cfg = _our_logits(tmp_path / "mk", ids)
    assert (cfg.rope_scaling, cfg.rope_scaling_factor) == (scaling["rope_type"], scaling["factor"])
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    convert.megakernels_to_hf(str(tmp_path / "mk"), str(tmp_path / "back"))
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref, rtol=1e-5, atol=1e-5)
        # generation past the rotary table a scaled model starts with (its seq_length) rebuilds it larger
        from megakernels_models import load_pretrained
        from megakernels_models.inference.generate import generate

        lm = load_pretrained(str(tmp_path / "mk"))
        prompt = ids[:1, : S - 2]
        theirs = back.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert generate(lm, prompt, max_new_tokens=6).tolist() == theirs.tolist()


def test_fine_tuning_a_hf_checkpoint_is_one_command_and_exports_back(tmp_path, capsys):
    """The README's recipe: the example script's random Llama, `megakernels train --load-hf` at tp 2 (converted
    into --save as step 0, trained, saved), a relaunch that resumes instead of converting again, and the export
    that transformers loads with our logits."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    hf_dir, out = tmp_path / "hf", tmp_path / "tuned"
    subprocess.run([sys.executable, os.path.join(root, "examples", "make_small_hf_llama.py"), str(hf_dir)], check=True)
    common = ["--load-hf", str(hf_dir), "--save", str(out), "--micro-batch-size", "2", "--global-batch-size", "4"]
    common += ["--corpus-bytes", "262144", "--eval-interval", "0", "--no-progress", "--lr", "1e-2"]
    assert main(["train", *common, "--steps", "3", "--tp", "2", "--nproc", "2"]) == 0
    assert {"generation_config.json", "step-00000000", "step-00000003"} <= set(os.listdir(out))
    assert main(["train", *common, "--steps", "5"]) == 0  # resumes step 3 (any layout), no second conversion
    assert "step-00000005" in os.listdir(out)
    capsys.readouterr()
    assert main(["convert", "megakernels-to-hf", "--input", str(out), "--output", str(tmp_path / "back")]) == 0
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    ids = torch.randint(0, 300, (1, 16))
    from megakernels_models import load_pretrained
    from megakernels_models.inference.pretrained import release

    lm = load_pretrained(str(out))
    try:
        with torch.no_grad():
            torch.testing.assert_close(back(ids).logits, lm(ids), rtol=1e-4, atol=1e-4)
            original = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
            assert not torch.allclose(original(ids).logits, lm(ids), atol=1e-3)  # it was trained
    finally:
        release()  # the one-process world load_pretrained started (later tests make their own)


def test_mistral_with_its_sliding_window_converts_both_ways(single_world, tmp_path):
    """A window (8) shorter than the context (32): transformers' logits and greedy tokens, and back."""
    from megakernels_models import load_pretrained
    from megakernels_models.inference.generate import generate

    torch.manual_seed(0)
    cfg = transformers.MistralConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        max_position_embeddings=S,
        rms_norm_eps=1e-5,
        sliding_window=8,
    )
    hf = transformers.MistralForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ids = torch.randint(0, V, (2, S))
    with torch.no_grad():
        ref = hf(ids).logits
        full = transformers.MistralForCausalLM(transformers.MistralConfig(**{**cfg.to_dict(), "sliding_window": None}))
        full.load_state_dict(hf.state_dict())
        assert not torch.allclose(full.eval()(ids).logits, ref, atol=1e-3)  # the window changes the result
    convert.hf_to_megakernels(str(tmp_path / "hf"), str(tmp_path / "mk"))
    ours, mk = _our_logits(tmp_path / "mk", ids)
    assert mk.sliding_window == 8
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    prompt = ids[:1, :10]
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert generate(load_pretrained(str(tmp_path / "mk")), prompt, max_new_tokens=12).tolist() == theirs.tolist()
    convert.megakernels_to_hf(str(tmp_path / "mk"), str(tmp_path / "back"))
    back = transformers.MistralForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert back.config.sliding_window == 8
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref, rtol=1e-5, atol=1e-5)


def test_a_yarn_scaled_llama_exports_with_transformers_logits(single_world, tmp_path):
    """A megakernels Llama with YaRN scaling (its own frequencies and the attention factor on cos/sin) computes
    transformers' logits for the same weights under the exported configuration; the mscale ratio and an original
    context shorter than the sequence put every pair regime and a factor other than 1 in play."""
    from megakernels_models.convert import llama
    from megakernels_models.models.llama.model import LlamaModel

    _hf_llama(tmp_path / "hf")
    convert.hf_to_megakernels(str(tmp_path / "hf"), str(tmp_path / "mk"))
    meta, _ = convert.read_checkpoint(str(tmp_path / "mk"))
    yarn = dict(rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_max_positions=8, rope_truncate=False)
    plain = convert.ModelConfig.from_dict(meta["config"])
    cfg = plain.replace(**yarn, rope_mscale=1.0, rope_mscale_all_dim=0.5)
    model = LlamaModel(cfg, seed=0).eval()  # the rotary embedding has no weights: the checkpoint's load as they are
    checkpoint.load(checkpoint.read_latest(str(tmp_path / "mk")), [model], None, plain)
    theirs = transformers.LlamaConfig(**llama.config_to_theirs(cfg))
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", config=theirs).eval()
    assert hf.model.rotary_emb.attention_scaling == pytest.approx(cfg.rope_scaling_spec().attention_factor)
    assert hf.model.rotary_emb.attention_scaling != pytest.approx(1.0)
    ids = torch.randint(0, V, (2, S))
    with torch.no_grad():
        ours = model(ids).transpose(0, 1)[..., : cfg.vocab_size]
        torch.testing.assert_close(ours, hf(ids).logits, rtol=1e-4, atol=1e-4)
