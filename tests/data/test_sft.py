"""SFT samples: best-fit-decreasing packing (a hand example and a plain reference implementation), the sample keys of
a hand-computed packed and unpacked sample, truncation and dropping counted, the epoch and global-batch conventions
of the other datasets, and a tiny document-masked attention model that gives a packed sample the loss of its
conversations one a sample."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megakernels_models.data.datasets import global_batch_indices
from megakernels_models.data.sft import InMemoryChat, SFTDataset, pack, packing_stats

PAD = 0


def test_pack_by_hand():
    # sizes 5 3 4 2 6 into 8: 6 -> new (room 2); 5 -> new (room 3); 4 -> new (room 4); 3 -> the room-3 sample;
    # 2 -> the room-2 sample
    items, offsets = pack(np.array([5, 3, 4, 2, 6]), 8, seed=0)
    groups = [items[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
    assert groups == [[4, 3], [0, 1], [2]]
    with pytest.raises(ValueError, match="sizes must be in 1..8"):
        pack(np.array([9]), 8, 0)


def best_fit_reference(sizes, capacity, order):
    """Best fit, one item at a time over every open sample (the fullest that fits; the first of equals)."""
    bins, room = [], []
    for i in order:
        fits = [b for b in range(len(bins)) if room[b] >= sizes[i]]
        if fits:
            least = min(room[b] for b in fits)
            b = [b for b in fits if room[b] == least][0]
        else:
            b = len(bins)
            bins.append([])
            room.append(capacity)
        bins[b].append(i)
        room[b] -= sizes[i]
    return bins


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pack_matches_a_plain_best_fit_decreasing(seed):
    sizes = np.random.default_rng(seed).integers(1, 65, 300)
    items, offsets = pack(sizes, 64, seed)
    groups = [items[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
    assert sorted(items.tolist()) == list(range(300))
    assert all(sizes[g].sum() <= 64 for g in groups)
    tie = np.random.default_rng([seed, 0x5F7]).permutation(300)
    order = np.lexsort((tie, -sizes))
    assert sorted(map(sorted, groups)) == sorted(map(sorted, best_fit_reference(sizes, 64, order)))
    assert len(groups) <= np.ceil(sizes.sum() / 64) * 11 / 9 + 1  # BFD's bound
    again = pack(sizes, 64, seed)
    assert np.array_equal(again[0], items) and np.array_equal(again[1], offsets)
    stats = packing_stats(sizes, 63, seed)
    assert stats["samples"] == len(groups) and stats["efficiency"] == sizes.sum() / (64 * len(groups))


# A: 4 tokens, targets on its last two; B: 3 tokens, targets on its last two
A = ([10, 11, 12, 13], [0, 0, 1, 1])
B = ([20, 21, 22], [0, 1, 1])


def test_packed_sample_by_hand():
    ds = SFTDataset(InMemoryChat([A, B]), 9, seed=0, pad=PAD)
    assert len(ds) == 1 and ds.conversations(0) == [0, 1]
    s = ds[0]
    assert s["ids"].tolist() == [10, 11, 12, 13, 20, 21, 22, PAD, PAD]
    assert s["labels"].tolist() == [-100, 12, 13, -100, 21, 22, -100, -100, -100]
    assert s["positions"].tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1]
    assert s["documents"].tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2]
    assert {k: v.dtype for k, v in s.items()} == {
        "ids": np.int64,
        "labels": np.int64,
        "positions": np.int64,
        "documents": np.int32,
    }
    assert ds.stats == {
        "conversations": 2,
        "samples": 1,
        "tokens": 7,
        "capacity": 10,
        "efficiency": 0.7,
        "truncated": 0,
        "dropped": 0,
    }


def test_unpacked_sample_by_hand():
    ds = SFTDataset(InMemoryChat([A, B]), 9, seed=0, pad=PAD, packed=False)
    assert len(ds) == 2 and sorted(ds.conversations(0) + ds.conversations(1)) == [0, 1]
    s = ds.conversation_sample(0)
    assert s["ids"].tolist() == [10, 11, 12, 13, PAD, PAD, PAD, PAD, PAD]
    assert s["labels"].tolist() == [-100, 12, 13] + [-100] * 6
    assert s["positions"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4]
    assert s["documents"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1]
    assert ds.efficiency == 7 / 20


def test_a_conversation_starting_with_a_target_is_not_predicted_by_its_neighbour():
    first = ([30, 31], [1, 1])  # a mask on a conversation's first token: nothing of its own predicts it
    ds = SFTDataset(InMemoryChat([A, first]), 5, seed=0, pad=PAD)
    assert ds.conversations(0) == [0, 1]
    assert ds[0]["labels"].tolist() == [-100, 12, 13, -100, 31]


def test_truncated_and_dropped_are_counted():
    long = (list(range(100, 115)), [0] * 5 + [1] * 10)  # 15 tokens, cut to 10
    late = (list(range(200, 215)), [0] * 12 + [1] * 3)  # its targets all past token 10: dropped
    with pytest.warns(UserWarning, match="1 longer than seq_length \\+ 1 = 10 tokens are truncated and 1 without"):
        ds = SFTDataset(InMemoryChat([A, long, late, B]), 9, seed=0, pad=PAD)
    assert ds.stats["truncated"] == 1 and ds.stats["dropped"] == 1 and ds.stats["conversations"] == 3
    cut = next(ds[i] for i in range(len(ds)) if ds.conversations(i) == [1])
    assert cut["ids"].tolist() == list(range(100, 109))
    assert cut["labels"].tolist() == [-100] * 4 + list(range(105, 110))
    with pytest.raises(ValueError, match="no conversation among 0..0 has an assistant target"):
        SFTDataset(InMemoryChat([late]), 9, seed=0)


def random_chat(n=60, seed=0, longest=40):
    rng = np.random.default_rng(seed)
    out = []
    for c in range(n):
        size = int(rng.integers(3, longest))
        mask = (rng.random(size) < 0.5).astype(np.uint8)
        mask[-1] = 1
        out.append((1000 * (c + 1) + np.arange(size), mask))
    return out


@pytest.mark.parametrize("packed", [True, False])
def test_epochs_cover_every_conversation_once_in_a_new_order(packed):
    ds = SFTDataset(InMemoryChat(random_chat()), 47, seed=3, packed=packed)
    n = len(ds)
    first = [ds.conversations(i) for i in range(n)]
    second = [ds.conversations(n + i) for i in range(n)]
    assert sorted(c for s in first for c in s) == list(range(60)) == sorted(c for s in second for c in s)
    assert first != second and sorted(first) == sorted(second)  # the same samples, another order
    again = SFTDataset(InMemoryChat(random_chat()), 47, seed=3, packed=packed)
    assert all(np.array_equal(ds[i]["ids"], again[i]["ids"]) for i in range(2 * n))
    if packed:
        assert n < 60 and ds.efficiency > 0.8


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_global_batches_do_not_depend_on_dp(dp):
    ds = SFTDataset(InMemoryChat(random_chat()), 47, seed=1)
    ref = [ds[i]["ids"].tolist() for i in range(3 * 8)]
    got = [ds[i]["ids"].tolist() for step in range(3) for r in range(dp) for i in global_batch_indices(step, 8, r, dp)]
    assert got == ref


def test_packed_samples_are_the_unpacked_ones_side_by_side():
    data = InMemoryChat(random_chat(seed=4))
    packed = SFTDataset(data, 63, seed=0)
    for i in range(len(packed)):
        s, at = packed[i], 0
        for k, c in enumerate(packed.conversations(i)):
            u = packed.conversation_sample(c)
            n = int(data.sizes[c])
            for key in ("ids", "labels", "positions"):
                np.testing.assert_array_equal(s[key][at : at + n][: 63 - at], u[key][:n][: 63 - at])
            assert (s["documents"][at : at + n] == k).all()
            at += n
        assert (s["labels"][at:] == -100).all() and (s["documents"][at:] == len(packed.conversations(i))).all()


def test_cache_beside_chat_data(tmp_path):
    from megakernels_models.data import chat
    from tests.data.test_chat import EXAMPLE, texts

    d = chat.write_small_tokenizer(str(tmp_path / "tok"), texts(), 400)
    chat.preprocess_chat([EXAMPLE], str(tmp_path / "c"), d)
    data = chat.ChatIndexed(str(tmp_path / "c"))
    first = SFTDataset(data, 200, seed=2, pad=5, documents=range(0, 30))
    again = SFTDataset(chat.ChatIndexed(str(tmp_path / "c")), 200, seed=2, pad=5, documents=range(0, 30))
    assert not first.from_cache and again.from_cache and len(first) == len(again)
    assert all(first.conversations(i) == again.conversations(i) for i in range(len(first)))
    assert sorted(c for i in range(len(first)) for c in first.conversations(i)) == list(range(30))
    s = first[0]
    assert (s["ids"][s["documents"] == len(first.conversations(0))] == 5).all()  # padding, if any, is pad


# ---- the loss: packed equals unpacked under document masking -----------------------------------------------------


class TinyLM(torch.nn.Module):
    """Embeddings (tokens + positions), one causal attention layer restricted to each token's document, logits."""

    def __init__(self, vocab, width=16, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.tok = torch.nn.Parameter(torch.randn(vocab, width, generator=g, dtype=torch.float64))
        self.pos = torch.nn.Parameter(torch.randn(256, width, generator=g, dtype=torch.float64))
        self.qkv = torch.nn.Parameter(torch.randn(width, 3 * width, generator=g, dtype=torch.float64) / width**0.5)
        self.out = torch.nn.Parameter(torch.randn(width, vocab, generator=g, dtype=torch.float64))

    def forward(self, ids, positions, documents):
        x = self.tok[ids] + self.pos[positions]
        q, k, v = (x @ self.qkv).chunk(3, dim=-1)
        n = ids.shape[-1]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        same = documents[..., :, None] == documents[..., None, :]
        scores = (q @ k.transpose(-1, -2)).masked_fill(~(causal & same), float("-inf"))
        return (x + torch.softmax(scores, -1) @ v) @ self.out


def summed_loss(model, sample):
    t = {k: torch.as_tensor(v, dtype=torch.int64) for k, v in sample.items()}
    logits = model(t["ids"], t["positions"], t["documents"])
    return torch.nn.functional.cross_entropy(logits, t["labels"], ignore_index=-100, reduction="sum")


def test_packed_and_unpacked_give_the_same_loss():
    data = InMemoryChat([(ids % 97, mask) for ids, mask in random_chat(seed=5)])
    packed = SFTDataset(data, 63, seed=0)
    unpacked = SFTDataset(data, 63, seed=0, packed=False)
    model = TinyLM(97)
    with torch.no_grad():
        total_packed = sum(summed_loss(model, packed[i]) for i in range(len(packed)))
        total_unpacked = sum(summed_loss(model, unpacked[i]) for i in range(len(unpacked)))
        for i in range(3):
            per = sum(summed_loss(model, packed.conversation_sample(c)) for c in packed.conversations(i))
            assert summed_loss(model, packed[i]).item() == pytest.approx(per.item(), rel=1e-12)
    targets = lambda ds: sum(int((ds[i]["labels"] != -100).sum()) for i in range(len(ds)))
    assert targets(packed) == targets(unpacked) > 0
    assert total_packed.item() == pytest.approx(total_unpacked.item(), rel=1e-12)
    # without the document mask the packed loss differs: the test can tell
    with torch.no_grad():
        s = packed[0]
        leaky = dict(s, documents=np.zeros_like(s["documents"]))
        if len(packed.conversations(0)) > 1:
            assert summed_loss(model, leaky).item() != pytest.approx(summed_loss(model, s).item(), rel=1e-9)
