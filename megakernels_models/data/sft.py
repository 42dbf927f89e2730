"""Supervised fine-tuning samples: chat conversations (``chat.py``) packed whole into samples of ``seq_length + 1``
tokens, or one conversation a sample.

Packing (``pack``): best-fit decreasing — conversations longest first (ties in a seeded order), each into the
packed sample with the least room that still holds it (the earliest opened of equals), else a new one. A
conversation is never cut across samples; one longer than ``seq_length + 1`` tokens is truncated to its first
``seq_length + 1`` (counted, with a warning). A conversation with no target left (after truncation; its first token
is never a target) is dropped (counted, with a warning): it could only add a sample without loss. The packing is
computed once per split (it depends on the sizes, the masks, ``seq_length`` and the seed) and cached beside the
data like the GPT index; each epoch visits the packed samples in a new seeded order, with the conventions of
``datasets`` (global batch ``k`` is samples ``[k·B, (k+1)·B)``, whatever the layout).

A sample (the batch contract, ``datasets``' module docstring) is the packed conversations then padding, ``seq_length
+ 1`` tokens ``w``: ``ids`` = w[:-1]; ``labels`` = w[1:] where that token is an assistant target, else -100 (so -100
on user/system text, on each conversation's first token — the previous conversation's last token never predicts it
— and on padding); ``positions`` restart at 0 at each conversation (and at the padding); ``documents`` number the
conversations 0, 1, ... and give the padding the next number of its own, so no real token attends to padding nor
padding to real tokens. The unpacked variant (``packed=False``) is the same with one conversation a sample, which
gives each conversation's tokens exactly the same logits and targets as packing does.
"""

from __future__ import annotations

import bisect
import heapq
import json
import warnings

import numpy as np

from megakernels_models.data import sample_index as si
from megakernels_models.data.datasets import Epochs, document_range

SFT_TAG = 0x5F7


def pack(sizes: np.ndarray, capacity: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit decreasing packing (module docstring) of items of ``sizes`` (each ``<= capacity``, ``>= 1``).

    Returns:
        ``(items, offsets)``: item numbers (indices into ``sizes``) sample after sample (int64 ``[n]``) and where
        each sample's items start (int64 ``[S + 1]``).

    Raises:
        ValueError: a size outside ``1..capacity``.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    if len(sizes) and (sizes.min() < 1 or sizes.max() > capacity):
        raise ValueError(f"pack: sizes must be in 1..{capacity}, got {int(sizes.min())}..{int(sizes.max())}")
    tie = si.rng(seed, SFT_TAG).permutation(len(sizes))
    order = np.lexsort((tie, -sizes))
    bins: list[list[int]] = []
    rooms: list[int] = []  # the distinct rooms left in open samples, sorted
    by_room: dict[int, list[int]] = {}
    for item in order.tolist():
        s = int(sizes[item])
        j = bisect.bisect_left(rooms, s)
        if j < len(rooms):
            room = rooms[j]
            b = heapq.heappop(by_room[room])  # the earliest opened of the samples with that room
            if not by_room[room]:
                del by_room[room]
                rooms.pop(j)
        else:
            b, room = len(bins), capacity
            bins.append([])
        bins[b].append(item)
        left = room - s
        if left > 0:
            if left not in by_room:
                bisect.insort(rooms, left)
                by_room[left] = []
            heapq.heappush(by_room[left], b)
    items = np.asarray([i for b in bins for i in b], dtype=np.int64)
    offsets = np.zeros(len(bins) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in bins], out=offsets[1:])
    return items, offsets


