"""The dataset interface the trainer reads through, and the order in which it reads.

A dataset is indexable by any non-negative sample number (numbers past its length start another epoch in a new
order) and returns a dict of numpy arrays for one sample. Which samples form which global batch depends only on
the seed and the global batch size, never on data parallelism (docs/parallelism.md): global batch ``k`` is samples
``[k·B, (k+1)·B)``; data-parallel rank ``d`` of ``D`` takes the contiguous ``B/D`` of them starting at ``d·B/D``
and cuts them into micro-batches. Any layout therefore sees the same global batches.

Datasets read documents from an ``indexed.IndexedDataset`` (restricted to a range of its documents: a split) or,
for tests and small in-memory corpora, from a list of token arrays (``InMemoryDocuments``).

- ``GPTDataset``: windows of ``seq_length + 1`` tokens across document boundaries, the documents in a seeded order
  per epoch and the windows shuffled (``sample_index``); ``ids`` = window[:-1], ``labels`` = window[1:] (int64
  ``[seq_length]``). The EOD tokens between documents are in the data (``preprocess --append-eod``).
  Optionally (Megatron-LM's options, each off by default; ``document_keys``) a sample also marks its documents:
  ``positions`` (int64 ``[seq_length]``, ``reset_position_ids``), ``documents`` (int32 ``[seq_length]``,
  ``reset_attention_mask``: a token attends only to earlier tokens of the same document) and labels -100 at EOD
  inputs (``eod_mask_loss``).
- ``sft.SFTDataset``: chat conversations packed whole into samples, with the same keys (``data/sft.py``).

Document keys of a sample (the batch contract with the trainer; ``collate`` stacks whatever keys a sample has):

- ``documents``: the document index of each input token inside the sample, non-decreasing from 0 (0, 0, 0, 1, 1,
  2, ...); a new document starts right after an EOD input token (the EOD belongs to the document it ends). The first
  token of a sample is document 0 even when its document began in an earlier sample.
- ``positions``: each input token's position inside its document, restarting at 0 at the start of every sample and
  after every EOD (Megatron-LM's ``reset_position_ids``: a document cut by the sample start restarts at 0 too).
- ``labels`` -100 where no loss is taken: with ``eod_mask_loss`` at every position whose input is EOD (the token
  ending one document never predicts the next document's first token).
- ``BertDataset``: sentence pairs (runs of sentences of one document) with sentence-order-prediction labels (the
  two segments swapped with probability 1/2) and 15 % of tokens masked for the MLM loss (80 % [MASK], 10 % a random
  non-special token, 10 % unchanged), all drawn from the seed and the sample number.
"""

from __future__ import annotations

import numpy as np
import torch

from megakernels_models.data import sample_index as si

_rng = si.rng


