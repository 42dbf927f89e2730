"""The embedded default corpus: the Python standard library's ``.py`` files, present wherever Python is.

Documents are files, in sorted path order (the same on every rank and every run of one Python installation),
tokenized by the byte tokenizer, each ending with EOD. ``max_bytes`` caps the corpus for quick runs (whole files
only: the longest prefix of the sorted list that fits).

``stdlib_prefix(max_bytes)`` preprocesses it once into the cache folder (``$MEGAKERNELS_CACHE``, else
``~/.cache/megakernels``) and returns the prefix to open as an ``IndexedDataset`` like any other data. Each entry
is a folder named by the Python version, the library's path and the cap; it is built in a temporary folder and
renamed into place, which is atomic and fails if the folder already exists: of ranks racing to build it, one wins
and the others discard their copy and read the winner's.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import sysconfig
import uuid

import numpy as np

from megakernels_models.data.indexed import IndexedDataset, IndexedDatasetWriter
from megakernels_models.data.tokenizer import ByteTokenizer

CACHE_FORMAT = 1


def stdlib_files() -> list[str]:
    """Sorted paths of the standard library's ``.py`` files (no site-packages, no tests)."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(
            x for x in dirs if x not in ("site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__")
        )
        out.extend(os.path.join(d, f) for f in files if f.endswith(".py"))
    return sorted(out)


def stdlib_documents(max_bytes: int | None = 32 << 20) -> list[np.ndarray]:
    """Byte-tokenizer arrays of the standard library's files, at most ``max_bytes`` bytes in all (None: no cap).
    The arrays are shared between calls (cached): do not modify them.

    Raises:
        RuntimeError: no source files found (a Python installed without its library sources).
    """
    return list(_documents(max_bytes))


@functools.lru_cache(maxsize=2)
def _documents(max_bytes: int | None) -> tuple[np.ndarray, ...]:
    tok = ByteTokenizer()
    return tuple(tok.encode(data) for data in _file_bytes(max_bytes))


def _file_bytes(max_bytes: int | None):
    """Contents of the non-blank library files in order, stopping before the first that would pass the cap."""
    total = 0
    for path in stdlib_files():
        with open(path, "rb") as f:
            data = f.read()
        if not data.strip():
            continue
        if max_bytes is not None and total + len(data) > max_bytes:
            break
        total += len(data)
        yield data
    if total == 0:
        raise RuntimeError(
            f"no Python sources under {sysconfig.get_paths()['stdlib']!r} for the default corpus; pass --data"
        )


def cache_dir() -> str:
    """``$MEGAKERNELS_CACHE`` if set, else ``~/.cache/megakernels`` (``megakernels.host.cache_dir``)."""
    from megakernels.host import cache_dir as folder

    return folder()


def stdlib_prefix(max_bytes: int | None = 32 << 20, root: str | None = None) -> str:
    """The prefix (``.../data``) of the default corpus preprocessed into the cache (built on first use).

    Args:
        max_bytes: the cap of ``stdlib_documents`` (None: the whole library).
        root: the cache folder (default ``cache_dir()``).

    Raises:
        RuntimeError: no source files found.
        OSError: the cache folder cannot be written.
    """
    root = root or cache_dir()
    key = f"{CACHE_FORMAT}|{sys.version_info[:3]}|{sysconfig.get_paths()['stdlib']}|{max_bytes}"
    ver = "{}.{}".format(*sys.version_info[:2])
    entry = os.path.join(root, f"stdlib-py{ver}-{max_bytes}-{hashlib.sha1(key.encode()).hexdigest()[:12]}")
    prefix = os.path.join(entry, "data")
    if _published(entry):
        return prefix
    os.makedirs(root, exist_ok=True)
    tmp = f"{entry}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    try:
        tok = ByteTokenizer()
        with IndexedDatasetWriter(os.path.join(tmp, "data"), tok.vocab_size) as w:
            for data in _file_bytes(max_bytes):
                w.add_document([np.append(tok.encode(data), np.uint16(tok.eod))])
            w.finish()
        IndexedDataset(os.path.join(tmp, "data"))  # what is published must read back
        try:
            os.rename(tmp, entry)
        except OSError:
            if not os.path.isdir(entry):  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return prefix


def _published(entry: str) -> bool:
    return os.path.isdir(entry)