def packing_stats(sizes: np.ndarray, seq_length: int, seed: int = 0) -> dict:
    """How conversations of ``sizes`` tokens pack into samples of ``seq_length + 1`` (module docstring; every
    conversation counted, none dropped): ``samples``, ``tokens`` (real tokens after truncation), ``capacity``
    (samples × (seq_length + 1)), ``efficiency`` (tokens / capacity), ``truncated`` (conversations cut)."""
    cap = int(seq_length) + 1
    sizes = np.minimum(np.asarray(sizes, dtype=np.int64), cap)
    _, offsets = pack(sizes, cap, seed)
    samples = len(offsets) - 1
    tokens = int(sizes.sum())
    truncated = int((np.asarray(sizes) >= cap).sum())
    return {
        "samples": samples,
        "tokens": tokens,
        "capacity": samples * cap,
        "efficiency": tokens / (samples * cap) if samples else 0.0,
        "truncated": truncated,
    }


class InMemoryChat:
    """Conversations as ``(ids, mask)`` array pairs behind ``chat.ChatIndexed``'s reading interface (tests)."""

    prefix = None
    meta: dict = {}

    def __init__(self, conversations):
        self._c = [(np.asarray(i, dtype=np.int64), np.asarray(m, dtype=np.uint8)) for i, m in conversations]
        if any(len(i) != len(m) for i, m in self._c):
            raise ValueError("InMemoryChat: each mask must have its conversation's length")
        self.sizes = np.array([len(i) for i, _ in self._c], dtype=np.int64)
        self.doc_count = len(self._c)

    def __len__(self) -> int:
        return self.doc_count

    def get(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        d = self._c[doc][0]
        return d[offset : len(d) if length is None else offset + length]

    def get_mask(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        d = self._c[doc][1]
        return d[offset : len(d) if length is None else offset + length]


class SFTDataset:
    """Supervised fine-tuning samples (module docstring).

    Args:
        data: a ``chat.ChatIndexed`` (or ``InMemoryChat``).
        seq_length: tokens per sample (each holds ``seq_length + 1``).
        seed: the packing's ties and each epoch's order.
        pad: the id of padding tokens (never a target, never attended to by real tokens).
        documents: the range of conversations to read (a split); default all.
        packed: pack several conversations a sample (True) or one a sample, padded (False).

    ``dataset[i]`` -> ``ids``, ``labels``, ``positions`` (int64 ``[seq_length]``), ``documents`` (int32
    ``[seq_length]``). ``len`` is the samples of one epoch. ``conversations(i)`` the conversations of sample ``i``;
    ``conversation_sample(c)`` conversation ``c`` alone, as the unpacked variant gives it; ``stats`` the packing's
    (``conversations``, ``samples``, ``tokens``, ``capacity``, ``efficiency``, ``truncated``, ``dropped``).

    Raises:
        ValueError: no conversation with a target in ``documents``; a bad range; ``seq_length`` < 1.
        IndexError: a negative sample number.
    """

    def __init__(
        self,
        data,
        seq_length: int,
        seed: int,
        pad: int = 0,
        *,
        documents: range | None = None,
        packed: bool = True,
    ):
        if int(seq_length) < 1:
            raise ValueError(f"SFTDataset: seq_length must be >= 1, got {seq_length}")
        self.data, self.seq_length, self.seed = data, int(seq_length), int(seed)
        self.pad, self.packed = int(pad), bool(packed)
        self.documents = document_range(data, documents)
        cap = self.seq_length + 1
        sizes = np.asarray(data.sizes[self.documents.start : self.documents.stop], dtype=np.int64)
        meta = json.dumps(getattr(data, "meta", {}), sort_keys=True)
        key = si.index_key("sft", sizes, self.documents.start, self.documents.stop, cap, self.seed, self.packed, meta)

        def build():
            kept = np.asarray(
                [
                    d
                    for d in self.documents
                    if np.any(np.asarray(data.get_mask(d, 1, max(0, min(int(data.sizes[d]), cap) - 1))))
                ],
                dtype=np.int64,
            )
            used = np.minimum(np.asarray(data.sizes, dtype=np.int64)[kept], cap)
            if self.packed:
                items, offsets = pack(used, cap, self.seed)
                conv = kept[items]
            else:
                conv, offsets = kept, np.arange(len(kept) + 1, dtype=np.int64)
            return {"conversations": conv, "offsets": offsets}

        idx, self.from_cache = si.load_or_build(
            data.prefix,
            "sft",
            key,
            ("conversations", "offsets"),
            build,
            lambda a: a["offsets"].ndim == 1 and len(a["offsets"]) >= 1 and a["offsets"][-1] == len(a["conversations"]),
        )
        self._conv, self._offsets = np.asarray(idx["conversations"]), np.asarray(idx["offsets"])
        self.num_samples = len(self._offsets) - 1
        n_conv = len(self.documents)
        if self.num_samples < 1:
            raise ValueError(
                f"SFTDataset: no conversation among {self.documents.start}..{self.documents.stop - 1} has an "
                f"assistant target within seq_length + 1 = {cap} tokens"
            )
        used = np.minimum(np.asarray(data.sizes, dtype=np.int64)[self._conv], cap)
        truncated = int((np.asarray(data.sizes, dtype=np.int64)[self._conv] > cap).sum())
        dropped = n_conv - len(self._conv)
        self.stats = {
            "conversations": len(self._conv),
            "samples": self.num_samples,
            "tokens": int(used.sum()),
            "capacity": self.num_samples * cap,
            "efficiency": float(used.sum()) / (self.num_samples * cap),
            "truncated": truncated,
            "dropped": dropped,
        }
        if truncated or dropped:
            warnings.warn(
                f"SFTDataset: of {n_conv} conversations ({self.documents.start}..{self.documents.stop - 1}), "
                f"{truncated} longer than seq_length + 1 = {cap} tokens are truncated and {dropped} without an "
                "assistant target inside that length are left out",
                stacklevel=2,
            )
        self._order = Epochs(self.num_samples, self.seed)

    @property
    def efficiency(self) -> float:
        """Real tokens / packed capacity (samples × (seq_length + 1)) over one epoch."""
        return self.stats["efficiency"]

    def __len__(self) -> int:
        return self.num_samples

    def conversations(self, i: int) -> list[int]:
        """The conversation numbers packed into sample ``i`` (in their order in it)."""
        k = self._order(int(i))
        return [int(c) for c in self._conv[self._offsets[k] : self._offsets[k + 1]]]

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return self._sample(self.conversations(i))

    def conversation_sample(self, conversation: int) -> dict[str, np.ndarray]:
        """Conversation ``conversation`` alone in a padded sample (what ``packed=False`` gives for it)."""
        return self._sample([int(conversation)])

    def _sample(self, convs: list[int]) -> dict[str, np.ndarray]:
        cap = self.seq_length + 1
        pieces = []
        for c in convs:
            n = min(int(self.data.sizes[c]), cap)
            pieces.append((self.data.get(c, 0, n), self.data.get_mask(c, 0, n)))
        return packed_sample(pieces, self.seq_length, self.pad)


def packed_sample(pieces, seq_length: int, pad: int) -> dict[str, np.ndarray]:
    """One sample of ``seq_length + 1`` tokens holding ``pieces`` (``(ids, mask)`` pairs, together at most that
    long) one after the other, then padding (module docstring): a piece's token is a target where its mask is
    non-zero, except its first; piece ``k`` is document ``k`` and the padding document ``len(pieces)``."""
    cap = seq_length + 1
    tokens = np.full(cap, pad, dtype=np.int64)
    target = np.zeros(cap, dtype=bool)
    positions = np.zeros(cap, dtype=np.int64)
    documents = np.full(cap, len(pieces), dtype=np.int32)  # the padding's own document
    at = 0
    for k, (ids, mask) in enumerate(pieces):
        n = len(ids)
        tokens[at : at + n] = ids
        target[at + 1 : at + n] = np.asarray(mask[1:n]) != 0
        positions[at : at + n] = np.arange(n)
        documents[at : at + n] = k
        at += n
    positions[at:] = np.arange(cap - at)
    labels = np.where(target, tokens, -100)
    return {
        "ids": tokens[:-1],
        "labels": labels[1:],
        "positions": positions[:-1],
        "documents": documents[:-1],
    }
