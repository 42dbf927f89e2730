"""The trainer's entry point: the default corpus is preprocessed into the cache once (safely under concurrent
ranks) and read like any data; ``--data`` prefixes and blends build (train, valid, test); bad data flags are
ArgumentErrors naming the flag."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os

import numpy as np
import pytest

from megakernels.parallel.launch import single_process_world
from megakernels_models.arguments import ArgumentError, TrainArgs
from megakernels_models.data import corpus
from megakernels_models.data.blending import BlendedDataset
from megakernels_models.data.build import build_datasets, tokenizer_for, validate_data_args
from megakernels_models.data.datasets import BertDataset, GPTDataset
from megakernels_models.data.indexed import IndexedDataset
from megakernels_models.data.preprocess import preprocess
from tests.data.conftest import make_documents, write_inputs

ARGS = TrainArgs(
    preset=None,
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    seq_length=32,
    steps=4,
    global_batch_size=8,
    micro_batch_size=4,
    eval_steps=2,
    corpus_bytes=1 << 17,
    seed=3,
    progress=False,
)


def args_cfg(**changes):
    a = dataclasses.replace(ARGS, **changes)
    return a, a.model_config()


# ---- the default corpus ----------------------------------------------------------------------------------------


def test_stdlib_cache_is_built_once_and_reused(private_cache, monkeypatch):
    prefix = corpus.stdlib_prefix(1 << 17)
    assert prefix.startswith(str(private_cache))
    ds = IndexedDataset(prefix)
    ref = corpus.stdlib_documents(1 << 17)
    assert len(ds) == len(ref)
    for i in (0, len(ds) - 1):
        assert ds[i].tolist() == ref[i].tolist() + [256]  # the file's bytes, then EOD
    with open(corpus.stdlib_files()[0], "rb") as f:
        assert bytes(ds[0][:-1].astype(np.uint8)) == f.read()

    def no_rebuild(*a, **k):
        raise AssertionError("the cache was rebuilt")

    monkeypatch.setattr(corpus, "IndexedDatasetWriter", no_rebuild)
    assert corpus.stdlib_prefix(1 << 17) == prefix
    assert os.listdir(private_cache) == [os.path.basename(os.path.dirname(prefix))]


def test_losing_the_race_reads_the_winners_cache(private_cache, monkeypatch):
    prefix = corpus.stdlib_prefix(1 << 16)
    before = os.stat(prefix + ".bin").st_ino
    monkeypatch.setattr(corpus, "_published", lambda entry: False)  # as if another rank finished meanwhile
    assert corpus.stdlib_prefix(1 << 16) == prefix
    assert os.stat(prefix + ".bin").st_ino == before
    assert os.listdir(private_cache) == [os.path.basename(os.path.dirname(prefix))]  # our copy was discarded


def _build_in_child(root):
    return corpus.stdlib_prefix(1 << 17, root=root)


def test_concurrent_ranks_build_one_valid_cache(tmp_path):
    root = str(tmp_path / "shared")
    with multiprocessing.get_context("fork").Pool(3) as pool:
        prefixes = pool.map(_build_in_child, [root] * 3)
    assert len(set(prefixes)) == 1 and len(IndexedDataset(prefixes[0])) > 0
    assert os.listdir(root) == [os.path.basename(os.path.dirname(prefixes[0]))]


def test_default_corpus_builds_three_splits_and_caches_the_index(private_cache):
    a, cfg = args_cfg(split="8,1,1")
    train, valid, test = build_datasets(a, cfg)
    assert all(isinstance(d, GPTDataset) for d in (train, valid, test))
    assert train.data.prefix.startswith(str(private_cache)) and not train.from_cache
    assert train.num_samples == a.steps * a.global_batch_size + 1
    assert train.documents.stop == valid.documents.start and valid.documents.stop == test.documents.start
    again = build_datasets(a, cfg)
    assert again[0].from_cache and again[1].from_cache
    assert all(np.array_equal(train[i]["ids"], again[0][i]["ids"]) for i in range(32))
    bert = build_datasets(*args_cfg(model="bert", seq_length=64))[0]
    assert isinstance(bert, BertDataset) and bert[0]["ids"].shape == (64,)


def test_empty_split_is_none(tmp_path):
    write_inputs(tmp_path / "in", make_documents(30), "txt")
    preprocess([str(tmp_path / "in")], str(tmp_path / "d"), append_eod=True)
    a, cfg = args_cfg(data=str(tmp_path / "d"), split="9,1,0", seq_length=16)
    validate_data_args(a, cfg)
    train, valid, test = build_datasets(a, cfg)
    assert isinstance(train, GPTDataset) and isinstance(valid, GPTDataset) and test is None
    assert (len(train.documents), len(valid.documents)) == (27, 3)


def test_blend_of_two_prefixes(tmp_path):
    for name, seed in (("a", 1), ("b", 2)):
        write_inputs(tmp_path / name, make_documents(20, seed), "jsonl")
        preprocess([str(tmp_path / name)], str(tmp_path / name / "d"), append_eod=True)
    spec = f"0.7,{tmp_path / 'a' / 'd'},0.3,{tmp_path / 'b' / 'd'}"
    a, cfg = args_cfg(data=spec, split="90,10,0", seq_length=16)
    validate_data_args(a, cfg)
    train, valid, test = build_datasets(a, cfg)
    assert isinstance(train, BlendedDataset) and isinstance(valid, BlendedDataset) and test is None
    comps = [train.locate(i)[0] for i in range(100)]
    assert abs(comps.count(0) - 70) <= 1
    assert train[5]["ids"].tolist() == build_datasets(a, cfg)[0][5]["ids"].tolist()


def test_tokenizer_for(hf_path):
    assert tokenizer_for(args_cfg()[0]).name == "byte"
    assert tokenizer_for(args_cfg(tokenizer=f"hf:{hf_path}")[0]).vocab_size == 300


# ---- validation ------------------------------------------------------------------------------------------------


@pytest.fixture
def prefix(tmp_path):
    write_inputs(tmp_path / "in", make_documents(20), "txt")
    preprocess([str(tmp_path / "in")], str(tmp_path / "d"), append_eod=True)
    return str(tmp_path / "d")


def _error(**changes) -> str:
    a, cfg = args_cfg(**changes)
    with pytest.raises(ArgumentError) as e:
        validate_data_args(a, cfg)
    return str(e.value)


def test_valid_arguments_pass(prefix):
    validate_data_args(*args_cfg())
    validate_data_args(args_cfg(data=prefix)[0])  # the model configuration from the arguments
    validate_data_args(*args_cfg(data=prefix))
    validate_data_args(*args_cfg(data=f"1,{prefix},2,{prefix}"))


def test_missing_prefix(tmp_path):
    msg = _error(data=str(tmp_path / "nope"))
    assert msg.startswith("--data ") and "nope.bin" in msg and "megakernels preprocess" in msg


def test_missing_idx(prefix):
    os.remove(prefix + ".idx")
    assert "d.idx" in _error(data=f"0.5,{prefix},0.5,{prefix}")


def test_corrupt_prefix(prefix):
    with open(prefix + ".idx", "r+b") as f:
        f.write(b"XXXXXXXX")
    assert _error(data=prefix).startswith(f"--data {prefix}: {prefix}.idx: wrong magic")


@pytest.mark.parametrize("spec", ["0.7,a,0.3", "x,a", "-1,a"])
def test_bad_blend(spec):
    assert _error(data=spec).startswith("--data")


def test_unknown_tokenizer():
    assert _error(tokenizer="gpt2").startswith("--tokenizer gpt2: unknown tokenizer")


def test_missing_tokenizer_file():
    assert "/no/such.json" in _error(tokenizer="hf:/no/such.json")


def test_tokenizer_larger_than_the_model_vocab(hf_path, prefix):
    msg = _error(tokenizer=f"hf:{hf_path}", vocab_size=280, data=prefix)
    assert msg.startswith("--tokenizer") and "300 ids" in msg and "280" in msg


def test_default_corpus_needs_the_byte_tokenizer(hf_path):
    assert "default corpus" in _error(tokenizer=f"hf:{hf_path}", vocab_size=512)


def test_data_from_another_tokenizer(hf_path, prefix):
    msg = _error(tokenizer=f"hf:{hf_path}", vocab_size=512, data=prefix)
    assert "vocabulary of 261 ids" in msg and "300" in msg


def test_bert_tokenizer_needs_mask(tmp_path, prefix):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel()
    t.train_from_iterator(
        ["x"], trainers.BpeTrainer(vocab_size=261, special_tokens=["<|endoftext|>"], show_progress=False)
    )
    t.save(str(tmp_path / "t.json"))
    msg = _error(tokenizer=f"hf:{tmp_path / 't.json'}", model="bert", vocab_size=512, data=prefix)
    assert msg.startswith("--tokenizer") and "cls, sep, mask, pad" in msg


def test_bert_spm_data_needs_split_sentences(tmp_path, spm_path):
    write_inputs(tmp_path / "in", make_documents(10), "txt")
    preprocess([str(tmp_path / "in")], str(tmp_path / "s"), f"spm:{spm_path}", append_eod=True)
    assert "--split-sentences" in _error(tokenizer=f"spm:{spm_path}", model="bert", data=str(tmp_path / "s"))


def test_training_split_too_small(prefix):
    assert "fewer than one sample" in _error(data=prefix, seq_length=4096)
    assert "no training documents" in _error(data=prefix, split="1,1000,0")


def test_bad_split():
    assert _error(split="1,2").startswith("--split")


# ---- in the trainer --------------------------------------------------------------------------------------------


def test_trainer_reads_the_pipelines_global_batches():
    """The trainer's first loss is the seed's model on global batch 0 of the pipeline's training split, and its
    validation loss (no training: lr 0) the same model on the first batches of the validation split."""
    import torch

    from megakernels_models.data.datasets import collate
    from megakernels_models.models.gpt.model import GPTModel
    from megakernels_models.training import train as train_mod

    args = dataclasses.replace(ARGS, steps=2, eval_interval=2, dropout=0.0, lr=0.0, min_lr=0.0)
    cfg = args.model_config()
    train_ds, valid_ds, _ = build_datasets(args, cfg)
    with single_process_world():
        recs = train_mod.train(args)
    with single_process_world(parallel=True), torch.no_grad():
        model = GPTModel(cfg, seed=args.seed)

        def mean_loss(ds, first):
            b = collate([ds[i] for i in range(first, first + args.global_batch_size)])
            return model(b["ids"], labels=b["labels"]).mean().item()

        assert recs[0]["loss"] == pytest.approx(mean_loss(train_ds, 0), rel=1e-5)
        val = sum(mean_loss(valid_ds, s * args.global_batch_size) for s in range(args.eval_steps)) / args.eval_steps
        assert recs[-1]["val_loss"] == pytest.approx(val, rel=1e-5)


# ---- document boundaries and the trainer's switches -------------------------------------------------------------


def with_attrs(a, **attrs):
    """``a`` with attributes the trainer's arguments may not declare yet (read by build through getattr)."""
    for k, v in attrs.items():
        setattr(a, k, v)
    return a


