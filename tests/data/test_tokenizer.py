"""Tokenizers: one interface over byte, HuggingFace and SentencePiece; ids match the libraries used directly;
special ids found by spelling; a missing role or file is a clear error, raised only when needed."""

from __future__ import annotations

import numpy as np
import pytest

from megakernels_models.data.tokenizer import ByteTokenizer, build_tokenizer

TEXT = "naïve café\nsecond line\n"


def test_byte_tokenizer_ids_are_utf8_bytes():
    tok = build_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    np.testing.assert_array_equal(tok.encode(TEXT), list(TEXT.encode("utf-8")))
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert (tok.vocab_size, tok.eod, tok.pad, tok.cls, tok.sep, tok.mask, tok.newline) == (
        261,
        256,
        257,
        258,
        259,
        260,
        10,
    )


def test_hf_tokenizer_matches_the_library(hf_path):
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(hf_path)
    tok = build_tokenizer(f"hf:{hf_path}")
    np.testing.assert_array_equal(tok.encode(TEXT), ref.encode(TEXT, add_special_tokens=False).ids)
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert tok.vocab_size == ref.get_vocab_size() == 300
    assert [tok.eod, tok.pad, tok.cls, tok.sep, tok.mask] == [
        ref.token_to_id(t) for t in ("<|endoftext|>", "[PAD]", "[CLS]", "[SEP]", "[MASK]")
    ]
    assert tok.newline == ref.encode("\n").ids[0]
    assert set(range(5)) <= tok.special_ids


def test_hf_tokenizer_accepts_its_folder(hf_path):
    import os

    assert build_tokenizer("hf:" + os.path.dirname(hf_path)).vocab_size == 300


def test_spm_tokenizer_matches_the_library(spm_path):
    import sentencepiece as spm

    ref = spm.SentencePieceProcessor(model_file=spm_path)
    tok = build_tokenizer(f"spm:{spm_path}")
    np.testing.assert_array_equal(tok.encode(TEXT), ref.encode(TEXT))
    assert tok.decode(tok.encode("a lazy dog")) == "a lazy dog"
    assert tok.vocab_size == ref.get_piece_size()
    assert (tok.eod, tok.pad) == (ref.eos_id(), ref.pad_id())
    assert [tok.cls, tok.sep, tok.mask] == [ref.piece_to_id(p) for p in ("[CLS]", "[SEP]", "[MASK]")]
    assert tok.newline is None  # SentencePiece folds newlines into spaces
    assert ref.unk_id() in tok.special_ids and tok.mask in tok.special_ids


def test_missing_role_is_an_error_only_when_used(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel()
    t.train_from_iterator(
        ["plain text"], trainers.BpeTrainer(vocab_size=270, special_tokens=["<|endoftext|>"], show_progress=False)
    )
    t.save(str(tmp_path / "t.json"))
    tok = build_tokenizer(f"hf:{tmp_path / 't.json'}")
    assert tok.eod == 0 and tok.has("eod") and not tok.has("mask")
    with pytest.raises(ValueError, match=r"no cls, sep, mask, pad token, which BERT needs.*\[MASK\]"):
        tok.require("cls", "sep", "mask", "pad", use="BERT")
    with pytest.raises(ValueError, match="no mask token"):
        _ = tok.mask


@pytest.mark.parametrize("spec", ["hf:/no/such/tokenizer.json", "spm:/no/such/m.model"])
def test_missing_file_names_the_path(spec):
    with pytest.raises(FileNotFoundError, match="/no/such/"):
        build_tokenizer(spec)


@pytest.mark.parametrize("spec", ["gpt2", "hf:", "sentencepiece:x.model"])
def test_unknown_spec_lists_the_forms(spec):
    with pytest.raises(ValueError, match="expected byte, hf:PATH"):
        build_tokenizer(spec)


def test_unreadable_file_is_a_value_error(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read HuggingFace tokenizer"):
        build_tokenizer(f"hf:{bad}")
