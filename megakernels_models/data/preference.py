"""Preference pairs for direct preference optimisation: ``{"prompt", "chosen", "rejected"}`` JSONL -> token
sequences with completion masks (``megakernels preprocess --preference``), and ``PreferenceDataset``, the pairs
packed whole into samples (``megakernels train --dpo``).

Input: JSONL files, one pair a line, in one of TRL's two forms (other keys are ignored):

- standard: ``prompt``, ``chosen`` and ``rejected`` are strings. The chosen sequence is the text ``prompt +
  chosen`` tokenised whole, then the end token (``tokenizer.end_token``: the tokenizer directory's ``eos_token``,
  else its end-of-document token) unless the text already ends with it; its completion starts after the longest
  common prefix of those tokens with the tokens of ``prompt`` alone (where a token merges across the boundary, the
  completion starts at the merged token, as TRL does). The rejected sequence likewise.
- conversational: each is a list of messages ``{"role", "content"}`` (the prompt's last one usually a user
  message, each completion holding at least one assistant message). The chosen sequence is ``prompt + chosen``
  rendered with the checkpoint's chat template exactly as ``--chat`` renders conversations (``data/chat.py``) and
  tokenised whole; its completion runs from the start of the first completion message's assistant span (chat.py's
  rules: the template's generation blocks, or the prefix rule) to the end of the rendering (the template's end of
  turn included). Needs ``--tokenizer DIR`` with a chat template.

A token is a target (its mask 1) when it belongs to the completion. A pair whose chosen or rejected sequence has
no target is refused, naming its line. Storage: a masked dataset of kind ``preference`` (``chat.masked_writer``):
``PREFIX.bin``/``.idx`` hold the sequences, pair ``k``'s chosen as document ``2k`` and its rejected as ``2k + 1``;
``PREFIX.mask.bin``/``.idx`` the masks; ``PREFIX.preference.json`` what was written.

Samples (``PreferenceDataset``): ``seq_length + 1`` tokens holding whole pairs, best-fit decreasing by the pair's
length (``sft.pack``; ties in a seeded order), each pair's chosen sequence then its rejected one. A pair longer than
a sample is truncated first, tokens dropped from the end of the longer sequence until both fit
(``sample_index.truncate_pair``); a pair left without a target in one of its sequences is dropped (counted, with a
warning). The sample keys are SFT's (``sft.packed_sample``): ``ids``, ``labels`` (-100 on prompts, on each
sequence's first token and on padding), ``positions`` restarting per sequence, and ``documents``: pair ``j`` of the
sample is documents ``2j`` (chosen) and ``2j + 1`` (rejected), the padding the next number. Each sequence sees only
itself (its document), exactly as if it were alone in a sample.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable, Iterator

import numpy as np

from megakernels_models.data import sample_index as si
from megakernels_models.data.chat import ChatIndexed, check_messages, masked_writer, write_meta
from megakernels_models.data.datasets import Epochs, document_range
from megakernels_models.data.indexed import DataError
from megakernels_models.data.sft import pack, packed_sample

KIND = "preference"
FIELDS = ("prompt", "chosen", "rejected")


def is_preference(prefix: str) -> bool:
    """Whether ``prefix`` is preference data (its ``PREFIX.preference.json`` exists)."""
    from megakernels_models.data.chat import meta_path

    return os.path.isfile(meta_path(prefix, KIND))


# ---- reading the JSONL ---------------------------------------------------------------------------------------------


def read_pairs(path: str) -> Iterator[tuple[int, object, object, object]]:
    """``(line number, prompt, chosen, rejected)`` of each non-blank line of ``path``: three strings, or three
    checked message lists (module docstring).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line that is not a JSON object with the three fields in one form (``path:line: rule``).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--preference {path}: no such file")
    with open(path, encoding="utf-8") as f:
        lineno = 0
        try:
            for lineno, line in enumerate(f, 1):  # noqa: B007 (read in the except)
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not a JSON object ({e.msg} at column {e.colno})") from None
                yield (lineno, *check_pair(obj, f"{path}:{lineno}"))
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}:{lineno + 1}: not UTF-8 text ({e.reason})") from None


