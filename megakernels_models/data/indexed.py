"""The indexed dataset: token ids on disk (``PREFIX.bin``) and where each document is (``PREFIX.idx``).

``PREFIX.bin`` is every sequence's token ids back to back, in one unsigned dtype (the smallest that holds the
vocabulary: uint8, uint16 or uint32), nothing else. A document is one or more consecutive sequences (one per
document, or one per sentence when preprocessed with ``--split-sentences``). ``PREFIX.idx`` (little-endian):

=======  =========================================================================================
bytes    field
=======  =========================================================================================
8        magic ``b"MKIDX\\x00\\x00\\x01"``
4        format version (uint32, 1)
4        dtype code (uint32: 1 uint8, 2 uint16, 4 uint32)
8        vocabulary size of the tokenizer that wrote it (uint64)
8        number of sequences S (uint64)
8        number of documents D (uint64)
4·S      sequence lengths in tokens (int32)
8·S      sequence offsets in tokens from the start of ``.bin`` (int64)
8·(D+1)  document boundaries: the index of each document's first sequence, then S (int64)
=======  =========================================================================================

The reader checks all of it on open (and that the ``.bin`` holds exactly the tokens the index describes), so a
truncated, corrupt or mismatched pair raises ``DataError`` naming the file and the broken rule instead of handing
out garbage tokens. It also checks that every token id is inside the vocabulary the header records: an id past it
would index past the model's embedding (an IndexError deep in a step, or silently another row where the table is
padded). The index does not record the largest id, so the ``.bin`` is scanned once (chunked, through the memory
map) and the result cached beside it in ``PREFIX.maxid.json``, keyed by the ``.bin``'s size, modification time
and inode (written atomically; a folder that cannot be written only means the next open scans again). A dtype that
cannot hold an id past the vocabulary (uint8 for 256 ids) needs no scan. The writer streams tokens to temporary
files and publishes them by renaming only when complete.
"""

from __future__ import annotations

import json
import os
import struct
import uuid

import numpy as np

MAGIC = b"MKIDX\x00\x00\x01"
VERSION = 1
_HEADER = struct.Struct("<8sIIQQQ")
DTYPES = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32)}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
MAXID_FORMAT = 1
_SCAN_CHUNK = 1 << 24  # tokens per step of the vocabulary scan (16-64 MiB of the memory map)


class DataError(ValueError):
    """A dataset file that is truncated, corrupt, inconsistent with its pair or holds token ids outside its
    vocabulary (the message names the file and the broken rule)."""


