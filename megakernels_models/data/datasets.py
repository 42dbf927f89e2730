"""The dataset interface the trainer reads through, and the order in which it reads.

A dataset is indexable by any non-negative sample number (numbers past its length start another epoch in a new
order) and returns a dict of numpy arrays for one sample. Which samples form which global batch depends only on
the seed and the global batch size, never on data parallelism (DESIGN.md §4): global batch ``k`` is samples
``[k·B, (k+1)·B)``; data-parallel rank ``d`` of ``D`` takes the contiguous ``B/D`` of them starting at ``d·B/D``
and cuts them into micro-batches. Any layout therefore sees the same global batches.

- ``GPTDataset``: windows of ``seq_length + 1`` tokens across document boundaries (an EOD token after each
  document), in a seeded random order per epoch; ``ids`` = window[:-1], ``labels`` = window[1:].
- ``BertDataset``: sentence pairs (lines of a document) with sentence-order-prediction labels (the two segments
  swapped with probability 1/2) and 15 % of tokens masked for the MLM loss (80 % [MASK], 10 % a random token,
  10 % unchanged), all drawn from the seed and the sample number.
"""

from __future__ import annotations

import numpy as np
import torch

_MIX = 0x9E3779B97F4A7C15


def _rng(seed: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng([int(seed) & (2**63 - 1), *[int(k) for k in keys]])


def split_documents(num_documents: int, split: tuple[int, ...] = (949, 50, 1)) -> list[range]:
    """Document ranges of the train / valid / test splits, in proportion to ``split`` (e.g. ``949,50,1``).

    Raises:
        ValueError: a negative weight or all zero.
    """
    if any(w < 0 for w in split) or sum(split) <= 0:
        raise ValueError(f"split must be non-negative weights with a positive sum, got {split}")
    bounds, acc, total = [0], 0, sum(split)
    for w in split:
        acc += w
        bounds.append(round(num_documents * acc / total))
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


class _Epochs:
    """A seeded permutation of ``n`` items per epoch (the last one cached)."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self._epoch, self._perm = n, seed, -1, None

    def __call__(self, i: int) -> int:
        if i < 0:
            raise IndexError(f"sample index must be >= 0, got {i}")
        epoch, j = divmod(i, self.n)
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, _rng(self.seed, epoch).permutation(self.n)
        return int(self._perm[j])


class GPTDataset:
    """Next-token samples from documents (token arrays), see the module docstring.

    Args:
        documents: token id arrays.
        seq_length: tokens per sample (each window holds ``seq_length + 1``).
        seed: the sample order.
        eod: the end-of-document id appended to each document.

    Raises:
        ValueError: fewer than ``seq_length + 1`` tokens in all.
    """

    def __init__(self, documents: list[np.ndarray], seq_length: int, seed: int, eod: int):
        parts = []
        for d in documents:
            parts.extend((np.asarray(d, dtype=np.int64), np.array([eod], dtype=np.int64)))
        self.tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        self.seq_length = int(seq_length)
        self.num_windows = (len(self.tokens) - 1) // self.seq_length
        if self.num_windows < 1:
            raise ValueError(f"GPTDataset: {len(self.tokens)} tokens cannot fill one sample of seq_length + 1 = "
                             f"{self.seq_length + 1}")
        self._order = _Epochs(self.num_windows, seed)

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        w = self._order(i)
        window = self.tokens[w * self.seq_length:(w + 1) * self.seq_length + 1]
        return {"ids": window[:-1], "labels": window[1:]}


class BertDataset:
    """Sentence-pair samples with SOP labels and MLM masking, see the module docstring.

    Args:
        documents: token id arrays; sentences are lines (split after each ``newline`` token).
        seq_length: tokens per sample, ``[CLS] A [SEP] B [SEP]`` then padding.
        seed: pairing, order, swapping and masking.
        tokenizer: provides ``cls, sep, mask, pad`` ids and ``vocab_size``.
        newline: the id that ends a sentence (``\\n`` for the byte tokenizer).
        mask_prob: fraction of real tokens chosen for the MLM loss.

    Raises:
        ValueError: no document with two sentences.
    """

    def __init__(self, documents: list[np.ndarray], seq_length: int, seed: int, tokenizer, newline: int = 10,
                 mask_prob: float = 0.15):
        self.seq_length, self.seed, self.tok, self.mask_prob = int(seq_length), int(seed), tokenizer, mask_prob
        budget = self.seq_length - 3
        self.pairs: list[tuple[np.ndarray, np.ndarray]] = []
        rng = _rng(seed, 0x5E9)
        for d in documents:
            d = np.asarray(d, dtype=np.int64)
            ends = np.flatnonzero(d == newline) + 1
            sentences = [s for s in np.split(d, ends) if len(s)]
            i = 0
            while i + 1 < len(sentences):
                # Greedily take sentences up to the budget, then cut them into A and B at a random sentence.
                j, size = i, 0
                while j < len(sentences) and (size + len(sentences[j]) <= budget or j - i < 2):
                    size += len(sentences[j])
                    j += 1
                if j - i < 2:
                    break
                cut = int(rng.integers(i + 1, j))
                a, b = np.concatenate(sentences[i:cut]), np.concatenate(sentences[cut:j])
                # Truncate the longer segment first until the pair fits.
                while len(a) + len(b) > budget:
                    if len(a) >= len(b):
                        a = a[:-1]
                    else:
                        b = b[:-1]
                self.pairs.append((a, b))
                i = j
        if not self.pairs:
            raise ValueError("BertDataset: no document has two sentences to pair")
        self._order = _Epochs(len(self.pairs), seed)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        a, b = self.pairs[self._order(i)]
        t, s = self.tok, self.seq_length
        rng = _rng(self.seed, 0xBE27, i)
        swap = bool(rng.integers(0, 2))
        if swap:
            a, b = b, a
        ids = np.full(s, t.pad, dtype=np.int64)
        types = np.zeros(s, dtype=np.int64)
        seq = np.concatenate([[t.cls], a, [t.sep], b, [t.sep]])
        n = len(seq)
        ids[:n] = seq
        types[len(a) + 2:n] = 1
        labels = np.full(s, -100, dtype=np.int64)
        real = np.flatnonzero((ids != t.cls) & (ids != t.sep) & (ids != t.pad))
        chosen = real[rng.random(len(real)) < self.mask_prob]
        if len(chosen) == 0 and len(real):
            chosen = real[rng.integers(0, len(real), 1)]
        labels[chosen] = ids[chosen]
        action = rng.random(len(chosen))
        ids[chosen[action < 0.8]] = t.mask
        rand = chosen[(action >= 0.8) & (action < 0.9)]
        ids[rand] = rng.integers(0, 256 if t.name == "byte" else t.vocab_size, len(rand))
        return {"ids": ids, "token_types": types, "padding_mask": np.arange(s) >= n, "mlm_labels": labels,
                "sop_labels": np.int64(swap)}


def global_batch_indices(step: int, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> range:
    """Sample numbers of data-parallel rank ``dp_rank``'s share of global batch ``step`` (see module docstring)."""
    per = global_batch_size // dp_size
    start = step * global_batch_size + dp_rank * per
    return range(start, start + per)


def collate(samples: list[dict[str, np.ndarray]], device=None) -> dict[str, torch.Tensor]:
    """Stack samples into ``[b, ...]`` tensors on ``device``."""
    return {k: torch.as_tensor(np.stack([s[k] for s in samples])).to(device) for k in samples[0]}
