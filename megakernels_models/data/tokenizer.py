"""Tokenizers behind one interface: the embedded byte tokenizer, HuggingFace ``tokenizer.json`` files and
SentencePiece models. Nothing is ever downloaded: ``hf:`` and ``spm:`` name local files.

Every tokenizer has ``name`` (its spec, e.g. ``hf:/data/tokenizer.json``), ``vocab_size`` (ids are
``0..vocab_size-1``), ``encode(text) -> np.ndarray`` (unsigned ids, no special tokens added),
``decode(ids) -> str``, the special ids ``eod, pad, cls, sep, mask`` and ``newline`` (the id that encodes ``"\\n"``
on its own, used to cut documents into sentences for BERT; None when the tokenizer has none) and
``special_ids`` (every special/control id, never drawn as a random replacement token).

A file tokenizer finds its special ids among its own tokens by their usual spellings (``<|endoftext|>``, ``</s>``,
``[SEP]``, ``[CLS]``, ``[MASK]``, ``[PAD]``, ``<pad>``, ``<mask>``, ...). A role it lacks is only an error when it is
used: reading ``tok.mask`` (or ``tok.require("mask", ...)``) raises ``ValueError`` naming the tokenizer, the role and
the spellings looked for.
"""

from __future__ import annotations

import os

import numpy as np

ROLES = ("eod", "pad", "cls", "sep", "mask")

# Spellings looked up, in order of preference, for each role of a file tokenizer.
SPELLINGS = {
    "eod": ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<eod>", "[SEP]"),
    "pad": ("[PAD]", "<pad>", "<|pad|>", "<PAD>", "<|padding|>"),
    "cls": ("[CLS]", "<cls>", "<|cls|>", "<s>", "[BOS]"),
    "sep": ("[SEP]", "<sep>", "<|sep|>", "</s>"),
    "mask": ("[MASK]", "<mask>", "<|mask|>", "<MASK>"),
}


class _Specials:
    """Special-id roles as attributes that raise, naming what is missing, only when read."""

    name: str
    _ids: dict[str, int | None]

    def __getattr__(self, role: str):
        if role in ROLES:
            self.require(role)
            return self._ids[role]
        raise AttributeError(f"{type(self).__name__!s} has no attribute {role!r}")

    def has(self, role: str) -> bool:
        """Whether the tokenizer has a token for ``role`` (one of ``eod, pad, cls, sep, mask``)."""
        return self._ids.get(role) is not None

    def require(self, *roles: str, use: str = "this use") -> None:
        """Raises ``ValueError`` naming every role in ``roles`` that the tokenizer lacks (``use`` says who needs it)."""
        missing = [r for r in roles if self._ids.get(r) is None]
        if missing:
            looked = "; ".join(f"{r}: {' '.join(SPELLINGS[r])}" for r in missing)
            raise ValueError(
                f"tokenizer {self.name} has no {', '.join(missing)} token, which {use} needs (looked for {looked})"
            )


class ByteTokenizer:
    """Bytes as tokens: ids 0..255 are the bytes of the UTF-8 text, then five special tokens (vocabulary 261).

    Needs no files and never fails on any input (every byte string is representable), which makes it the tokenizer
    of the embedded default run and of tests. ``encode(str | bytes) -> np.ndarray[uint16]``; ``decode(ids) -> str``
    (invalid UTF-8 is replaced).
    """

    name = "byte"
    eod, pad, cls, sep, mask = 256, 257, 258, 259, 260
    newline = 10
    vocab_size = 261
    special_ids = frozenset(range(256, 261))

    def has(self, role: str) -> bool:
        return role in ROLES

    def require(self, *roles: str, use: str = "this use") -> None:
        pass

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        arr = np.asarray(ids).reshape(-1)
        return bytes(int(i) for i in arr if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def _ids_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


class HFTokenizer(_Specials):
    """A HuggingFace ``tokenizers`` tokenizer from a local ``tokenizer.json`` (or a folder holding one).

    Raises:
        FileNotFoundError: the file does not exist (the message names the path).
        ValueError: the file is not a tokenizer the library can read.
    """

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # the library raises its own exception types
            raise ValueError(f"cannot read HuggingFace tokenizer {path}: {e}") from None
        self.name, self.path = f"hf:{path}", path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._dtype = _ids_dtype(self.vocab_size)
        self._ids = {r: _first(self._tok.token_to_id, SPELLINGS[r]) for r in ROLES}
        added = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self.special_ids = frozenset(added | {i for i in self._ids.values() if i is not None})
        nl = self._tok.encode("\n", add_special_tokens=False).ids
        self.newline = nl[0] if len(nl) == 1 else None

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=self._dtype)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=self._dtype) for e in encs]

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, offsets)``: the ids (as ``encode``) and each token's character span in ``text`` (int64
        ``[n, 2]``, start and end)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return np.asarray(enc.ids, dtype=self._dtype), np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=False)


