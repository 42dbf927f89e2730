"""The embedded default corpus: the Python standard library's ``.py`` files, present wherever Python is.

Documents are files, in sorted path order (the same on every rank and every run of one Python installation),
tokenized by the byte tokenizer. ``max_bytes`` caps the corpus for quick runs (whole files only).
"""

from __future__ import annotations

import functools
import os
import sysconfig

import numpy as np

from megakernels_models.data.tokenizer import ByteTokenizer


def stdlib_files() -> list[str]:
    """Sorted paths of the standard library's ``.py`` files (no site-packages, no tests)."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "dist-packages", "test", "tests",
                                                     "idle_test", "__pycache__"))
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
    docs, total = [], 0
    for path in stdlib_files():
        with open(path, "rb") as f:
            data = f.read()
        if not data.strip():
            continue
        if max_bytes is not None and total + len(data) > max_bytes:
            break
        docs.append(tok.encode(data))
        total += len(data)
    if not docs:
        raise RuntimeError(f"no Python sources under {sysconfig.get_paths()['stdlib']!r} for the default corpus; "
                           "pass --data")
    return tuple(docs)
