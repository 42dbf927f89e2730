"""Generation from our own checkpoints: load_pretrained gives the single-process model of a checkpoint saved at any
layout; greedy decoding with the KV cache equals re-running the whole sequence at every step (GPT and Llama);
sampling follows temperature / top-k / top-p and its seed; `megakernels generate` streams the continuation."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from megakernels_models.arguments import TrainArgs
from megakernels_models.inference.generate import generate, sample_next
from megakernels_models.training.train import run

BASE = TrainArgs(
    preset=None,
    num_layers=2,
    hidden_size=32,
    num_heads=4,
    seq_length=32,
    steps=30,
    lr=1e-2,
    micro_batch_size=4,
    global_batch_size=8,
    eval_interval=0,
    progress=False,
    corpus_bytes=1 << 18,
    dropout=0.0,
)
FAMILIES = {"gpt": {}, "llama": dict(model="llama", num_kv_heads=2, ffn_hidden_size=48)}


@pytest.fixture(autouse=True)
def _release_the_world():
    """load_pretrained keeps a one-process world open; later tests start their own."""
    from megakernels_models.inference.pretrained import release

    yield
    release()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A GPT saved at tp 2 and a Llama saved at pp 2 (spawned worlds), 30 steps on the Python stdlib."""
    root = tmp_path_factory.mktemp("gen")
    out = {}
    for family, layout in (("gpt", dict(tp=2, nproc=2)), ("llama", dict(pp=2, nproc=2))):
        path = str(root / family)
        run(dataclasses.replace(BASE, **FAMILIES[family], **layout, save=path))
        out[family] = path
    return out


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_greedy_decoding_with_the_cache_equals_full_recompute(checkpoints, family):
    from megakernels_models import load_pretrained

    lm = load_pretrained(checkpoints[family])
    prompt = torch.as_tensor(lm.tokenizer.encode("def main():\n    "), dtype=torch.long)[None]
    out = generate(lm, prompt, max_new_tokens=12)
    ref = prompt
    for _ in range(12):
        nxt = lm(ref)[:, -1].argmax(-1)
        ref = torch.cat([ref, nxt[:, None]], 1)
    assert torch.equal(out, ref)
    # one cached step's logits equal the uncached forward's at that position
    from megakernels.nn import KVCache

    cache = KVCache()
    lm(prompt, kv_cache=cache)
    step = lm(ref[:, prompt.shape[1] : prompt.shape[1] + 1], kv_cache=cache)
    torch.testing.assert_close(step[:, 0], lm(ref[:, : prompt.shape[1] + 1])[:, -1], rtol=1e-5, atol=1e-5)


def test_the_model_is_the_checkpoints_at_any_layout(checkpoints):
    """load_pretrained's logits are the saved model's: the same loss as the trainer's last step would see."""
    from megakernels_models import load_pretrained

    lm = load_pretrained(checkpoints["gpt"])
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    logits = lm(ids)
    assert logits.shape == (2, 32, lm.config.vocab_size) and logits.dtype == torch.float32
    assert lm.config.num_layers == 2 and not lm.model.training


def test_sampling_rules():
    logits = torch.tensor([[0.0, 3.0, 2.0, -1.0]])
    assert sample_next(logits).item() == 1
    g = torch.Generator().manual_seed(0)
    assert all(sample_next(logits, 1.0, top_k=1, generator=g).item() == 1 for _ in range(20))
    picks = {sample_next(logits, 1.0, top_k=2, generator=g).item() for _ in range(200)}
    assert picks == {1, 2}
    # top_p 0.5: token 1 alone has p ≈ 0.70 >= 0.5, so it is the nucleus
    assert all(sample_next(logits, 1.0, top_p=0.5, generator=g).item() == 1 for _ in range(20))
    a = [sample_next(logits, 2.0, generator=torch.Generator().manual_seed(5)).item() for _ in range(1)]
    b = [sample_next(logits, 2.0, generator=torch.Generator().manual_seed(5)).item() for _ in range(1)]
    assert a == b
    with pytest.raises(ValueError, match="top_p must be in"):
        generate(None, torch.zeros(1, 1, dtype=torch.long), top_p=0.0)


def test_seeded_sampling_is_reproducible_and_learned_positions_stop_at_seq_length(checkpoints):
    from megakernels_models import load_pretrained

    lm = load_pretrained(checkpoints["gpt"])
    prompt = torch.as_tensor(lm.tokenizer.encode("import "), dtype=torch.long)[None]
    a = generate(lm, prompt, max_new_tokens=10, temperature=0.9, top_k=20, seed=3)
    b = generate(lm, prompt, max_new_tokens=10, temperature=0.9, top_k=20, seed=3)
    assert torch.equal(a, b)
    long = generate(lm, prompt, max_new_tokens=100)
    assert long.shape[1] == lm.config.seq_length  # 32 learned positions


def test_the_cli_streams_the_continuation(checkpoints):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "megakernels_models.cli",
            "generate",
            "--load",
            checkpoints["llama"],
            "--prompt",
            "class ",
            "--max-new-tokens",
            "10",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("class ") and len(r.stdout.rstrip("\n")) > len("class ")
    bad = subprocess.run(
        [sys.executable, "-m", "megakernels_models.cli", "generate", "--load", "/nonexistent", "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "no such directory" in bad.stderr


def test_a_run_with_a_hf_tokenizer_keeps_it_beside_its_checkpoints(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from megakernels.parallel.launch import single_process_world
    from megakernels_models import load_pretrained
    from megakernels_models.data.preprocess import preprocess
    from megakernels_models.training.train import train

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(
        ["alpha beta gamma delta\n"] * 50,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<unk>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "docs.txt").write_text("alpha beta gamma delta " * 400)
    preprocess([str(tmp_path / "docs.txt")], str(tmp_path / "data"), f"hf:{tmp_path / 'tok.json'}")
    args = dataclasses.replace(
        BASE,
        steps=2,
        data=str(tmp_path / "data"),
        tokenizer=f"hf:{tmp_path / 'tok.json'}",
        save=str(tmp_path / "ckpt"),
        split="1,0,0",
    )
    with single_process_world():
        train(args)
    assert (tmp_path / "ckpt" / "tokenizer.json").read_text() == (tmp_path / "tok.json").read_text()
    assert load_pretrained(str(tmp_path / "ckpt")).tokenizer.vocab_size == tok.get_vocab_size()
