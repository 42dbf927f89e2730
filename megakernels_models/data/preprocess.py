"""``megakernels preprocess``: text or JSONL files (or folders of them) -> ``PREFIX.bin`` + ``PREFIX.idx``.

Inputs: a plain text file is one document; a ``.jsonl``/``.json`` file holds one JSON object per line whose
``--json-key`` field is a document; either may be gzipped (``.gz``). Folders are walked in sorted path order,
skipping hidden files, this pipeline's own outputs (``.bin``, ``.idx``, ``.npy``, temporary ``.tmp-`` files) and
plain files that are not UTF-8 text (compiled files next to sources; counted in the summary). A file named
directly must be readable text. Empty documents are skipped. ``--append-eod`` ends each document with the tokenizer's
end-of-document token (GPT training
needs it between documents); ``--split-sentences`` stores each line as its own sequence (BERT's sentences, for
tokenizers without a newline token such as SentencePiece).

Tokenisation runs on ``--workers`` processes over chunks of documents, in input order (``Pool.imap``); the reader
stays at most a few chunks ahead of the writer, so memory use does not grow with the corpus. The output is written
to temporary files and renamed at the end (``indexed.IndexedDatasetWriter``): an interrupted run never leaves a
``PREFIX.bin``/``.idx`` pair that looks valid. ``--train-tokenizer V`` first trains a byte-level BPE of ``V`` ids
(with ``<|endoftext|> [PAD] [CLS] [SEP] [MASK]``) on the inputs, saves it as ``PREFIX.tokenizer.json`` and then
tokenises with it.

``--chat FILE.jsonl [...] --tokenizer DIR``: chat conversations rendered with the checkpoint's chat template into
token ids and an assistant mask, for supervised fine-tuning (``data/chat.py``); ``--seq-length N`` also prints how
well they pack into samples of N + 1 tokens (``sft.packing_stats``). ``--preference FILE.jsonl [...] --tokenizer
...``: ``{"prompt", "chosen", "rejected"}`` pairs (strings, or chat messages rendered with DIR's chat template) into
each pair's two sequences with completion masks, for ``--dpo`` (``data/preference.py``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator

import numpy as np

from megakernels_models.data.indexed import IndexedDatasetWriter
from megakernels_models.data.tokenizer import build_tokenizer

TRAINED_SPECIALS = ("<|endoftext|>", "[PAD]", "[CLS]", "[SEP]", "[MASK]")
CHUNK_DOCUMENTS = 64


def input_files(inputs: Iterable[str]) -> list[tuple[str, bool]]:
    """Files named by ``inputs`` (files, or folders walked in sorted order), in order, each with whether it was
    found by walking a folder.

    Raises:
        FileNotFoundError: an input does not exist (named, as ``--input``).
        ValueError: no files at all.
    """
    out = []
    for path in inputs:
        if os.path.isfile(path):
            out.append((path, False))
        elif os.path.isdir(path):
            found = []
            for d, dirs, files in os.walk(path):
                dirs[:] = [x for x in dirs if not x.startswith(".")]
                found.extend(os.path.join(d, f) for f in files if _is_input(f))
            out.extend((f, True) for f in sorted(found))  # by path: the same order on every machine
        else:
            raise FileNotFoundError(f"--input {path}: no such file or folder")
    if not out:
        raise ValueError(f"--input {' '.join(inputs)}: no input files")
    return out


def _is_input(name: str) -> bool:
    return not (name.startswith(".") or ".tmp-" in name or name.endswith((".bin", ".idx", ".npy")))


def read_documents(
    files: Iterable[tuple[str, bool]], json_key: str = "text", skipped: list[str] | None = None
) -> Iterator[str]:
    """The documents of ``files`` (``input_files``) in order (see the module docstring), empty ones skipped.
    Plain files found in folders that are not UTF-8 are left out and appended to ``skipped``.

    Raises:
        ValueError: a file named directly that is not UTF-8; a JSONL line that is not a JSON object with a string
            ``json_key`` (the message names the file and line); a corrupt gzip file.
    """
    for path, walked in files:
        base = path[:-3] if path.endswith(".gz") else path
        opener = gzip.open if path.endswith(".gz") else open
        try:
            with opener(path, "rt", encoding="utf-8") as f:
                if base.endswith((".jsonl", ".json")):
                    yield from _json_lines(f, path, json_key)
                else:
                    text = f.read()
                    if text:
                        yield text
        except UnicodeDecodeError as e:
            if walked and not base.endswith((".jsonl", ".json")):
                if skipped is not None:
                    skipped.append(path)
                continue
            raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except (gzip.BadGzipFile, EOFError) as e:
            raise ValueError(f"{path}: not a valid gzip file ({e})") from None


def _json_lines(f, path: str, key: str) -> Iterator[str]:
    for lineno, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not a JSON object per line ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get(key), str):
            raise ValueError(f"{path}:{lineno}: no string field {key!r} (--json-key {key})")
        if obj[key]:
            yield obj[key]


def train_bpe(files: list[str], vocab_size: int, path: str, json_key: str = "text", progress: bool = False) -> str:
    """Train a byte-level BPE of ``vocab_size`` ids (256 byte symbols, ``TRAINED_SPECIALS``, merges) on the documents
    of ``files`` and save it to ``path`` (atomically). Returns its spec ``hf:PATH``.

    Raises:
        ValueError: ``vocab_size`` < 261 (the byte alphabet and the special tokens).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    least = 256 + len(TRAINED_SPECIALS)
    if vocab_size < least:
        raise ValueError(
            f"--train-tokenizer {vocab_size}: needs at least {least} ids (256 bytes + "
            f"{len(TRAINED_SPECIALS)} special tokens)"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(TRAINED_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tok.train_from_iterator(read_documents(files, json_key), trainer)
    tmp = f"{path}.tmp-{os.getpid()}"
    tok.save(tmp)
    os.replace(tmp, path)
    return f"hf:{path}"


# ---- tokenisation workers ------------------------------------------------------------------------------------

_WORKER: dict = {}


def _init_worker(spec: str, append_eod: bool, split_sentences: bool) -> None:
    tok = build_tokenizer(spec)
    if append_eod:
        tok.require("eod", use="--append-eod")
    _WORKER.update(tok=tok, eod=tok.eod if append_eod else None, split=split_sentences)


def _encode_chunk(texts: list[str]) -> list[list[np.ndarray]]:
    """Each document as its list of sequences (one, or one per line with ``--split-sentences``)."""
    tok, eod, split = _WORKER["tok"], _WORKER["eod"], _WORKER["split"]
    out = []
    for text in texts:
        parts = _lines(text) if split else [text]
        seqs = tok.encode_batch(parts) if hasattr(tok, "encode_batch") else [tok.encode(p) for p in parts]
        if eod is not None:
            seqs[-1] = np.append(seqs[-1], np.asarray(eod, dtype=seqs[-1].dtype))
        out.append(seqs)
    return out


def _lines(text: str) -> list[str]:
    """Lines with their line ends; a blank line joins the line before it (no empty sentences)."""
    out: list[str] = []
    for line in text.splitlines(keepends=True):
        if out and not line.strip():
            out[-1] += line
        else:
            out.append(line)
    return out or [text]


def _chunks(docs: Iterator[str], n: int) -> Iterator[list[str]]:
    chunk = []
    for d in docs:
        chunk.append(d)
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def tokenize_documents(
    docs: Iterator[str], spec: str, workers: int = 1, append_eod: bool = False, split_sentences: bool = False
) -> Iterator[list[np.ndarray]]:
    """Tokenise ``docs`` on ``workers`` processes; yields each document's sequences in input order."""
    chunks = _chunks(docs, CHUNK_DOCUMENTS)
    if workers == 1:
        _init_worker(spec, append_eod, split_sentences)
        for chunk in chunks:
            yield from _encode_chunk(chunk)
        return
    # Pool.imap's feeder thread would read the whole input ahead of the workers: a semaphore released per
    # consumed chunk keeps it at most 2·workers chunks ahead.
    ahead, stop = threading.Semaphore(2 * workers), threading.Event()

    def feed():
        for chunk in chunks:
            ahead.acquire()
            if stop.is_set():
                return
            yield chunk

    # Workers must not start HuggingFace's own thread pool (nor warn that the parent already used it).
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        pool = multiprocessing.Pool(workers, _init_worker, (spec, append_eod, split_sentences))
    finally:
        if old is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old
    try:
        for out in pool.imap(_encode_chunk, feed()):
            ahead.release()
            yield from out
    finally:
        stop.set()
        ahead.release(2 * workers + 1)  # unblock the feeder so the pool can shut down
        pool.terminate()
        pool.join()


def preprocess(
    inputs: list[str],
    output_prefix: str,
    tokenizer: str = "byte",
    json_key: str = "text",
    workers: int = 1,
    append_eod: bool = False,
    split_sentences: bool = False,
    train_tokenizer: int | None = None,
    progress: bool = False,
) -> dict:
    """Write ``output_prefix.bin``/``.idx`` from ``inputs`` (the module docstring). Returns ``documents, sequences,
    tokens, dtype, tokenizer, skipped`` (files left out) and ``seconds``.

    Raises:
        FileNotFoundError: an input or the tokenizer file is missing.
        ValueError: bad input (named with the rule), no documents, ``workers`` < 1, a bad tokenizer.
    """
    t0 = time.perf_counter()
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if os.path.isdir(output_prefix) or output_prefix.endswith(os.sep):
        raise ValueError(f"--output-prefix {output_prefix} is a folder; give a prefix (files PREFIX.bin/.idx)")
    files = input_files(inputs)
    if train_tokenizer is not None:
        os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
        tokenizer = train_bpe(files, train_tokenizer, output_prefix + ".tokenizer.json", json_key, progress)
    tok = build_tokenizer(tokenizer)
    if append_eod:
        tok.require("eod", use="--append-eod")
    from tqdm import tqdm

    bar = tqdm(desc="preprocess", unit=" docs", disable=not progress, dynamic_ncols=True)
    from megakernels_models.data.chat import forget_masked

    forget_masked(output_prefix)  # text written over chat or preference data is neither any more
    with IndexedDatasetWriter(output_prefix, tok.vocab_size) as w:
        skipped: list[str] = []
        stream = tokenize_documents(
            read_documents(files, json_key, skipped), tok.name, workers, append_eod, split_sentences
        )
        try:
            for seqs in stream:
                w.add_document(seqs)
                bar.update(1)
                if w.doc_count % 256 == 0:
                    bar.set_postfix(tokens=w.num_tokens, refresh=False)
        finally:
            stream.close()  # stops the worker pool at once, also on an error
            bar.close()
        if w.doc_count == 0:
            raise ValueError(f"--input {' '.join(inputs)}: no non-empty documents")
        w.finish()
        return {
            "documents": w.doc_count,
            "sequences": w.sequence_count,
            "tokens": w.num_tokens,
            "dtype": w.dtype.name,
            "tokenizer": tok.name,
            "skipped": skipped,
            "seconds": time.perf_counter() - t0,
        }


# ---- the subcommand -------------------------------------------------------------------------------------------


def add_parser(sub) -> argparse.ArgumentParser:
    """Add ``preprocess`` to the ``megakernels`` subparsers."""
    p = sub.add_parser(
        "preprocess",
        help="text/JSONL files or folders -> PREFIX.bin + PREFIX.idx; or images + captions (--images, --captions)",
        description="Tokenise text or JSONL files (or folders of them) into PREFIX.bin + PREFIX.idx; "
        "or, with --images DIR --captions FILE.jsonl, write an image-text dataset (uint8 images in "
        ".bin, shapes and caption tokens in .idx) for --model vlm.",
    )
    p.add_argument(
        "--input",
        nargs="+",
        default=None,
        metavar="FILE_OR_DIR",
        help="text, .jsonl/.json (one object per line) or .gz of either; folders are walked",
    )
    p.add_argument(
        "--images",
        default=None,
        metavar="DIR",
        help="image-text: the folder the captions' image paths are relative to (PNG, JPEG, ... decoded by Pillow)",
    )
    p.add_argument(
        "--captions", default=None, metavar="FILE", help='image-text: JSONL of {"image": PATH, "caption": TEXT}'
    )
    p.add_argument(
        "--image-size",
        type=int,
        default=None,
        metavar="N",
        help="image-text: resize every image to "
        "N x N (default: keep; the model then needs them all at its --image-size)",
    )
    p.add_argument(
        "--chat",
        nargs="+",
        default=None,
        metavar="FILE",
        help='chat: JSONL of {"messages": [{"role": "system"|"user"|"assistant", "content": TEXT}, ...]} -> token '
        "ids + assistant mask for --sft (needs --tokenizer DIR with a chat template)",
    )
    p.add_argument(
        "--preference",
        nargs="+",
        default=None,
        metavar="FILE",
        help='preference pairs: JSONL of {"prompt": ..., "chosen": ..., "rejected": ...} (three strings, or three '
        "lists of chat messages rendered with --tokenizer DIR's chat template) -> each pair's chosen and rejected "
        "sequences + completion masks for --dpo",
    )
    p.add_argument(
        "--seq-length",
        type=int,
        default=None,
        metavar="N",
        help="chat, preference: also report how the conversations (pairs) pack into samples of N + 1 tokens",
    )
    p.add_argument(
        "--output-prefix", "--output", required=True, metavar="PREFIX", help="writes PREFIX.bin and PREFIX.idx"
    )
    p.add_argument(
        "--tokenizer",
        default="byte",
        help="byte | hf:PATH | spm:PATH (default: byte); with --chat a HuggingFace tokenizer directory (DIR or hf:DIR)",
    )
    p.add_argument(
        "--train-tokenizer",
        type=int,
        default=None,
        metavar="VOCAB_SIZE",
        help="train a byte-level BPE on the input first (saved as PREFIX.tokenizer.json)",
    )
    p.add_argument("--json-key", default="text", help="the document field of JSONL objects (default: text)")
    p.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1, help="tokenising processes (default: the number of CPUs)"
    )
    p.add_argument("--append-eod", action="store_true", help="end each document with the EOD token (GPT)")
    p.add_argument("--split-sentences", action="store_true", help="each line its own sequence (BERT sentences)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(_run=main)
    return p


def main(ns: argparse.Namespace) -> int:
    """Run ``megakernels preprocess``; returns the exit status (2 for bad input, reported on stderr)."""
    if ns.chat is not None and ns.preference is not None:
        print(
            "megakernels preprocess: error: give --chat (conversations) or --preference (pairs), not both",
            file=sys.stderr,
        )
        return 2
    if ns.chat is not None:
        return _chat_main(ns)
    if ns.preference is not None:
        return _preference_main(ns)
    if ns.images is not None or ns.captions is not None:
        return _images_main(ns)
    if not ns.input:
        print(
            "megakernels preprocess: error: give --input FILE_OR_DIR (text) or --images DIR --captions FILE "
            "(image-text)",
            file=sys.stderr,
        )
        return 2
    try:
        if ns.train_tokenizer is not None and ns.tokenizer != "byte":
            raise ValueError(f"give --tokenizer {ns.tokenizer} or --train-tokenizer, not both")
        stats = preprocess(
            ns.input,
            ns.output_prefix,
            ns.tokenizer,
            ns.json_key,
            ns.workers,
            ns.append_eod,
            ns.split_sentences,
            ns.train_tokenizer,
            ns.progress,
        )
    except (ValueError, OSError) as e:
        print(f"megakernels preprocess: error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {ns.output_prefix}.bin/.idx: {stats['documents']} documents, {stats['tokens']} tokens "
        f"({stats['dtype']}, {stats['tokenizer']}) in {stats['seconds']:.1f} s"
        + (f"; skipped {len(stats['skipped'])} files that are not UTF-8 text" if stats["skipped"] else "")
    )
    return 0


def _chat_main(ns: argparse.Namespace) -> int:
    """``preprocess --chat FILE.jsonl --tokenizer DIR``: tokens and assistant mask (``data.chat``)."""
    t0 = time.perf_counter()
    try:
        if ns.input or ns.images is not None or ns.captions is not None:
            raise ValueError("give --chat (conversations) or --input (text) or --images/--captions, not several")
        if ns.train_tokenizer is not None:
            raise ValueError("--chat renders with a checkpoint's tokenizer and template: give --tokenizer DIR")
        if ns.tokenizer == "byte":
            raise ValueError("--chat needs --tokenizer DIR, a HuggingFace tokenizer directory with a chat template")
        if ns.seq_length is not None and ns.seq_length < 1:
            raise ValueError(f"--seq-length must be >= 1, got {ns.seq_length}")
        try:
            import jinja2  # noqa: F401
        except ImportError:
            raise ValueError(
                "--chat renders chat templates with jinja2, which is not installed (pip install 'megakernels[train]')"
            ) from None
        from megakernels_models.data.chat import preprocess_chat

        stats = preprocess_chat(ns.chat, ns.output_prefix, ns.tokenizer, ns.seq_length)
    except (ValueError, OSError) as e:
        print(f"megakernels preprocess: error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {ns.output_prefix}.bin/.idx, .mask.bin/.idx, .chat.json: {stats['conversations']} conversations, "
        f"{stats['tokens']} tokens, {stats['target_tokens']} assistant target tokens "
        f"({100 * stats['target_tokens'] / stats['tokens']:.1f} %), longest {stats['longest']}; assistant spans by "
        f"{stats['rule']} in {time.perf_counter() - t0:.1f} s"
    )
    if "packing" in stats:
        k = stats["packing"]
        print(
            f"packed into samples of {ns.seq_length} + 1 tokens: {k['samples']} samples, efficiency "
            f"{100 * k['efficiency']:.1f} % (real tokens / capacity); {k['truncated']} conversations longer than a "
            "sample would be truncated"
        )
    return 0


def _preference_main(ns: argparse.Namespace) -> int:
    """``preprocess --preference FILE.jsonl --tokenizer ...``: pairs and completion masks (``data.preference``)."""
    t0 = time.perf_counter()
    try:
        if ns.input or ns.images is not None or ns.captions is not None:
            raise ValueError("give --preference (pairs) or --input (text) or --images/--captions, not several")
        if ns.train_tokenizer is not None:
            raise ValueError("--preference tokenises with a given tokenizer: give --tokenizer (byte, hf:PATH or DIR)")
        if ns.seq_length is not None and ns.seq_length < 3:
            raise ValueError(f"--seq-length must be >= 3 (a pair of two tokens each), got {ns.seq_length}")
        from megakernels_models.data.preference import preprocess_preference

        stats = preprocess_preference(ns.preference, ns.output_prefix, ns.tokenizer, ns.seq_length)
    except ImportError as e:
        print(f"megakernels preprocess: error: {e} (pip install 'megakernels[train]')", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"megakernels preprocess: error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {ns.output_prefix}.bin/.idx, .mask.bin/.idx, .preference.json: {stats['pairs']} pairs, "
        f"{stats['tokens']} tokens, {stats['completion_tokens']} completion tokens "
        f"({100 * stats['completion_tokens'] / stats['tokens']:.1f} %), longest pair {stats['longest']}; "
        f"completions by {stats['rule']} ({stats['tokenizer']}) in {time.perf_counter() - t0:.1f} s"
    )
    if "packing" in stats:
        k = stats["packing"]
        print(
            f"packed into samples of {ns.seq_length} + 1 tokens: {k['samples']} samples, efficiency "
            f"{100 * k['efficiency']:.1f} % (real tokens / capacity); {k['truncated']} pairs longer than a sample "
            "would be truncated"
        )
    return 0


def _images_main(ns: argparse.Namespace) -> int:
    """``preprocess --images DIR --captions FILE.jsonl``: the image-text format of ``data.images``."""
    from megakernels_models.data.images import read_captioned_folder, write_image_text
    from megakernels_models.data.tokenizer import build_tokenizer

    t0 = time.perf_counter()
    try:
        if ns.images is None or ns.captions is None:
            raise ValueError("image-text preprocessing needs both --images DIR and --captions FILE.jsonl")
        if ns.input:
            raise ValueError("give --input (text) or --images/--captions (image-text), not both")
        if not os.path.isdir(ns.images):
            raise ValueError(f"--images {ns.images}: not a directory")
        if not os.path.isfile(ns.captions):
            raise ValueError(f"--captions {ns.captions}: no such file")
        if ns.image_size is not None and ns.image_size < 1:
            raise ValueError(f"--image-size must be >= 1, got {ns.image_size}")
        tok = build_tokenizer(ns.tokenizer)
        n = write_image_text(
            ns.output_prefix, read_captioned_folder(ns.images, ns.captions, tok, ns.image_size), tok.vocab_size
        )
    except (ValueError, OSError, ImportError) as e:
        print(f"megakernels preprocess: error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {ns.output_prefix}.bin/.idx: {n} images with captions ({tok.name}) in {time.perf_counter() - t0:.1f} s"
    )
    return 0