@pytest.mark.parametrize(
    "attrs, keys",
    [
        ({}, set()),
        ({"document_masking": True}, {"positions", "documents"}),
        ({"reset_position_ids": True}, {"positions"}),
        ({"reset_attention_mask": True}, {"documents"}),
        ({"eod_mask_loss": True}, set()),
    ],
)
def test_build_reads_the_document_switches(prefix, attrs, keys):
    a, cfg = args_cfg(data=prefix, split="1,0,0", seq_length=16, eval_interval=0)
    with_attrs(a, **attrs)
    validate_data_args(a, cfg)
    train = build_datasets(a, cfg)[0]
    plain = build_datasets(*args_cfg(data=prefix, split="1,0,0", seq_length=16))[0]
    masked = attrs.get("document_masking") or attrs.get("eod_mask_loss")
    eods = 0
    for i in range(len(train)):
        s, p = train[i], plain[i]
        assert set(s) == {"ids", "labels"} | keys
        np.testing.assert_array_equal(s["ids"], p["ids"])
        at_eod = p["ids"] == 256  # the byte tokenizer's EOD, which preprocess --append-eod wrote
        eods += int(at_eod.sum())
        want = np.where(at_eod, -100, p["labels"]) if masked else p["labels"]
        np.testing.assert_array_equal(s["labels"], want)
        if "documents" in keys:
            assert s["documents"].tolist() == np.concatenate([[0], np.cumsum(at_eod[:-1])]).tolist()
    assert eods > 0