def split_documents(num_documents: int, split: tuple[int, ...] = (949, 50, 1)) -> list[range]:
    """Document ranges of the train / valid / test splits, in proportion to ``split`` (e.g. ``949,50,1``):
    consecutive, disjoint, covering ``0 .. num_documents-1``.

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


class InMemoryDocuments:
    """A list of token arrays behind the reading interface of ``IndexedDataset`` (``len``, ``[doc]``, ``get``,
    ``sizes``, ``doc_count``, ``sentences``), with ``eod`` appended to each document when given."""

    prefix = None

    def __init__(self, documents: list[np.ndarray], eod: int | None = None):
        parts = []
        for d in documents:
            parts.append(np.asarray(d, dtype=np.int64).reshape(-1))
            if eod is not None:
                parts.append(np.array([eod], dtype=np.int64))
        self._tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        self.sizes = np.array([len(d) + (eod is not None) for d in documents], dtype=np.int64)
        self.doc_offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.doc_count = len(documents)

    def __len__(self) -> int:
        return self.doc_count

    def __getitem__(self, doc: int) -> np.ndarray:
        return self._tokens[self.doc_offsets[doc] : self.doc_offsets[doc + 1]]

    def get(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        d = self[doc]
        return d[offset : len(d) if length is None else offset + length]

    def sentences(self, doc: int) -> list[np.ndarray]:
        return [self[doc]]


def _as_source(data, eod):
    return data if hasattr(data, "get") and hasattr(data, "sizes") else InMemoryDocuments(data, eod)


def document_range(source, documents: range | None) -> range:
    """``documents`` (default: every document of ``source``) checked as a contiguous range inside it.

    Raises:
        ValueError: a stepped range or one reaching outside ``0..len(source)``."""
    docs = range(len(source)) if documents is None else documents
    if docs.step != 1 or not 0 <= docs.start <= docs.stop <= len(source):
        raise ValueError(f"documents {docs} is not a contiguous range inside 0..{len(source)}")
    return docs


class Epochs:
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
    """Next-token samples (see the module docstring and ``sample_index`` for the order).

    Args:
        data: an ``IndexedDataset`` or a list of token arrays.
        seq_length: tokens per sample (each window holds ``seq_length + 1``).
        seed: the document order and the shuffle.
        eod: for a list of arrays, the end-of-document id to append to each (indexed data already has it).
        documents: the range of documents to read (a split); default all.
        num_samples: how many samples the index is built and cached for (default one epoch); samples past it are
            computed on demand, identical to what a larger ``num_samples`` would have cached.
        reset_position_ids, reset_attention_mask, eod_mask_loss: add the document keys ``positions``, ``documents``
            and -100 labels at EOD inputs (module docstring; Megatron-LM's option names). Each needs ``eod``, the
            end-of-document id (for indexed data only used for this, never appended).

    ``dataset[i]`` -> ``{"ids": int64 [seq_length], "labels": int64 [seq_length]}`` (+ ``positions``,
    ``documents`` as asked). ``from_cache`` tells whether the index was read from the ``.npy`` files beside the
    data; the options do not change the index.

    Raises:
        ValueError: fewer than ``seq_length + 1`` tokens in the documents; a bad ``documents`` range; a document
            option without ``eod``.
        IndexError: a negative sample number.
    """

    def __init__(
        self,
        data,
        seq_length: int,
        seed: int,
        eod: int | None = None,
        *,
        documents: range | None = None,
        num_samples: int | None = None,
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
        eod_mask_loss: bool = False,
    ):
        self.boundaries = {
            k: bool(v)
            for k, v in dict(
                reset_position_ids=reset_position_ids,
                reset_attention_mask=reset_attention_mask,
                eod_mask_loss=eod_mask_loss,
            ).items()
            if v
        }
        if self.boundaries and eod is None:
            raise ValueError(f"GPTDataset: {', '.join(self.boundaries)} needs the end-of-document id eod")
        self.eod = None if eod is None else int(eod)
        self.data = _as_source(data, eod)
        self.documents = document_range(self.data, documents)
        self.seq_length, self.seed = int(seq_length), int(seed)
        sizes = np.asarray(self.data.sizes[self.documents.start : self.documents.stop], dtype=np.int64)
        self._sizes = np.asarray(self.data.sizes, dtype=np.int64)
        self.num_windows = si.gpt_windows(sizes, self.seq_length)
        if self.num_windows < 1:
            raise ValueError(
                f"GPTDataset: {int(sizes.sum())} tokens in documents {self.documents.start}.."
                f"{self.documents.stop - 1} cannot fill one sample of seq_length + 1 = "
                f"{self.seq_length + 1}"
            )
        self.num_samples = self.num_windows if num_samples is None else max(1, int(num_samples))
        epochs = -(-self.num_samples // self.num_windows)
        key = si.index_key(
            "gpt", sizes, self.documents.start, self.documents.stop, self.seq_length, self.seed, self.num_samples
        )
        w, d = self.num_windows, len(sizes)

        def check(a):
            return (
                a["doc_idx"].shape == (epochs, d)
                and a["sample_idx"].shape == (epochs * w, 2)
                and a["shuffle_idx"].shape == (epochs * w,)
            )

        idx, self.from_cache = si.load_or_build(
            self.data.prefix,
            "gpt",
            key,
            ("doc_idx", "sample_idx", "shuffle_idx"),
            lambda: si.gpt_index(sizes, self.documents.start, self.seq_length, self.seed, epochs),
            check,
        )
        self.cache_key, self._cached_epochs = key, epochs
        self._idx = idx
        self._extra = (-1, None)  # the last epoch computed past the cached ones

    def __len__(self) -> int:
        return self.num_windows

    def _epoch(self, e: int):
        if e < self._cached_epochs:
            w = self.num_windows
            return (
                self._idx["doc_idx"][e],
                self._idx["sample_idx"][e * w : (e + 1) * w],
                self._idx["shuffle_idx"][e * w : (e + 1) * w],
            )
        if self._extra[0] != e:
            sizes = self._sizes[self.documents.start : self.documents.stop]
            self._extra = (e, si.gpt_epoch(sizes, self.documents.start, self.seq_length, self.seed, e))
        return self._extra[1]

    def window(self, i: int) -> np.ndarray:
        """Sample ``i``'s ``seq_length + 1`` tokens (int64)."""
        if i < 0:
            raise IndexError(f"sample index must be >= 0, got {i}")
        e, j = divmod(int(i), self.num_windows)
        order, starts, shuffle = self._epoch(e)
        k, offset = (int(x) for x in starts[int(shuffle[j])])
        need, parts = self.seq_length + 1, []
        while need:
            doc = int(order[k])
            take = min(need, int(self._sizes[doc]) - offset)
            parts.append(self.data.get(doc, offset, take))
            need, k, offset = need - take, k + 1, 0
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        window = self.window(i)
        sample = {"ids": window[:-1], "labels": window[1:]}
        if self.boundaries:
            sample.update(document_keys(sample["ids"], sample["labels"], self.eod, **self.boundaries))
        return sample


class BertDataset:
    """Sentence-pair samples with SOP labels and MLM masking (see the module docstring).

    Sentences are the document's sequences when it has several (``preprocess --split-sentences``), else its
    pieces ending with ``newline``; a trailing EOD is not part of any sentence.

    Args:
        data: an ``IndexedDataset`` or a list of token arrays.
        seq_length: tokens per sample, ``[CLS] A [SEP] B [SEP]`` then padding.
        seed: pairing, order, swapping and masking.
        tokenizer: provides ``cls, sep, mask, pad`` ids, ``vocab_size`` and ``special_ids`` (never drawn as a random
            replacement token).
        newline: the id that ends a sentence (default: ``tokenizer.newline``).
        mask_prob: fraction of real tokens chosen for the MLM loss.
        documents: the range of documents to read (a split); default all.

    ``dataset[i]`` -> ``ids, token_types, mlm_labels`` (int64 ``[seq_length]``, labels -100 where not masked),
    ``padding_mask`` (bool ``[seq_length]``, True on padding), ``sop_labels`` (int64 scalar, 1 = swapped).

    Raises:
        ValueError: the tokenizer lacks cls/sep/mask/pad; no sentence boundaries (no sequences per sentence and no
            newline token); no document with two sentences.
        IndexError: a negative sample number.
    """

    def __init__(
        self,
        data,
        seq_length: int,
        seed: int,
        tokenizer,
        newline: int | None = None,
        mask_prob: float = 0.15,
        *,
        documents: range | None = None,
    ):
        tokenizer.require("cls", "sep", "mask", "pad", use="BERT")
        self.data = _as_source(data, None)
        self.documents = document_range(self.data, documents)
        self.seq_length, self.seed, self.tok, self.mask_prob = int(seq_length), int(seed), tokenizer, mask_prob
        self.special = dict(cls=tokenizer.cls, sep=tokenizer.sep, mask=tokenizer.mask, pad=tokenizer.pad)
        newline = getattr(tokenizer, "newline", None) if newline is None else newline
        eod = tokenizer.eod if tokenizer.has("eod") else None
        by_sequence = len(getattr(self.data, "sequence_sizes", self.data.sizes)) > len(self.data)
        if not by_sequence and newline is None:
            raise ValueError(
                f"BertDataset: tokenizer {tokenizer.name} has no newline token to cut documents into "
                "sentences; preprocess the data with --split-sentences"
            )
        sizes = np.asarray(self.data.sizes[self.documents.start : self.documents.stop])
        key = si.index_key(
            "bert",
            sizes,
            self.documents.start,
            self.documents.stop,
            self.seq_length,
            self.seed,
            by_sequence,
            newline,
            eod,
        )

        def sentences(doc):
            if by_sequence:
                lens = [len(s) for s in self.data.sentences(doc)]
                if lens and eod is not None and self.data.get(doc, int(self.data.sizes[doc]) - 1, 1)[0] == eod:
                    lens[-1] -= 1
            else:
                toks = self.data[doc]
                n = len(toks) - (len(toks) > 0 and eod is not None and toks[-1] == eod)
                ends = np.flatnonzero(np.asarray(toks[:n]) == newline) + 1
                lens = np.diff(np.concatenate([[0], ends, [n]]))
            return [x for x in lens if x > 0]

        idx, self.from_cache = si.load_or_build(
            self.data.prefix,
            "bert",
            key,
            ("pairs",),
            lambda: {"pairs": si.bert_pairs(sentences, self.documents, self.seq_length, self.seed)},
            lambda a: a["pairs"].ndim == 2 and a["pairs"].shape[1] == 5,
        )
        self.pairs = idx["pairs"]
        if len(self.pairs) == 0:
            raise ValueError("BertDataset: no document has two sentences to pair")
        self._order = Epochs(len(self.pairs), seed)
        self._normal = np.setdiff1d(np.arange(tokenizer.vocab_size), sorted(tokenizer.special_ids))

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        doc, a_off, a_len, b_off, b_len = (int(x) for x in self.pairs[self._order(i)])
        a, b = self.data.get(doc, a_off, a_len), self.data.get(doc, b_off, b_len)
        t, s = self.special, self.seq_length
        rng = _rng(self.seed, 0xBE27, i)
        swap = bool(rng.integers(0, 2))
        if swap:
            a, b = b, a
        ids = np.full(s, t["pad"], dtype=np.int64)
        types = np.zeros(s, dtype=np.int64)
        n = len(a) + len(b) + 3
        ids[0], ids[1 : len(a) + 1], ids[len(a) + 1] = t["cls"], a, t["sep"]
        ids[len(a) + 2 : n - 1], ids[n - 1] = b, t["sep"]
        types[len(a) + 2 : n] = 1
        labels = np.full(s, -100, dtype=np.int64)
        real = np.concatenate([np.arange(1, len(a) + 1), np.arange(len(a) + 2, n - 1)])
        chosen = real[rng.random(len(real)) < self.mask_prob]
        if len(chosen) == 0 and len(real):
            chosen = real[rng.integers(0, len(real), 1)]
        labels[chosen] = ids[chosen]
        action = rng.random(len(chosen))
        ids[chosen[action < 0.8]] = t["mask"]
        rand = chosen[(action >= 0.8) & (action < 0.9)]
        ids[rand] = self._normal[rng.integers(0, len(self._normal), len(rand))]
        return {
            "ids": ids,
            "token_types": types,
            "padding_mask": np.arange(s) >= n,
            "mlm_labels": labels,
            "sop_labels": np.int64(swap),
        }


def document_keys(
    ids: np.ndarray,
    labels: np.ndarray,
    eod: int,
    *,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
) -> dict[str, np.ndarray]:
    """The document keys (module docstring) of a sample with inputs ``ids`` and targets ``labels``, documents ending
    at each ``eod`` input: ``positions`` when ``reset_position_ids``, ``documents`` when ``reset_attention_mask``,
    and ``labels`` (a copy, -100 at EOD inputs) when ``eod_mask_loss``. Returns only the keys asked for."""
    ids = np.asarray(ids)
    out: dict[str, np.ndarray] = {}
    is_eod = ids == eod
    # document of token i = EODs strictly before i
    doc = np.zeros(len(ids), dtype=np.int64)
    np.cumsum(is_eod[:-1], out=doc[1:])
    if reset_position_ids:
        starts = np.flatnonzero(np.diff(doc, prepend=-1))  # the first token of each document in the sample
        out["positions"] = np.arange(len(ids), dtype=np.int64) - starts[doc]
    if reset_attention_mask:
        out["documents"] = doc.astype(np.int32)
    if eod_mask_loss:
        out["labels"] = np.where(is_eod, -100, labels).astype(np.int64)
    return out


def global_batch_indices(step: int, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> range:
    """Sample numbers of data-parallel rank ``dp_rank``'s share of global batch ``step`` (see module docstring)."""
    per = global_batch_size // dp_size
    start = step * global_batch_size + dp_rank * per
    return range(start, start + per)


def collate(samples: list[dict[str, np.ndarray]], device=None) -> dict[str, torch.Tensor]:
    """Stack samples into ``[b, ...]`` tensors on ``device``."""
    return {k: torch.as_tensor(np.stack([s[k] for s in samples])).to(device) for k in samples[0]}
