"""GPT and BERT samples over an indexed dataset: windows cross document boundaries with EOD, every epoch covers the
split's tokens once, the order is deterministic and independent of data parallelism, the sample index is cached
beside the data and rebuilt when missing, splits are disjoint, BERT masks 15 % (80/10/10) with balanced SOP."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest

from megakernels_models.data.datasets import BertDataset, GPTDataset, global_batch_indices, split_documents
from megakernels_models.data.indexed import IndexedDataset, IndexedDatasetWriter
from megakernels_models.data.tokenizer import ByteTokenizer

EOD = 1


def labelled_data(prefix, num_docs=40, seed=0) -> IndexedDataset:
    """Document ``d`` is ``size_d`` copies of the id ``1000 + d`` and then EOD: every token names its document."""
    sizes = np.random.default_rng(seed).integers(1, 30, num_docs)
    with IndexedDatasetWriter(str(prefix), 100_000) as w:
        for d, n in enumerate(sizes):
            w.add_document([np.append(np.full(n, 1000 + d), EOD)])
        w.finish()
    return IndexedDataset(str(prefix))


def docs_of(tokens) -> set[int]:
    return {int(t) - 1000 for t in tokens if t != EOD}


def test_epoch_windows_tile_the_shuffled_documents(tmp_path):
    data = labelled_data(tmp_path / "d")
    ds = GPTDataset(data, 16, seed=5, documents=range(5, 35))
    order = np.asarray(ds._idx["doc_idx"][0])
    assert sorted(order.tolist()) == list(range(5, 35))
    stream = np.concatenate([data[int(d)] for d in order])  # the reference: this epoch's documents end to end
    assert len(ds) == (len(stream) - 1) // 16
    windows = sorted(ds.window(i).tolist() for i in range(len(ds)))
    assert windows == sorted(stream[w * 16 : w * 16 + 17].tolist() for w in range(len(ds)))
    sample = ds[0]
    assert sample["ids"].dtype == np.int64 and sample["ids"].shape == (16,)
    np.testing.assert_array_equal(sample["labels"][:-1], sample["ids"][1:])


def test_windows_cross_document_boundaries_with_eod(tmp_path):
    ds = GPTDataset(labelled_data(tmp_path / "d"), 32, seed=0)
    crossing = 0
    for i in range(len(ds)):
        w = ds.window(i)
        if len(docs_of(w)) > 1:
            crossing += 1
            change = np.flatnonzero((w[1:] != w[:-1]) & (w[1:] != EOD) & (w[:-1] != EOD))
            assert len(change) == 0  # documents always meet through an EOD
            assert EOD in w
    assert crossing > len(ds) // 2


def test_order_is_deterministic_and_new_each_epoch(tmp_path):
    data = labelled_data(tmp_path / "d")
    a = GPTDataset(data, 8, seed=3)
    b = GPTDataset(IndexedDataset(str(tmp_path / "d")), 8, seed=3)
    n = len(a)
    assert all(np.array_equal(a.window(i), b.window(i)) for i in range(3 * n))
    first = [a.window(i).tolist() for i in range(n)]
    second = [a.window(n + i).tolist() for i in range(n)]
    assert first != second
    c = GPTDataset(data, 8, seed=4)
    assert [c.window(i).tolist() for i in range(n)] != first


def test_samples_do_not_depend_on_num_samples(tmp_path):
    data = labelled_data(tmp_path / "d")
    short = GPTDataset(data, 8, seed=3, num_samples=5)
    long = GPTDataset(data, 8, seed=3, num_samples=10 * len(short))
    assert short._cached_epochs == 1 and long._cached_epochs == 10
    for i in list(range(0, 10 * len(short), 7)):
        np.testing.assert_array_equal(short.window(i), long.window(i))


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_global_batches_do_not_depend_on_dp(tmp_path, dp):
    ds = GPTDataset(labelled_data(tmp_path / "d"), 8, seed=1)
    ref = [ds[i]["ids"].tolist() for i in range(5 * 8)]
    got = []
    for step in range(5):
        for rank in range(dp):
            got.extend(ds[i]["ids"].tolist() for i in global_batch_indices(step, 8, rank, dp))
    assert got == ref


def test_sample_index_is_cached_and_rebuilt_when_deleted(tmp_path):
    data = labelled_data(tmp_path / "d")
    first = GPTDataset(data, 8, seed=2, documents=range(0, 30), num_samples=100)
    files = sorted(glob.glob(str(tmp_path / "d.gpt-*.npy")))
    assert not first.from_cache and len(files) == 3
    assert {os.path.basename(f).split(".")[-2] for f in files} == {"doc_idx", "sample_idx", "shuffle_idx"}
    again = GPTDataset(data, 8, seed=2, documents=range(0, 30), num_samples=100)
    assert again.from_cache
    assert all(np.array_equal(first.window(i), again.window(i)) for i in range(200))
    os.remove(files[1])
    with open(files[2], "wb") as f:
        f.write(b"garbage")
    rebuilt = GPTDataset(data, 8, seed=2, documents=range(0, 30), num_samples=100)
    assert not rebuilt.from_cache and sorted(glob.glob(str(tmp_path / "d.gpt-*.npy"))) == files
    assert all(np.array_equal(first.window(i), rebuilt.window(i)) for i in range(200))
    other = GPTDataset(data, 8, seed=2, documents=range(0, 31), num_samples=100)  # another split: another index
    assert not other.from_cache and len(glob.glob(str(tmp_path / "d.gpt-*.npy"))) == 6


def test_splits_are_disjoint_and_samples_stay_inside_their_split(tmp_path):
    data = labelled_data(tmp_path / "d", num_docs=200)
    splits = split_documents(len(data), (8, 1, 1))
    assert [len(r) for r in splits] == [160, 20, 20]
    assert set(splits[0]).isdisjoint(splits[1]) and set(splits[1]).isdisjoint(splits[2])
    assert sum(len(r) for r in splits) == len(data)
    seen = []
    for r in splits:
        ds = GPTDataset(data, 8, seed=0, documents=r)
        docs = set().union(*(docs_of(ds.window(i)) for i in range(len(ds))))
        assert docs <= set(r)
        seen.append(docs)
    assert seen[0].isdisjoint(seen[1]) and seen[1].isdisjoint(seen[2])


def test_too_little_data_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="cannot fill one sample of seq_length \\+ 1 = 1025"):
        GPTDataset(labelled_data(tmp_path / "d", num_docs=3), 1024, seed=0)


def test_list_of_arrays_still_works():
    ds = GPTDataset([np.arange(10), np.arange(20, 25)], 4, seed=0, eod=99)
    tokens = sorted(t for i in range(len(ds)) for t in ds[i]["ids"].tolist())
    assert 99 in tokens and len(ds) == (10 + 1 + 5 + 1 - 1) // 4


# ---- BERT ------------------------------------------------------------------------------------------------------


def bert_data(prefix, documents, spec="byte", split_sentences=False):
    from megakernels_models.data.preprocess import preprocess

    folder = str(prefix) + "_in"
    os.makedirs(folder, exist_ok=True)
    for i, d in enumerate(documents):
        with open(os.path.join(folder, f"{i:03d}.txt"), "w", encoding="utf-8") as f:
            f.write(d)
    preprocess([folder], str(prefix), spec, append_eod=True, split_sentences=split_sentences)
    return IndexedDataset(str(prefix))


def test_bert_masking_rates_and_sop_balance(tmp_path, documents):
    tok = ByteTokenizer()
    ds = BertDataset(bert_data(tmp_path / "d", documents * 5), 96, seed=7, tokenizer=tok)
    counts = {"mask": 0, "random": 0, "same": 0}
    real = chosen = sop = 0
    n = 1500
    for i in range(n):
        s = ds[i]
        labels, ids = s["mlm_labels"], s["ids"]
        body = ~s["padding_mask"] & (ids != tok.cls) & (ids != tok.sep) | (labels != -100)
        real += int(body.sum())
        m = labels != -100
        chosen += int(m.sum())
        counts["mask"] += int((ids[m] == tok.mask).sum())
        counts["same"] += int((ids[m] == labels[m]).sum())
        counts["random"] += int(((ids[m] != tok.mask) & (ids[m] != labels[m])).sum())
        assert not np.isin(ids[m & (ids != tok.mask)], list(tok.special_ids)).any()
        assert s["token_types"][s["padding_mask"]].sum() == 0
        assert tok.eod not in ids.tolist()
        sop += int(s["sop_labels"])
    assert chosen / real == pytest.approx(0.15, abs=0.01)
    assert counts["mask"] / chosen == pytest.approx(0.8, abs=0.02)
    assert counts["random"] / chosen == pytest.approx(0.1, abs=0.015)
    assert counts["same"] / chosen == pytest.approx(0.1, abs=0.015)
    assert sop / n == pytest.approx(0.5, abs=0.05)


def test_bert_sample_layout_and_determinism(tmp_path, documents):
    tok = ByteTokenizer()
    data = bert_data(tmp_path / "d", documents)
    ds = BertDataset(data, 128, seed=1, tokenizer=tok)
    again = BertDataset(IndexedDataset(str(tmp_path / "d")), 128, seed=1, tokenizer=tok)
    assert again.from_cache
    for i in range(20):
        s, t = ds[i], again[i]
        assert all(np.array_equal(s[k], t[k]) for k in s)
        ids = np.where(s["mlm_labels"] != -100, s["mlm_labels"], s["ids"])
        n = int((~s["padding_mask"]).sum())
        seps = np.flatnonzero(ids[:n] == tok.sep)
        assert ids[0] == tok.cls and len(seps) == 2 and seps[1] == n - 1
        a, b = bytes(ids[1 : seps[0]].astype(np.uint8)), bytes(ids[seps[0] + 1 : n - 1].astype(np.uint8))
        first, second = (b, a) if s["sop_labels"] else (a, b)
        assert any((first + second) in d.encode() for d in documents)  # consecutive text of one document
        assert (s["token_types"][:n] == (np.arange(n) > seps[0])).all()


def test_bert_with_a_hf_tokenizer_never_draws_special_tokens(tmp_path, documents, hf_path):
    from megakernels_models.data.tokenizer import build_tokenizer

    tok = build_tokenizer(f"hf:{hf_path}")
    ds = BertDataset(bert_data(tmp_path / "d", documents * 3, f"hf:{hf_path}"), 64, seed=0, tokenizer=tok)
    drawn = [
        s["ids"][(s["mlm_labels"] != -100) & (s["ids"] != tok.mask) & (s["ids"] != s["mlm_labels"])]
        for s in (ds[i] for i in range(400))
    ]
    drawn = np.concatenate(drawn)
    assert len(drawn) > 50 and not np.isin(drawn, list(tok.special_ids)).any()


def test_bert_with_sentencepiece_needs_split_sentences(tmp_path, documents, spm_path):
    from megakernels_models.data.tokenizer import build_tokenizer

    tok = build_tokenizer(f"spm:{spm_path}")
    with pytest.raises(ValueError, match="no newline token .* --split-sentences"):
        BertDataset(bert_data(tmp_path / "a", documents, f"spm:{spm_path}"), 64, seed=0, tokenizer=tok)
    ds = BertDataset(bert_data(tmp_path / "b", documents, f"spm:{spm_path}", True), 64, seed=0, tokenizer=tok)
    assert len(ds) > 0 and ds[0]["ids"][0] == tok.cls


def test_bert_needs_cls_sep_mask_pad(tmp_path):
    class NoMask(ByteTokenizer):
        name = "nomask"

        def require(self, *roles, use=""):
            raise ValueError(f"tokenizer nomask has no mask token, which {use} needs")

    with pytest.raises(ValueError, match="no mask token, which BERT needs"):
        BertDataset([np.arange(10)], 16, 0, NoMask())


# ---- document boundaries (Megatron-LM's reset_position_ids, reset_attention_mask, eod_mask_loss) ---------------


def test_document_keys_of_a_hand_computed_sample():
    from megakernels_models.data.datasets import document_keys

    ids = np.array([5, 6, 1, 7, 1, 8, 9, 10])
    labels = np.array([6, 1, 7, 1, 8, 9, 10, 11])
    got = document_keys(ids, labels, 1, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    assert got["documents"].dtype == np.int32 and got["positions"].dtype == np.int64
    assert got["documents"].tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    assert got["positions"].tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert got["labels"].tolist() == [6, 1, -100, 1, -100, 9, 10, 11]
    assert labels.tolist() == [6, 1, 7, 1, 8, 9, 10, 11]  # not changed in place
    # a sample that starts on an EOD: that EOD is document 0 on its own, positions restart after it
    got = document_keys(np.array([1, 5, 6, 1]), np.array([5, 6, 1, 3]), 1, reset_position_ids=True,
                        reset_attention_mask=True, eod_mask_loss=True)  # fmt: skip
    assert got["documents"].tolist() == [0, 1, 1, 1]
    assert got["positions"].tolist() == [0, 0, 1, 2]
    assert got["labels"].tolist() == [-100, 6, 1, -100]
    only = document_keys(np.array([5, 1, 6]), np.array([1, 6, 7]), 1, reset_attention_mask=True)
    assert set(only) == {"documents"} and only["documents"].tolist() == [0, 0, 1]


def _loop_reference(ids, labels, eod):
    """Positions, documents and EOD-masked labels by walking the tokens one at a time."""
    pos, doc, lab, p, d = [], [], [], 0, 0
    for t, y in zip(ids.tolist(), labels.tolist()):
        pos.append(p)
        doc.append(d)
        lab.append(-100 if t == eod else y)
        p, d = (0, d + 1) if t == eod else (p + 1, d)
    return pos, doc, lab


@pytest.mark.parametrize(
    "flags", [(True, True, True), (True, False, False), (False, True, False), (False, False, True)]
)
def test_gpt_dataset_document_options(tmp_path, flags):
    rp, ra, em = flags
    data = labelled_data(tmp_path / "d")
    plain = GPTDataset(data, 16, seed=5)
    ds = GPTDataset(data, 16, seed=5, eod=EOD, reset_position_ids=rp, reset_attention_mask=ra, eod_mask_loss=em)
    want_keys = {"ids", "labels"} | ({"positions"} if rp else set()) | ({"documents"} if ra else set())
    seen_eod = 0
    for i in range(len(ds)):
        s, p = ds[i], plain[i]
        assert set(s) == want_keys and set(p) == {"ids", "labels"}
        np.testing.assert_array_equal(s["ids"], p["ids"])  # same windows, same order
        pos, doc, lab = _loop_reference(p["ids"], p["labels"], EOD)
        if rp:
            assert s["positions"].tolist() == pos
        if ra:
            assert s["documents"].tolist() == doc
            # every document of the sample holds tokens of one source document (ids 1000 + d, then its EOD)
            for k in set(doc):
                assert len(docs_of(s["ids"][np.asarray(doc) == k])) <= 1
        assert s["labels"].tolist() == (lab if em else p["labels"].tolist())
        seen_eod += int((p["ids"] == EOD).sum())
    assert seen_eod > 10  # the data exercises the boundaries


def test_document_options_need_eod(tmp_path):
    with pytest.raises(ValueError, match="reset_attention_mask needs the end-of-document id"):
        GPTDataset(labelled_data(tmp_path / "d"), 16, seed=0, reset_attention_mask=True)


def test_collate_stacks_the_document_keys(tmp_path):
    import torch

    from megakernels_models.data.datasets import collate

    ds = GPTDataset(labelled_data(tmp_path / "d"), 16, seed=0, eod=EOD, reset_position_ids=True,
                    reset_attention_mask=True, eod_mask_loss=True)  # fmt: skip
    b = collate([ds[i] for i in range(4)])
    assert b["positions"].shape == (4, 16) and b["positions"].dtype == torch.int64
    assert b["documents"].shape == (4, 16) and b["documents"].dtype == torch.int32
    assert b["labels"].dtype == torch.int64 and (b["labels"] == -100).any()
