"""Sample indices: which tokens form sample ``i``, built once with numpy and cached beside the data.

GPT (one epoch ``e`` of a split of ``D`` documents holding ``T`` tokens, ``L`` = seq_length):

- ``doc_idx[e]``: the split's documents in a seeded random order (document ids, int64 ``[D]``);
- the documents of that order, concatenated, are cut into ``W = (T - 1) // L`` windows of ``L + 1`` tokens that
  start every ``L`` tokens (consecutive windows share one token; a window crosses document boundaries freely);
  ``sample_idx[e·W + w] = (k, offset)``: window ``w`` starts ``offset`` tokens into the ``k``-th document of the
  order (int64 ``[W, 2]`` per epoch);
- ``shuffle_idx[e·W + j]``: the window of the epoch's ``j``-th sample (a seeded permutation, int64 ``[W]``).

Epoch ``e`` depends only on (split sizes, L, seed, e), so the cached epochs and any epoch computed later on demand
agree: the samples never depend on ``num_samples`` or on the cache.

BERT: ``pairs``, int64 ``[P, 5]`` rows ``(document, a_offset, a_length, b_offset, b_length)``: two runs of
consecutive sentences of one document, truncated (longer one first) to fit ``[CLS] A [SEP] B [SEP]``.

Files are ``PREFIX.<kind>-<hash>.<name>.npy`` where the hash covers the kind, format, split range, seq_length,
seed, num_samples and the split's document sizes (so data preprocessed again never meets a stale index). They are
written to a temporary name and renamed (ranks racing to write write the same bytes); a missing, unreadable or
inconsistent file is rebuilt. A folder that cannot be written only means the index stays in memory.
"""

from __future__ import annotations

import hashlib
import os
import uuid
import warnings
from collections.abc import Callable

import numpy as np

FORMAT = 1
GPT_TAG, BERT_TAG = 0x6E7, 0x5E9


def rng(seed: int, *keys: int) -> np.random.Generator:
    """A generator determined by ``seed`` and ``keys`` (stable across runs, processes and machines)."""
    return np.random.default_rng([int(seed) & (2**63 - 1), *[int(k) for k in keys]])


def index_key(kind: str, sizes: np.ndarray, *params) -> str:
    """The hash naming an index of ``kind`` over documents of ``sizes`` built with ``params``."""
    h = hashlib.sha1(f"{kind}|{FORMAT}|{params!r}|".encode())
    h.update(np.ascontiguousarray(sizes, dtype="<i8").tobytes())
    return h.hexdigest()[:16]


def load_or_build(
    prefix: str | None,
    kind: str,
    key: str,
    names: tuple[str, ...],
    build: Callable[[], dict[str, np.ndarray]],
    check: Callable[[dict[str, np.ndarray]], bool],
) -> tuple[dict[str, np.ndarray], bool]:
    """Arrays ``names`` of the index ``kind``/``key`` of the data at ``prefix``: read (memory-mapped) from the
    ``.npy`` files when they all load and pass ``check``, else ``build()`` and saved (``prefix`` None: built, not
    saved). Returns the arrays and whether they came from the cache."""
    if prefix is not None:
        try:
            arrays = {n: np.load(index_path(prefix, kind, key, n), mmap_mode="r", allow_pickle=False) for n in names}
            if all(a.dtype == np.int64 for a in arrays.values()) and check(arrays):
                return arrays, True
        except (OSError, ValueError, EOFError):
            pass  # missing or unreadable: rebuild
    arrays = build()
    if prefix is not None:
        try:
            for n in names:
                _save(index_path(prefix, kind, key, n), arrays[n])
        except OSError as e:
            warnings.warn(
                f"cannot cache the {kind} sample index beside {prefix} ({e}); it stays in memory", stacklevel=2
            )
    return arrays, False


def index_path(prefix: str, kind: str, key: str, name: str) -> str:
    """``PREFIX.<kind>-<key>.<name>.npy``."""
    return f"{prefix}.{kind}-{key}.{name}.npy"