def test_document_switches_need_an_eod_token_and_a_causal_model(tmp_path, prefix):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel()
    t.train_from_iterator(["x"], trainers.BpeTrainer(vocab_size=261, special_tokens=["[PAD]"], show_progress=False))
    t.save(str(tmp_path / "t.json"))
    a, cfg = args_cfg(tokenizer=f"hf:{tmp_path / 't.json'}", data=prefix)
    with pytest.raises(ArgumentError, match="no eod token, which --eod-mask-loss needs"):
        validate_data_args(with_attrs(a, eod_mask_loss=True), cfg)
    a, cfg = args_cfg(model="bert", seq_length=64)
    with pytest.raises(
        ArgumentError, match="--reset-position-ids/--reset-attention-mask/--eod-mask-loss: --model bert"
    ):
        validate_data_args(with_attrs(a, document_masking=True), cfg)


# ---- supervised fine-tuning --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_prefix(tmp_path_factory):
    from megakernels_models.data import chat
    from tests.data.test_chat import EXAMPLE, texts

    folder = tmp_path_factory.mktemp("sft")
    tok = chat.write_small_tokenizer(str(folder / "tok"), texts(), 400)
    chat.preprocess_chat([EXAMPLE], str(folder / "chat"), tok)
    return str(folder / "chat"), tok