def check_pair(obj, where: str) -> tuple[object, object, object]:
    """The ``(prompt, chosen, rejected)`` of one pair object, checked (``where`` prefixes the error)."""
    if not isinstance(obj, dict) or any(k not in obj for k in FIELDS):
        got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f'{where}: expected {{"prompt": ..., "chosen": ..., "rejected": ...}}, got {got}')
    prompt, chosen, rejected = (obj[k] for k in FIELDS)
    if all(isinstance(v, str) for v in (prompt, chosen, rejected)):
        for name, v in (("chosen", chosen), ("rejected", rejected)):
            if not v.strip():
                raise ValueError(f"{where}: {name} is empty (nothing to compare)")
        return prompt, chosen, rejected
    if not all(isinstance(v, list) for v in (prompt, chosen, rejected)):
        kinds = ", ".join(f"{k} {type(obj[k]).__name__}" for k in FIELDS)
        raise ValueError(
            f"{where}: prompt, chosen and rejected must be three strings or three lists of messages, got {kinds}"
        )
    out = [prompt]
    for name, completion in (("chosen", chosen), ("rejected", rejected)):
        if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in completion):
            raise ValueError(f"{where}: {name} has no assistant message (nothing to compare)")
        whole = check_messages({"messages": prompt + completion}, f"{where} (prompt + {name})")
        out.append(whole[len(prompt) :])
    out[0] = whole[: len(prompt)]
    return tuple(out)


# ---- tokenising ----------------------------------------------------------------------------------------------------