def best_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds ids ``0..vocab_size-1`` (uint8, uint16 or uint32).

    Raises:
        ValueError: ``vocab_size`` < 1 or > 2**32.
    """
    if not 1 <= vocab_size <= 1 << 32:
        raise ValueError(f"vocab_size must be in 1..2**32, got {vocab_size}")
    return next(d for d in DTYPES.values() if vocab_size <= 1 << (8 * d.itemsize))


def paths(prefix: str) -> tuple[str, str]:
    """``(PREFIX.bin, PREFIX.idx)``."""
    return prefix + ".bin", prefix + ".idx"


def exists(prefix: str) -> bool:
    """Whether both files of ``prefix`` exist (not whether they are valid)."""
    return all(os.path.isfile(p) for p in paths(prefix))


class IndexedDataset:
    """Read-only documents of ``PREFIX.bin``/``PREFIX.idx`` through ``numpy.memmap`` (see the module docstring).

    ``ds[d]`` is document ``d``'s tokens (a read-only view, the file's dtype); ``get(d, offset, length)`` a slice of
    it; ``sizes`` the documents' lengths (int64 ``[D]``); ``doc_offsets`` where each document starts in the token
    stream (int64 ``[D+1]``, the last is the total); ``sequence_sizes`` / ``sequence_offsets`` / ``doc_index`` the
    raw per-sequence arrays. Documents are contiguous, so documents ``a..b-1`` are tokens
    ``doc_offsets[a]..doc_offsets[b]`` (``tokens(start, stop)``).

    Raises:
        FileNotFoundError: ``PREFIX.bin`` or ``PREFIX.idx`` missing (the message names it).
        DataError: either file is truncated, corrupt or does not match the other, or a token id is outside the
            vocabulary (named, with the rule; for an id its value, token offset and document).
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.bin_path, self.idx_path = paths(prefix)
        for p in (self.idx_path, self.bin_path):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"indexed dataset file not found: {p}")
        self._read_index()
        n_tokens = int(self.sequence_offsets[-1] + self.sequence_sizes[-1]) if len(self.sequence_sizes) else 0
        nbytes = os.path.getsize(self.bin_path)
        if nbytes != n_tokens * self.dtype.itemsize:
            raise DataError(
                f"{self.bin_path}: holds {nbytes} bytes but {self.idx_path} describes {n_tokens} "
                f"{self.dtype.name} tokens = {n_tokens * self.dtype.itemsize} bytes (truncated or from "
                "another run)"
            )
        self._tokens = (
            np.memmap(self.bin_path, dtype=self.dtype, mode="r") if n_tokens else np.zeros(0, dtype=self.dtype)
        )
        # a document of no sequences (the writer never makes one; the format allows it) starts where the next does
        starts = np.append(self.sequence_offsets, n_tokens)[self.doc_index[:-1]]
        self.doc_offsets = np.append(starts, n_tokens).astype(np.int64)
        self.sizes = np.diff(self.doc_offsets)
        self.num_tokens = n_tokens
        self._check_token_ids()

    def _check_token_ids(self) -> None:
        """Every id < ``vocab_size`` (see the module docstring: the scan and its cache)."""
        if not self.num_tokens or self.vocab_size >= 1 << (8 * self.dtype.itemsize):
            return
        top, at = max_token_id(self.bin_path, self._tokens)
        if top >= self.vocab_size:
            doc = int(np.searchsorted(self.doc_offsets, at, side="right")) - 1
            raise DataError(
                f"{self.bin_path}: token id {top} at token {at} (document {doc}) is outside the "
                f"vocabulary 0..{self.vocab_size - 1} that {self.idx_path} records (corrupt, or written "
                "with another tokenizer)"
            )

    def _read_index(self) -> None:
        path = self.idx_path
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
            if len(head) < _HEADER.size:
                raise DataError(f"{path}: {len(head)} bytes is shorter than the {_HEADER.size}-byte header")
            magic, version, code, vocab, n_seq, n_doc = _HEADER.unpack(head)
            if magic != MAGIC:
                raise DataError(
                    f"{path}: wrong magic bytes {magic!r} (expected {MAGIC!r}): not a megakernels index file"
                )
            if version != VERSION:
                raise DataError(
                    f"{path}: format version {version} is not supported (this reader reads version {VERSION})"
                )
            if code not in DTYPES:
                raise DataError(f"{path}: dtype code {code} is unknown (expected one of {sorted(DTYPES)})")
            want = _HEADER.size + 12 * n_seq + 8 * (n_doc + 1)
            size = os.fstat(f.fileno()).st_size
            if size != want:
                raise DataError(
                    f"{path}: {size} bytes, but its header ({n_seq} sequences, {n_doc} documents) "
                    f"needs exactly {want} (truncated or corrupt)"
                )
            sizes = np.fromfile(f, dtype="<i4", count=n_seq).astype(np.int64)
            offsets = np.fromfile(f, dtype="<i8", count=n_seq)
            doc_index = np.fromfile(f, dtype="<i8", count=n_doc + 1)
        if n_seq and (sizes.min() < 0 or offsets[0] != 0 or np.any(offsets[1:] != offsets[:-1] + sizes[:-1])):
            raise DataError(f"{path}: sequence offsets are not the running sum of the sequence lengths (corrupt index)")
        if doc_index[0] != 0 or doc_index[-1] != n_seq or np.any(np.diff(doc_index) < 0):
            raise DataError(
                f"{path}: document boundaries must rise from 0 to the number of sequences {n_seq} (corrupt index)"
            )
        if vocab < 1:
            raise DataError(f"{path}: records a vocabulary of {vocab} ids (corrupt index)")
        self.dtype, self.vocab_size, self.doc_count = DTYPES[code], int(vocab), int(n_doc)
        self.sequence_sizes, self.sequence_offsets, self.doc_index = sizes, offsets, doc_index

    def __len__(self) -> int:
        return self.doc_count

    def __getitem__(self, doc: int) -> np.ndarray:
        if not 0 <= doc < self.doc_count:
            raise IndexError(f"document {doc} out of range 0..{self.doc_count - 1} of {self.prefix}")
        return self._tokens[self.doc_offsets[doc] : self.doc_offsets[doc + 1]]

    def get(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset .. offset+length`` of document ``doc`` (to its end when ``length`` is None).

        Raises:
            IndexError: ``doc`` out of range, or the slice runs outside the document.
        """
        d = self[doc]
        end = len(d) if length is None else offset + length
        if not 0 <= offset <= end <= len(d):
            raise IndexError(f"slice {offset}..{end} is outside document {doc} of {len(d)} tokens")
        return d[offset:end]

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``start .. stop`` of the whole stream (a view of the memory map)."""
        return self._tokens[start:stop]

    def sentences(self, doc: int) -> list[np.ndarray]:
        """Document ``doc``'s sequences (its sentences when preprocessed with ``--split-sentences``)."""
        a, b = self.doc_index[doc], self.doc_index[doc + 1]
        return [self._tokens[o : o + s] for o, s in zip(self.sequence_offsets[a:b], self.sequence_sizes[a:b])]


def max_token_id(bin_path: str, tokens: np.ndarray) -> tuple[int, int]:
    """``(largest id, its first token offset)`` of ``tokens`` (the memory map of ``bin_path``), from the cache
    ``bin_path``'s prefix + ``.maxid.json`` when it matches the file's size and modification time, else by one
    chunked scan whose result is cached (atomically; not at all where the folder cannot be written)."""
    st = os.stat(bin_path)
    # the inode too: a pair published again by renaming (the writer) within one tick of a coarse clock
    key = {"format": MAXID_FORMAT, "bin_size": st.st_size, "bin_mtime_ns": st.st_mtime_ns, "bin_inode": st.st_ino}
    cache = bin_path[: -len(".bin")] + ".maxid.json" if bin_path.endswith(".bin") else bin_path + ".maxid.json"
    try:
        with open(cache, encoding="utf-8") as f:
            got = json.load(f)
        if isinstance(got, dict) and all(got.get(k) == v for k, v in key.items()):
            top, at = got["max_id"], got["offset"]
            if isinstance(top, int) and isinstance(at, int) and 0 <= at < len(tokens):
                return top, at
    except (OSError, ValueError, KeyError):
        pass  # missing or unreadable: scan
    top, at = -1, 0
    for start in range(0, len(tokens), _SCAN_CHUNK):
        chunk = tokens[start : start + _SCAN_CHUNK]
        m = int(chunk.max())
        if m > top:
            top, at = m, start + int(np.argmax(chunk))
    tmp = f"{cache}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({**key, "max_id": top, "offset": at}, f)
        os.replace(tmp, cache)
    except OSError:
        try:
            os.remove(tmp)
        except OSError:
            pass
    return top, at


class IndexedDatasetWriter:
    """Streams documents to ``PREFIX.bin``/``PREFIX.idx`` through temporary files in the same folder.

    ``add_document(sequences)`` appends one document (a list of token arrays, one per sequence); ``finish()``
    writes the index and publishes both files by renaming (the old ``PREFIX.idx`` is removed first, so a run
    interrupted between the two renames leaves no index that could pair with the wrong ``.bin``). Leaving the
    ``with`` block without ``finish()`` (an exception, an interrupt) removes the temporary files. Memory use is
    independent of the corpus size except for the index itself (12 bytes per sequence, 8 per document).

    Raises:
        ValueError: a token id >= ``vocab_size`` (from ``add_document``).
    """

    def __init__(self, prefix: str, vocab_size: int):
        self.prefix, self.vocab_size, self.dtype = prefix, int(vocab_size), best_dtype(vocab_size)
        folder = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(folder, exist_ok=True)
        tag = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._tmp = tuple(p + tag for p in paths(prefix))
        self._bin = open(self._tmp[0], "wb")
        self._sizes: list[int] = []
        self._docs = [0]
        self.num_tokens = 0

    def add_document(self, sequences: list[np.ndarray]) -> None:
        seqs = [np.asarray(s) for s in sequences if len(s)]
        if not seqs:
            return
        for s in seqs:
            lo, hi = int(s.min()), int(s.max())
            if lo < 0 or hi >= self.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"token id {bad} is outside the vocabulary 0..{self.vocab_size - 1}")
            s = s.astype(self.dtype, copy=False)
            self._bin.write(s.tobytes())
            self._sizes.append(len(s))
            self.num_tokens += len(s)
        self._docs.append(len(self._sizes))

    @property
    def doc_count(self) -> int:
        return len(self._docs) - 1

    @property
    def sequence_count(self) -> int:
        return len(self._sizes)

    def finish(self) -> None:
        """Write the index, flush both files to disk and rename them to ``PREFIX.bin``/``PREFIX.idx``."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        sizes = np.asarray(self._sizes, dtype="<i8")
        if len(sizes) and sizes.max() >= 1 << 31:
            raise ValueError(f"a sequence of {int(sizes.max())} tokens is too long for the index (< 2**31)")
        offsets = np.zeros(len(sizes), dtype="<i8")
        np.cumsum(sizes[:-1], out=offsets[1:])
        with open(self._tmp[1], "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, DTYPE_CODES[self.dtype], self.vocab_size, len(sizes), self.doc_count))
            f.write(sizes.astype("<i4").tobytes())
            f.write(offsets.tobytes())
            f.write(np.asarray(self._docs, dtype="<i8").tobytes())
            f.flush()
            os.fsync(f.fileno())
        final_bin, final_idx = paths(self.prefix)
        if os.path.exists(final_idx):
            os.remove(final_idx)
        os.replace(self._tmp[0], final_bin)
        os.replace(self._tmp[1], final_idx)

    def abort(self) -> None:
        """Close and remove the temporary files (the published files, if any, are left as they were)."""
        if not self._bin.closed:
            self._bin.close()
        for p in self._tmp:
            if os.path.exists(p):
                os.remove(p)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.abort()  # after finish() there is nothing left to remove
