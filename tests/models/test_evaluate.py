"""``megakernels eval`` on hand-checkable cases: a GPT whose weights are all zero predicts the uniform distribution
over its 261 byte ids, so its perplexity is exactly 261 per token (and 261^(tokens/words) per word), and its
argmax is always id 0, so a LAMBADA passage is right exactly when its last word is NUL bytes."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megakernels.parallel.launch import single_process_world
from megakernels_models.cli import main
from megakernels_models.convert import write_checkpoint
from megakernels_models.models.config import ModelConfig

CFG = ModelConfig(
    "gpt", num_layers=1, hidden_size=16, num_heads=2, seq_length=8, vocab_size=261, dropout=0.0, attention_dropout=0.0
)


@pytest.fixture
def zero_model(tmp_path):
    from megakernels_models.models.gpt.model import GPTModel

    with single_process_world(parallel=True):
        model = GPTModel(CFG, seed=0)
        tensors = {
            k: torch.zeros_like(v)[:261] if k == "embedding.word.weight" else torch.zeros_like(v)
            for k, v in model.named_parameters()
        }
    return write_checkpoint(tensors, CFG, str(tmp_path / "zero"), "test")


@pytest.mark.parametrize("stride", [None, 3])
def test_uniform_model_perplexity_is_the_vocabulary(zero_model, tmp_path, capsys, stride):
    text = "the quick brown fox jumps over the lazy dog " * 3
    (tmp_path / "wiki.txt").write_text(text)
    args = ["eval", "--load", zero_model, "--task", "ppl", "--data", str(tmp_path / "wiki.txt")]
    assert main(args + (["--stride", str(stride)] if stride else [])) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    tokens = len(text.encode()) - 1  # every byte but the first is scored once
    assert res["tokens"] == tokens
    assert res["ppl"] == pytest.approx(261.0, rel=1e-5)
    assert res["word_ppl"] == pytest.approx(math.exp(tokens * math.log(261) / len(text.split())), rel=1e-5)


def test_lambada_cli_runs(zero_model, tmp_path, capsys):
    passages = [{"text": "a story that ends in words"}, {"text": "another one x"}]
    (tmp_path / "l.jsonl").write_text("\n".join(json.dumps(p) for p in passages))
    assert main(["eval", "--load", zero_model, "--task", "lambada", "--data", str(tmp_path / "l.jsonl")]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # The uniform model's argmax is id 0 (NUL) everywhere: no target (which starts with its space) is right.
    assert res == {"accuracy": 0.0, "correct": 0, "passages": 2}


class _NextLetter(torch.nn.Module):
    """A hand-made 'model': after byte c it predicts c + 1 for a..y, a space after z, and 'a' after a space."""

    def forward(self, ids):
        nxt = torch.where((ids >= 97) & (ids < 122), ids + 1, torch.where(ids == 122, 32, 97))
        return (torch.nn.functional.one_hot(nxt, 261).float() * 10).transpose(0, 1)  # [s, b, V]


def test_lambada_needs_every_token_of_the_last_word():
    from megakernels_models.data.tokenizer import ByteTokenizer
    from megakernels_models.inference.evaluate import lambada_accuracy

    passages = [
        "wxyz abc",  # z -> ' ', ' ' -> a, a -> b, b -> c: right
        "wxyz abd",  # the last token is wrong: the word is wrong
        "wxyq abc",  # the space after q is wrong
        "uvwxyz a",
    ]  # a one-letter word: right
    res = lambada_accuracy(_NextLetter(), ByteTokenizer(), passages, seq_length=16, vocab=261)
    assert res == {"accuracy": 0.5, "correct": 2, "passages": 4}


def test_eval_errors(tmp_path, capsys):
    assert main(["eval", "--load", str(tmp_path / "nope"), "--task", "ppl", "--data", str(tmp_path / "x")]) == 2
    assert "error" in capsys.readouterr().err
