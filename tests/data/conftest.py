"""Fixtures of the data tests: a small corpus, tiny tokenizers trained here with the libraries themselves (nothing
is downloaded), and a private cache folder."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest

SPECIALS = ["<|endoftext|>", "[PAD]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = (
    "the quick brown fox jumps over a lazy dog while naïve cafés serve crème brûlée to 42 tired "
    "programmers who write kernels in C++ and Python; every tensor has a shape, a dtype and a device"
).split()


def make_documents(n: int = 12, seed: int = 0) -> list[str]:
    """``n`` multi-line documents of varied length (with non-ASCII text)."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        lines = [" ".join(rng.choice(WORDS, int(rng.integers(3, 12)))) + "." for _ in range(int(rng.integers(2, 9)))]
        docs.append("\n".join(lines) + "\n")
    return docs


@pytest.fixture(scope="session")
def documents() -> list[str]:
    return make_documents()


@pytest.fixture(scope="session")
def hf_path(tmp_path_factory, documents) -> str:
    """A byte-level BPE ``tokenizer.json`` of 300 ids trained on the documents with the ``tokenizers`` library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(documents, trainer)
    path = str(tmp_path_factory.mktemp("hf") / "tokenizer.json")
    tok.save(path)
    return path


@pytest.fixture(scope="session")
def spm_path(tmp_path_factory, documents) -> str:
    """A SentencePiece BPE model of 120 ids (with [CLS] [SEP] [MASK] and a pad id) trained on the documents."""
    import sentencepiece as spm

    folder = tmp_path_factory.mktemp("spm")
    text = folder / "train.txt"
    text.write_text("".join(documents * 3), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(folder / "m"),
        vocab_size=120,
        model_type="bpe",
        pad_id=3,
        user_defined_symbols=["[CLS]", "[SEP]", "[MASK]"],
        minloglevel=2,
        hard_vocab_limit=False,
    )
    return str(folder / "m.model")


def write_inputs(folder, documents: list[str], fmt: str) -> list[str]:
    """The documents as input files of format ``txt`` (one file each), ``jsonl`` or ``gz`` (gzipped JSONL and text)."""
    os.makedirs(folder, exist_ok=True)
    if fmt == "txt":
        paths = []
        for i, d in enumerate(documents):
            p = os.path.join(folder, f"doc{i:03d}.txt")
            with open(p, "w", encoding="utf-8") as f:
                f.write(d)
            paths.append(p)
        return paths
    lines = "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(documents))
    if fmt == "jsonl":
        p = os.path.join(folder, "docs.jsonl")
        with open(p, "w", encoding="utf-8") as f:
            f.write(lines)
        return [p]
    half = len(documents) // 2
    p1 = os.path.join(folder, "a.jsonl.gz")
    with gzip.open(p1, "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in documents[:half]))
    paths = [p1]
    for i, d in enumerate(documents[half:]):
        p = os.path.join(folder, f"b{i:03d}.txt.gz")
        with gzip.open(p, "wt", encoding="utf-8") as f:
            f.write(d)
        paths.append(p)
    return paths


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Every test gets its own default-corpus cache folder."""
    monkeypatch.setenv("MEGAKERNELS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"