class SentencePieceTokenizer(_Specials):
    """A SentencePiece model file (``.model``). Its ``eos``/``pad``/``bos`` ids (when enabled) serve as EOD, PAD and
    (failing ``[CLS]``/``<cls>``) CLS; other roles are looked up among its pieces.

    SentencePiece normalises ``"\\n"`` to a space, so it usually has no ``newline``: preprocess BERT data with
    ``--split-sentences`` instead.

    Raises:
        FileNotFoundError: the file does not exist (the message names the path).
        ValueError: the file is not a SentencePiece model.
    """

    def __init__(self, path: str):
        import sentencepiece as spm

        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=path)
        except Exception as e:  # RuntimeError/OSError depending on the version
            raise ValueError(f"cannot read SentencePiece model {path}: {e}") from None
        sp = self._sp
        self.name, self.path = f"spm:{path}", path
        self.vocab_size = sp.get_piece_size()
        self._dtype = _ids_dtype(self.vocab_size)

        def lookup(piece: str) -> int | None:
            i = sp.piece_to_id(piece)
            return i if sp.id_to_piece(i) == piece and not sp.is_unknown(i) else None

        def own(i: int) -> int | None:
            return i if i >= 0 else None

        self._ids = {r: _first(lookup, SPELLINGS[r]) for r in ROLES}
        self._ids["eod"] = own(sp.eos_id()) if sp.eos_id() >= 0 else self._ids["eod"]
        self._ids["pad"] = own(sp.pad_id()) if sp.pad_id() >= 0 else self._ids["pad"]
        self._ids["cls"] = _first(lookup, ("[CLS]", "<cls>", "<|cls|>")) or own(sp.bos_id())
        self._ids["sep"] = _first(lookup, ("[SEP]", "<sep>", "<|sep|>")) or own(sp.eos_id())
        specials = {i for i in range(self.vocab_size) if sp.is_control(i) or sp.is_unknown(i)}
        self.special_ids = frozenset(specials | {i for i in self._ids.values() if i is not None})
        nl = sp.encode("\n")
        self.newline = nl[0] if len(nl) == 1 and sp.decode(nl) == "\n" else None

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.encode(text), dtype=self._dtype)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=self._dtype) for ids in self._sp.encode(texts)]

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in np.asarray(ids).reshape(-1)])


def _first(lookup, spellings) -> int | None:
    for s in spellings:
        i = lookup(s)
        if i is not None:
            return int(i)
    return None


def build_tokenizer(spec: str):
    """The tokenizer named by ``spec``: ``byte``, ``hf:PATH`` (a ``tokenizer.json`` or a folder holding one) or
    ``spm:PATH`` (a SentencePiece ``.model``).

    Raises:
        ValueError: an unknown spec (the message lists the accepted forms), or an unreadable file.
        FileNotFoundError: the file does not exist (the message names the path).
    """
    if spec == "byte":
        return ByteTokenizer()
    kind, _, path = str(spec).partition(":")
    if kind == "hf" and path:
        return HFTokenizer(path)
    if kind == "spm" and path:
        return SentencePieceTokenizer(path)
    raise ValueError(
        f"unknown tokenizer {spec!r}: expected byte, hf:PATH (a tokenizer.json) or spm:PATH (a SentencePiece .model)"
    )


def end_token(tok) -> int | None:
    """The id that ends a completion (a preference pair's, a sampled one's): the ``eos_token`` of the
    ``tokenizer_config.json`` beside a HuggingFace tokenizer's file, when its vocabulary holds it (a chat model's
    end of turn, as TRL and transformers' generation take it), else the end-of-document token, else None."""
    path = getattr(tok, "path", None)
    config = os.path.join(os.path.dirname(path), "tokenizer_config.json") if path else None
    if config and os.path.isfile(config):
        import json

        try:
            with open(config, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token")
        except (OSError, ValueError, AttributeError):
            eos = None
        if isinstance(eos, dict):
            eos = eos.get("content")
        i = tok._tok.token_to_id(eos) if isinstance(eos, str) and hasattr(tok, "_tok") else None
        if i is not None:
            return int(i)
    return int(tok.eod) if tok.has("eod") else None