def _save(path: str, array: np.ndarray) -> None:
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            np.save(f, np.ascontiguousarray(array), allow_pickle=False)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# ---- GPT ------------------------------------------------------------------------------------------------------


def gpt_windows(sizes: np.ndarray, seq_length: int) -> int:
    """Windows per epoch: ``(T - 1) // seq_length`` for ``T = sizes.sum()`` tokens."""
    return max(0, (int(np.sum(sizes, dtype=np.int64)) - 1) // seq_length)


def gpt_epoch(sizes: np.ndarray, first_doc: int, seq_length: int, seed: int, epoch: int):
    """One epoch of the GPT index (module docstring) over documents ``first_doc .. first_doc + len(sizes) - 1``.

    Returns:
        ``doc_idx`` int64 ``[D]`` (document ids), ``sample_idx`` int64 ``[W, 2]``, ``shuffle_idx`` int64 ``[W]``.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    order = rng(seed, GPT_TAG, epoch).permutation(len(sizes))
    cum = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes[order], out=cum[1:])
    starts = np.arange(gpt_windows(sizes, seq_length), dtype=np.int64) * seq_length
    k = np.searchsorted(cum, starts, side="right") - 1  # the (non-empty) document holding each start
    sample_idx = np.stack([k, starts - cum[k]], axis=1)
    shuffle_idx = rng(seed, GPT_TAG, epoch, 1).permutation(len(starts)).astype(np.int64)
    return (order + first_doc).astype(np.int64), sample_idx, shuffle_idx


def gpt_index(sizes: np.ndarray, first_doc: int, seq_length: int, seed: int, epochs: int) -> dict[str, np.ndarray]:
    """Epochs ``0 .. epochs-1`` stacked: ``doc_idx [E, D]``, ``sample_idx [E·W, 2]``, ``shuffle_idx [E·W]``."""
    parts = [gpt_epoch(sizes, first_doc, seq_length, seed, e) for e in range(epochs)]
    return {
        "doc_idx": np.stack([p[0] for p in parts]),
        "sample_idx": np.concatenate([p[1] for p in parts]),
        "shuffle_idx": np.concatenate([p[2] for p in parts]),
    }


# ---- BERT -----------------------------------------------------------------------------------------------------


def truncate_pair(la: int, lb: int, budget: int) -> tuple[int, int]:
    """Lengths of A and B after dropping tokens from the end of the longer one (A on ties) until they fit."""
    excess = la + lb - budget
    if excess <= 0:
        return la, lb
    d = min(abs(la - lb), excess)
    if la >= lb:
        la -= d
    else:
        lb -= d
    excess -= d  # now la == lb: they lose tokens in turn, A first
    return la - (excess + 1) // 2, lb - excess // 2


def bert_pairs(sentences, docs: range, seq_length: int, seed: int) -> np.ndarray:
    """The pair index (module docstring). ``sentences(doc)`` gives a document's sentence lengths in order
    (int array; their offsets are the running sum). Sentences are taken greedily up to ``seq_length - 3`` tokens
    (at least two), cut in two at a random sentence boundary, then truncated to fit.

    Returns:
        int64 ``[P, 5]``: ``(document, a_offset, a_length, b_offset, b_length)``.
    """
    budget = seq_length - 3
    gen = rng(seed, BERT_TAG)
    rows = []
    for doc in docs:
        lens = [int(x) for x in sentences(doc)]
        offs = [0]
        for n in lens:
            offs.append(offs[-1] + n)
        i = 0
        while i + 1 < len(lens):
            j, size = i, 0
            while j < len(lens) and (size + lens[j] <= budget or j - i < 2):
                size += lens[j]
                j += 1
            cut = int(gen.integers(i + 1, j))
            la, lb = truncate_pair(offs[cut] - offs[i], offs[j] - offs[cut], budget)
            rows.append((doc, offs[i], la, offs[cut], lb))
            i = j
    return np.asarray(rows, dtype=np.int64).reshape(-1, 5)