def sft_args(data, tok, **attrs):
    a, cfg = args_cfg(data=data, tokenizer=f"hf:{tok}", vocab_size=512, seq_length=160, split="8,2,0")
    return with_attrs(a, **attrs), cfg


@pytest.mark.parametrize("packed", [True, False])
def test_sft_builds_sft_datasets(chat_prefix, packed):
    from megakernels_models.data.sft import SFTDataset

    prefix, tok = chat_prefix
    a, cfg = sft_args(prefix, tok, sft=True, sft_packing=packed)
    validate_data_args(a, cfg)
    train, valid, test = build_datasets(a, cfg)
    assert isinstance(train, SFTDataset) and isinstance(valid, SFTDataset) and test is None
    assert train.packed == packed and train.seq_length == 160
    assert train.documents == range(0, 34) and valid.documents == range(34, 42)
    seen = sorted(c for i in range(len(train)) for c in train.conversations(i))
    assert seen == list(range(34))
    s = train[0]
    assert set(s) == {"ids", "labels", "positions", "documents"} and s["ids"].shape == (160,)
    from megakernels_models.data.tokenizer import build_tokenizer

    pad = build_tokenizer(f"hf:{tok}").pad
    assert (s["ids"][s["documents"] == len(train.conversations(0))] == pad).all()


def test_sft_and_chat_data_go_together(chat_prefix, prefix):
    chat_data, tok = chat_prefix
    a, cfg = sft_args(chat_data, tok)
    with pytest.raises(ArgumentError, match=f"--data {chat_data} holds chat conversations .* train it with --sft"):
        validate_data_args(a, cfg)
    with pytest.raises(ArgumentError, match="train it with --sft"):
        build_datasets(a, cfg)
    a, cfg = args_cfg(data=prefix)
    with pytest.raises(ArgumentError, match=f"--sft: --data {prefix} is not chat data .* preprocess --chat"):
        validate_data_args(with_attrs(a, sft=True), cfg)
    with pytest.raises(ArgumentError, match="is not chat data"):
        build_datasets(a, cfg)
    a, cfg = args_cfg()
    with pytest.raises(ArgumentError, match="--sft trains on chat data: give --data PREFIX"):
        validate_data_args(with_attrs(a, sft=True), cfg)
    a, cfg = args_cfg(model="bert", seq_length=64)
    with pytest.raises(ArgumentError, match="--sft: --model bert does not train on token sequences"):
        validate_data_args(with_attrs(a, sft=True), cfg)


def test_sft_with_a_missing_mask(chat_prefix, tmp_path):
    import shutil

    prefix, tok = chat_prefix
    copy = str(tmp_path / "c")
    for ext in (".bin", ".idx", ".chat.json"):
        shutil.copy(prefix + ext, copy + ext)
    with pytest.raises(ArgumentError, match=f"--data {copy}: indexed dataset file not found: {copy}.mask.idx"):
        validate_data_args(*sft_args(copy, tok, sft=True))
