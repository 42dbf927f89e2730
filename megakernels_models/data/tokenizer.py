"""The byte-level tokenizer: ids 0..255 are the bytes of the UTF-8 text, then five special tokens.

Needs no files and never fails on any input (every byte string is representable), which makes it the tokenizer of
the embedded default run and of tests. Vocabulary: 261 (padded inside the model for GEMM shapes).
"""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
    """Bytes as tokens. ``encode(str | bytes) -> np.ndarray[uint16]``; ``decode(ids) -> str`` (invalid UTF-8 is
    replaced); special ids: ``eod``, ``pad``, ``cls``, ``sep``, ``mask``."""

    name = "byte"
    eod, pad, cls, sep, mask = 256, 257, 258, 259, 260
    vocab_size = 261

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        arr = np.asarray(ids)
        return bytes(int(i) for i in arr.reshape(-1) if 0 <= int(i) < 256).decode("utf-8", errors="replace")