class PairEncoder:
    """Pairs -> ``(ids, mask)`` of their chosen and rejected sequences (module docstring), with the tokenizer of
    ``tokenizer`` (``byte``, ``hf:PATH``, ``spm:PATH``, or a HuggingFace tokenizer directory, which conversational
    pairs need for its chat template). ``vocab_size``, ``name``, ``template`` (the ``ChatTemplate`` once a
    conversational pair needed it) and ``rules`` (how completions were located) describe what it did.

    Raises:
        FileNotFoundError, ValueError: the tokenizer cannot be read (named).
    """

    def __init__(self, tokenizer: str):
        from megakernels_models.data.tokenizer import build_tokenizer, end_token

        spec = tokenizer
        self.directory = spec[3:] if spec.startswith("hf:") and os.path.isdir(spec[3:]) else spec
        if os.path.isdir(self.directory):
            spec = f"hf:{self.directory}"
        elif spec != "byte" and ":" not in spec:
            raise FileNotFoundError(
                f"--tokenizer {tokenizer}: not a directory, nor byte, hf:PATH or spm:PATH (a HuggingFace tokenizer "
                "directory renders conversational pairs with its chat template)"
            )
        self.tok = build_tokenizer(spec)
        self.name, self.vocab_size = self.tok.name, self.tok.vocab_size
        self.end = end_token(self.tok)
        self.template, self.rules = None, set()

    def _chat(self):
        from megakernels_models.data.chat import ChatTemplate

        if self.template is None:
            if not os.path.isdir(self.directory):
                raise ValueError(
                    f"conversational pairs are rendered with a chat template: give --tokenizer DIR (a HuggingFace "
                    f"tokenizer directory with one), not {self.name}"
                )
            self.template = ChatTemplate(self.directory)
            if self.template.vocab_size != self.vocab_size:
                raise ValueError(f"{self.directory}: the chat template's tokenizer is not --tokenizer's")
        return self.template

    def encode(self, prompt, completion) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, mask)`` of ``prompt + completion`` (both strings, or both message lists), 1 on the completion."""
        if isinstance(prompt, str):
            ids = np.asarray(self.tok.encode(prompt + completion), dtype=np.int64)
            if self.end is not None and (len(ids) == 0 or ids[-1] != self.end):
                ids = np.append(ids, self.end)
            alone = np.asarray(self.tok.encode(prompt), dtype=np.int64)
            n = min(len(alone), len(ids))
            start = n if np.array_equal(alone[:n], ids[:n]) else int(np.argmin(alone[:n] == ids[:n]))
            mask = np.zeros(len(ids), dtype=np.uint8)
            mask[start:] = 1
            self.rules.add("text")
            return ids, mask
        template = self._chat()
        messages = prompt + completion
        text, spans, rule = template.message_spans(messages)
        starts = [a for i, a, _ in spans if i is not None and i >= len(prompt)]
        if not starts:
            raise ValueError(
                f"the chat template ({template.origin}) gives no assistant span for the completion's messages (its "
                "generation blocks do not match the assistant messages one to one)"
            )
        self.rules.add(rule)
        return template.tokens(text, [(min(starts), len(text))])


def preprocess_preference(
    files: Iterable[str], output_prefix: str, tokenizer: str, seq_length: int | None = None
) -> dict:
    """Write the preference dataset ``output_prefix`` (module docstring) from the JSONL ``files``.

    Returns ``pairs, tokens, completion_tokens, longest`` (the longest pair, chosen + rejected), ``rule``,
    ``vocab_size``, ``tokenizer`` and, with ``seq_length``, ``packing`` (``sft.packing_stats`` of the pairs'
    lengths at that sequence length).

    Raises:
        FileNotFoundError: a missing input or tokenizer.
        ValueError: bad input (naming the file and line), no pairs, no template for conversational pairs, a
            template error.
    """
    files = list(files)
    for path in files:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--preference {path}: no such file")
    enc = PairEncoder(tokenizer)
    sizes, targets = [], 0
    with masked_writer(output_prefix, enc.vocab_size) as add:
        for path in files:
            for lineno, prompt, chosen, rejected in read_pairs(path):
                pair = []
                for name, completion in (("chosen", chosen), ("rejected", rejected)):
                    try:
                        ids, mask = enc.encode(prompt, completion)
                    except ValueError as e:
                        raise ValueError(f"{path}:{lineno}: {e}") from None
                    except Exception as e:  # jinja2's errors, raise_exception in the template
                        raise ValueError(
                            f"{path}:{lineno}: the chat template failed: {type(e).__name__}: {e}"
                        ) from None
                    if not mask[1:].any():
                        raise ValueError(f"{path}:{lineno}: {name} has no completion token after tokenisation")
                    pair.append((ids, mask))
                for ids, mask in pair:
                    add(ids, mask)
                    targets += int(mask[1:].sum())
                sizes.append((len(pair[0][0]), len(pair[1][0])))
        if not sizes:
            raise ValueError(f"--preference {' '.join(files)}: no pairs")
    lengths = np.asarray(sizes, dtype=np.int64).sum(1)
    stats = {
        "pairs": len(sizes),
        "tokens": int(lengths.sum()),
        "completion_tokens": targets,
        "longest": int(lengths.max()),
        "rule": "+".join(sorted(enc.rules)),
        "vocab_size": enc.vocab_size,
        "tokenizer": enc.name,
        "template": enc.template.origin if enc.template is not None else None,
        "inputs": [os.path.abspath(p) for p in files],
    }
    stats = write_meta(output_prefix, KIND, stats)
    if seq_length is not None:
        from megakernels_models.data.sft import packing_stats

        stats["packing"] = packing_stats(lengths, seq_length)
    return stats


# ---- reading the dataset -------------------------------------------------------------------------------------------


class PreferenceIndexed(ChatIndexed):
    """A preference dataset (module docstring): ``ChatIndexed``'s interface over its sequences, and ``pairs`` (the
    number of pairs) with ``pair_sizes`` (int64 ``[pairs, 2]``: chosen and rejected lengths).

    Raises:
        FileNotFoundError, DataError: as ``ChatIndexed``; an odd number of sequences.
    """

    KIND, MADE_BY = KIND, "megakernels preprocess --preference"

    def __init__(self, prefix: str):
        super().__init__(prefix)
        if self.doc_count % 2:
            raise DataError(f"{prefix}: {self.doc_count} sequences, not chosen/rejected pairs")
        self.pairs = self.doc_count // 2
        self.pair_sizes = np.asarray(self.sizes, dtype=np.int64).reshape(-1, 2)


class InMemoryPreference:
    """Pairs as ``((chosen ids, mask), (rejected ids, mask))`` behind ``PreferenceIndexed``'s reading interface
    (tests)."""

    prefix = None
    meta: dict = {}

    def __init__(self, pairs):
        self._s = [(np.asarray(i, dtype=np.int64), np.asarray(m, dtype=np.uint8)) for p in pairs for i, m in p]
        self.sizes = np.array([len(i) for i, _ in self._s], dtype=np.int64)
        self.doc_count, self.pairs = len(self._s), len(self._s) // 2
        self.pair_sizes = self.sizes.reshape(-1, 2)

    def __len__(self) -> int:
        return self.doc_count

    def get(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        d = self._s[doc][0]
        return d[offset : len(d) if length is None else offset + length]

    def get_mask(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        d = self._s[doc][1]
        return d[offset : len(d) if length is None else offset + length]


class PreferenceDataset:
    """Preference samples (module docstring).

    Args:
        data: a ``PreferenceIndexed`` (or ``InMemoryPreference``).
        seq_length: tokens per sample (each holds ``seq_length + 1``).
        seed: the packing's ties and each epoch's order.
        pad: the id of padding tokens.
        pairs: the range of pairs to read (a split); default all.
        packed: pack several pairs a sample (True) or one a sample, padded (False).

    ``dataset[i]`` -> ``ids``, ``labels``, ``positions`` (int64 ``[seq_length]``), ``documents`` (int32
    ``[seq_length]``). ``len`` is the samples of one epoch; ``index(i)`` the packed sample (``0..len-1``) that
    sample number ``i`` reads, ``sample(k)`` packed sample ``k``; ``pairs_of(k)`` its pairs; ``stats`` the
    packing's (``pairs``, ``samples``, ``tokens``, ``capacity``, ``efficiency``, ``truncated``, ``dropped``).

    Raises:
        ValueError: no pair with a target in both sequences; a bad range; ``seq_length`` < 3.
        IndexError: a negative sample number.
    """

    def __init__(
        self, data, seq_length: int, seed: int, pad: int = 0, *, pairs: range | None = None, packed: bool = True
    ):
        if int(seq_length) < 3:
            raise ValueError(
                f"PreferenceDataset: seq_length must be >= 3 (a pair of two tokens each), got {seq_length}"
            )
        self.data, self.seq_length, self.seed = data, int(seq_length), int(seed)
        self.pad, self.packed = int(pad), bool(packed)
        self.pairs = document_range(range(data.pairs), pairs)
        cap = self.seq_length + 1
        sizes = np.asarray(data.pair_sizes[self.pairs.start : self.pairs.stop], dtype=np.int64)
        meta = json.dumps(getattr(data, "meta", {}), sort_keys=True)
        key = si.index_key("preference", sizes, self.pairs.start, self.pairs.stop, cap, self.seed, self.packed, meta)

        def build():
            kept, used = [], []
            for p in self.pairs:
                lc, lr = self._lengths(p)
                if self._has_target(2 * p, lc) and self._has_target(2 * p + 1, lr):
                    kept.append(p)
                    used.append(lc + lr)
            kept = np.asarray(kept, dtype=np.int64)
            if self.packed:
                items, offsets = pack(np.asarray(used, dtype=np.int64), cap, self.seed)
                kept = kept[items]
            else:
                offsets = np.arange(len(kept) + 1, dtype=np.int64)
            return {"pairs": kept, "offsets": offsets}

        idx, self.from_cache = si.load_or_build(
            data.prefix,
            "preference",
            key,
            ("pairs", "offsets"),
            build,
            lambda a: a["offsets"].ndim == 1 and len(a["offsets"]) >= 1 and a["offsets"][-1] == len(a["pairs"]),
        )
        self._pairs, self._offsets = np.asarray(idx["pairs"]), np.asarray(idx["offsets"])
        self.num_samples = len(self._offsets) - 1
        if self.num_samples < 1:
            raise ValueError(
                f"PreferenceDataset: no pair among {self.pairs.start}..{self.pairs.stop - 1} keeps a completion "
                f"token in both sequences within seq_length + 1 = {cap} tokens"
            )
        whole = np.asarray(data.pair_sizes, dtype=np.int64)[self._pairs].sum(1)
        used = np.asarray([sum(self._lengths(p)) for p in self._pairs], dtype=np.int64)
        truncated, dropped = int((whole > cap).sum()), len(self.pairs) - len(self._pairs)
        self.stats = {
            "pairs": len(self._pairs),
            "samples": self.num_samples,
            "tokens": int(used.sum()),
            "capacity": self.num_samples * cap,
            "efficiency": float(used.sum()) / (self.num_samples * cap),
            "truncated": truncated,
            "dropped": dropped,
        }
        if truncated or dropped:
            warnings.warn(
                f"PreferenceDataset: of {len(self.pairs)} pairs ({self.pairs.start}..{self.pairs.stop - 1}), "
                f"{truncated} longer than seq_length + 1 = {cap} tokens are truncated and {dropped} left without a "
                "completion token in the chosen or the rejected sequence are left out",
                stacklevel=2,
            )
        self._order = Epochs(self.num_samples, self.seed)

    def _lengths(self, p: int) -> tuple[int, int]:
        lc, lr = (int(x) for x in self.data.pair_sizes[p])
        return si.truncate_pair(lc, lr, self.seq_length + 1)

    def _has_target(self, doc: int, n: int) -> bool:
        return n > 1 and bool(np.any(np.asarray(self.data.get_mask(doc, 1, n - 1))))

    @property
    def efficiency(self) -> float:
        """Real tokens / packed capacity (samples × (seq_length + 1)) over one epoch."""
        return self.stats["efficiency"]

    def __len__(self) -> int:
        return self.num_samples

    def index(self, i: int) -> int:
        """The packed sample that sample number ``i`` reads (each epoch in a new seeded order)."""
        return self._order(int(i))

    def pairs_of(self, k: int) -> list[int]:
        """The pair numbers packed into packed sample ``k`` (in their order in it)."""
        return [int(p) for p in self._pairs[self._offsets[k] : self._offsets[k + 1]]]

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return self.sample(self.index(i))

    def sample(self, k: int) -> dict[str, np.ndarray]:
        """Packed sample ``k`` (no epoch order)."""
        return self.pair_sample(self.pairs_of(k))

    def pair_sample(self, pairs: list[int]) -> dict[str, np.ndarray]:
        """A sample holding ``pairs`` (truncated as they would be), in that order."""
        pieces = []
        for p in pairs:
            for doc, n in zip((2 * p, 2 * p + 1), self._lengths(p)):
                pieces.append((self.data.get(doc, 0, n), self.data.get_mask(doc, 0, n)))
        return packed_sample(pieces, self.seq_length, self.pad)
