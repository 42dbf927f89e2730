"""The trainer's one entry point to data: check the data flags, make the tokenizer, build the three splits.

``--data PREFIX`` or ``--data W1,PREFIX1,W2,PREFIX2,...`` names preprocessed data (``PREFIX.bin``/``.idx``,
``megakernels preprocess``); without it the default corpus (the Python standard library, byte tokenizer, capped
by ``--corpus-bytes``) is preprocessed once into the cache and read the same way. Each prefix's documents are split
by ``--split`` (train, valid, test: consecutive, disjoint document ranges); a blend draws each split from the
components' same split in the blend's proportions (``blending``). Split ``i`` uses seed ``--seed + 1000·i``.

Settings read with ``getattr(args, NAME, default)`` (the trainer declares them; absent means the default):

- ``document_masking`` (all three below at once), ``reset_position_ids``, ``reset_attention_mask``,
  ``eod_mask_loss``: GPT samples carry document keys (``datasets.document_keys``), at the tokenizer's EOD;
- ``sft``: chat data (``megakernels preprocess --chat``, recognised by its ``PREFIX.chat.json``) as
  ``sft.SFTDataset``s, packed unless ``sft_packing`` is False; their samples always carry ``positions`` and
  ``documents`` (the document options above are for GPT samples). ``--sft`` without ``--data``, with data that is
  not chat data, or chat data without ``--sft``, is an ``ArgumentError``;
- ``dpo``: preference data (``megakernels preprocess --preference``, its ``PREFIX.preference.json``) as
  ``preference.PreferenceDataset``s, whole pairs packed, split by pairs; one prefix (no blend). The same rules:
  ``--dpo`` needs preference data, and preference data needs ``--dpo``;
- ``grpo``: ``--data`` is a JSONL of prompts (``prompts.PromptDataset``, the training "split" all of it; no
  validation), each of which must leave ``max_completion_tokens`` of the model's ``seq_length``.
"""

from __future__ import annotations

import math

import numpy as np

from megakernels.validation import positive_int
from megakernels_models.data.blending import BlendedDataset, parse_blend
from megakernels_models.data.chat import ChatIndexed, is_chat
from megakernels_models.data.corpus import stdlib_prefix
from megakernels_models.data.datasets import BertDataset, GPTDataset, split_documents
from megakernels_models.data.images import CaptionDataset, ImageTextIndexed, is_image_text
from megakernels_models.data.indexed import IndexedDataset, paths
from megakernels_models.data.preference import PreferenceDataset, PreferenceIndexed, is_preference
from megakernels_models.data.sft import SFTDataset
from megakernels_models.data.shapes import ShapesSource
from megakernels_models.data.tokenizer import build_tokenizer
from megakernels_models.models.registry import families, family
from megakernels_models.settings import ArgumentError


def tokenizer_for(args):
    """The tokenizer of ``args.tokenizer`` (``byte``, ``hf:PATH`` or ``spm:PATH``).

    Raises:
        ArgumentError: an unknown spec or a missing/unreadable file (naming ``--tokenizer``).
    """
    try:
        return build_tokenizer(args.tokenizer)
    except (ValueError, OSError) as e:
        raise ArgumentError(f"--tokenizer {args.tokenizer}: {e}") from None


DOCUMENT_OPTIONS = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")


def document_options(args) -> dict[str, bool]:
    """The document options of GPT samples that ``args`` turns on: ``document_masking`` turns on all of
    ``DOCUMENT_OPTIONS``, each of which may also be set on its own (absent attributes are off)."""
    every = bool(getattr(args, "document_masking", False))
    return {name: True for name in DOCUMENT_OPTIONS if every or getattr(args, name, False)}


def _option_flags(options) -> str:
    return "/".join("--" + n.replace("_", "-") for n in options)


def _split(args) -> tuple[int, int, int]:
    """``--split`` as (train, valid, test) weights over documents."""
    try:
        split = tuple(int(x) for x in str(args.split).split(","))
        if len(split) != 3 or min(split) < 0 or split[0] == 0:
            raise ValueError
    except ValueError:
        raise ArgumentError(
            f"--split must be three non-negative integers like 949,50,1 (train > 0), got {args.split!r}"
        ) from None
    return split


def _blend(args) -> list[tuple[float, str]]:
    if args.data is None:
        return [(1.0, stdlib_prefix(args.corpus_bytes))]
    try:
        return parse_blend(args.data)
    except ValueError as e:
        raise ArgumentError(str(e)) from None


def validate_data_args(args, cfg=None) -> None:
    """Check ``--data``, ``--tokenizer``, ``--split`` and ``--corpus-bytes`` against each other and the model
    (``cfg``, default ``args.model_config()``).

    Rules: the split has a validation part when ``--eval-interval`` asks for validation; the tokenizer exists and its
    vocabulary fits ``cfg.vocab_size``; BERT needs its cls/sep/mask/pad tokens;
    the default corpus needs the byte tokenizer; every ``--data`` prefix has readable, valid ``PREFIX.bin``/``.idx``
    written with a vocabulary of the tokenizer's size, and a non-empty training split (for GPT holding at least
    ``seq_length + 1`` tokens; for BERT cut into sentences: a newline token or ``--split-sentences`` data).

    Raises:
        ArgumentError: the first broken rule, naming the flag.
    """
    cfg = args.model_config() if cfg is None else cfg
    tok = tokenizer_for(args)
    if tok.vocab_size > cfg.vocab_size:
        raise ArgumentError(
            f"--tokenizer {args.tokenizer} has {tok.vocab_size} ids, more than the model's vocab size "
            f"{cfg.vocab_size} (raise --vocab-size)"
        )
    kind = family(cfg).data
    if getattr(args, "grpo", False):
        _validate_prompts(args, cfg, tok)
        return
    _check_sample_options(args, cfg, tok)
    if kind == "captions":
        _validate_image_data(args, cfg, tok)
        return
    if kind == "sentences":
        try:
            tok.require("cls", "sep", "mask", "pad", use=f"--model {cfg.model}")
        except ValueError as e:
            raise ArgumentError(f"--tokenizer {args.tokenizer}: {e}") from None
    split = _split(args)
    if args.eval_interval and split[1] == 0:
        raise ArgumentError("--eval-interval needs a validation split (the middle number of --split is 0)")
    sft = bool(getattr(args, "sft", False))
    dpo = bool(getattr(args, "dpo", False))
    if sft and args.data is None:
        raise ArgumentError(
            "--sft trains on chat data: give --data PREFIX made by megakernels preprocess --chat FILE.jsonl "
            "--tokenizer DIR --output PREFIX"
        )
    if dpo and (args.data is None or len(_blend(args)) > 1):
        raise ArgumentError(
            "--dpo trains on one preference dataset: give --data PREFIX made by megakernels preprocess "
            "--preference FILE.jsonl --tokenizer DIR --output PREFIX"
            + (f" (not a blend: {args.data})" if args.data is not None else "")
        )
    if args.data is None:
        if tok.name != "byte":
            raise ArgumentError(
                f"--tokenizer {args.tokenizer}: the default corpus (no --data) is read with the byte "
                "tokenizer; give --data preprocessed with this tokenizer"
            )
        positive_int(args.corpus_bytes, "--corpus-bytes", error=ArgumentError)
        return
    for _, prefix in _blend(args):
        if is_image_text(prefix):
            takes = " or ".join(f"--model {s.name}" for s in families() if s.data == "captions")
            raise ArgumentError(f"--data {prefix} holds images and captions: train it with {takes}")
        for p in paths(prefix):
            try:
                open(p, "rb").close()
            except OSError as e:
                raise ArgumentError(
                    f"--data {prefix}: cannot read {p} ({e.strerror}); make it with megakernels "
                    f"preprocess --output-prefix {prefix}"
                ) from None
        _check_chat(prefix, sft, dpo)
        ds = _open_data(_reader(sft, dpo), prefix, args, tok)
        if dpo:
            if not split_documents(ds.pairs, split)[0]:
                raise ArgumentError(
                    f"--data {prefix}: its {ds.pairs} pairs leave no training pairs with --split {args.split}"
                )
            continue
        train = split_documents(ds.doc_count, split)[0]
        if not train:
            raise ArgumentError(
                f"--data {prefix}: its {ds.doc_count} documents leave no training documents with --split {args.split}"
            )
        if kind == "sentences" and tok.newline is None and len(ds.sequence_sizes) == ds.doc_count:
            raise ArgumentError(
                f"--data {prefix}: {family(cfg).title} needs sentences, but --tokenizer {args.tokenizer} has no "
                "newline token and the data is one sequence per document; preprocess it with "
                "--split-sentences"
            )
        tokens = int(ds.doc_offsets[train.stop] - ds.doc_offsets[train.start])
        if kind == "tokens" and not sft and tokens < cfg.seq_length + 1:
            raise ArgumentError(
                f"--data {prefix}: the training split holds {tokens} tokens, fewer than one sample "
                f"of seq_length + 1 = {cfg.seq_length + 1}"
            )


def _prompts(args, tok):
    from megakernels_models.data.prompts import PromptDataset

    return PromptDataset(args.data, tok, args.seed)


def _validate_prompts(args, cfg, tok) -> None:
    """``--grpo --data FILE.jsonl``: readable prompts that leave room for a completion in a sample."""
    if args.data is None:
        raise ArgumentError('--grpo samples completions of prompts: give --data FILE.jsonl ({"prompt": TEXT, ...})')
    try:
        ds = _prompts(args, tok)
    except (ValueError, OSError) as e:
        raise ArgumentError(str(e)) from None
    room = cfg.seq_length - args.max_completion_tokens
    if ds.longest > room:
        raise ArgumentError(
            f"--data {args.data}: its longest prompt has {ds.longest} tokens, more than --seq-length "
            f"{cfg.seq_length} leaves beside --max-completion-tokens {args.max_completion_tokens}"
        )


def _check_sample_options(args, cfg, tok) -> None:
    """Document options and ``--sft`` need a causal (``tokens``) family; document options need an EOD token."""
    options = document_options(args)
    sft = bool(getattr(args, "sft", False))
    if not options and not sft:
        return
    named = (["--sft"] if sft else []) + ([_option_flags(options)] if options else [])
    if family(cfg).data != "tokens":
        raise ArgumentError(f"{' and '.join(named)}: --model {cfg.model} does not train on token sequences")
    if options and not sft:
        try:
            tok.require("eod", use=_option_flags(options))
        except ValueError as e:
            raise ArgumentError(f"--tokenizer {args.tokenizer}: {e}") from None


def _reader(sft: bool, dpo: bool):
    return ChatIndexed if sft else PreferenceIndexed if dpo else IndexedDataset


def _check_chat(prefix: str, sft: bool, dpo: bool = False) -> None:
    """Chat data goes with ``--sft`` and only with it, preference data with ``--dpo``."""
    pairs = is_preference(prefix)
    if dpo and not pairs:
        raise ArgumentError(
            f"--dpo: --data {prefix} is not preference data (no {prefix}.preference.json); make it with megakernels "
            f"preprocess --preference FILE.jsonl --tokenizer DIR --output {prefix}"
        )
    if pairs and not dpo:
        raise ArgumentError(
            f"--data {prefix} holds preference pairs (megakernels preprocess --preference): train it with --dpo"
        )
    if dpo:
        return
    chat = is_chat(prefix)
    if sft and not chat:
        raise ArgumentError(
            f"--sft: --data {prefix} is not chat data (no {prefix}.chat.json); make it with megakernels preprocess "
            f"--chat FILE.jsonl --tokenizer DIR --output {prefix}"
        )
    if chat and not sft:
        raise ArgumentError(
            f"--data {prefix} holds chat conversations with an assistant mask (megakernels preprocess --chat): "
            "train it with --sft"
        )


def _open_data(reader, prefix: str, args, tok):
    """``reader(prefix)``, its problems and a vocabulary other than the tokenizer's as ``ArgumentError``s."""
    try:
        ds = reader(prefix)
    except (ValueError, FileNotFoundError) as e:
        raise ArgumentError(f"--data {prefix}: {e}") from None
    if ds.vocab_size != tok.vocab_size:
        raise ArgumentError(
            f"--data {prefix} was tokenized with a vocabulary of {ds.vocab_size} ids but "
            f"--tokenizer {args.tokenizer} has {tok.vocab_size}: preprocess it with that tokenizer"
        )
    return ds


def build_datasets(args, cfg):
    """``(train, valid, test)`` datasets for the trainer (each None when its split is empty or too small to give a
    sample; train never is after ``validate_data_args``).

    GPT indices are built for ``--steps × --global-batch-size`` training samples and ``--eval-steps ×
    --global-batch-size`` validation/test samples (more are computed on demand) and cached beside the data.

    Raises:
        ArgumentError: bad ``--tokenizer``, ``--data`` or ``--split`` (as ``validate_data_args``).
        ValueError: the training split cannot give one sample.
    """
    tok = tokenizer_for(args)
    if getattr(args, "grpo", False):
        return _prompts(args, tok), None, None
    split = _split(args)
    kind = family(cfg).data
    if kind == "captions":
        return caption_datasets(cfg, tok, args.data, args.seed, split)
    options = document_options(args) if kind == "tokens" else {}
    if options:
        try:
            tok.require("eod", use=_option_flags(options))
        except ValueError as e:
            raise ArgumentError(f"--tokenizer {args.tokenizer}: {e}") from None
    sft = bool(getattr(args, "sft", False)) and kind == "tokens"
    dpo = bool(getattr(args, "dpo", False)) and kind == "tokens"
    if sft or dpo:
        pad = tok.pad if tok.has("pad") else tok.eod if tok.has("eod") else 0
        packed = bool(getattr(args, "sft_packing", True))
    blend = []
    for w, p in _blend(args):
        if kind == "tokens":
            _check_chat(p, sft, dpo)
        blend.append((w, _reader(sft, dpo)(p)))
    wanted = [args.steps * args.global_batch_size] + [args.eval_steps * args.global_batch_size] * 2
    out = []
    for i in range(3):
        weights, parts = [], []
        for w, data in blend:
            docs = split_documents(data.pairs if dpo else data.doc_count, split)[i]
            if not docs:
                continue
            seed = args.seed + 1000 * i
            try:
                if dpo:
                    ds = PreferenceDataset(data, cfg.seq_length, seed, pad, pairs=docs)
                elif sft:
                    ds = SFTDataset(data, cfg.seq_length, seed, pad, documents=docs, packed=packed)
                elif kind == "tokens":
                    ds = GPTDataset(
                        data,
                        cfg.seq_length,
                        seed,
                        tok.eod if options else None,
                        documents=docs,
                        num_samples=math.ceil(w * wanted[i]) + 1,
                        **options,
                    )
                else:
                    ds = BertDataset(data, cfg.seq_length, seed, tok, documents=docs)
            except ValueError:
                if i == 0:
                    raise
                continue  # a validation/test split too small for a sample: leave that component out
            weights.append(w)
            parts.append(ds)
        if not parts:
            out.append(None)
        elif len(blend) == 1:
            out.append(parts[0])
        else:
            out.append(BlendedDataset(parts, weights))
    return tuple(out)


def _validate_image_data(args, cfg, tok) -> None:
    """``--data`` of a vision-language model: none (the embedded shapes, drawn at the model's image size) or one
    image–text prefix whose images all are ``image_size × image_size × image_channels``."""
    split = _split(args)
    if args.eval_interval and split[1] == 0:
        raise ArgumentError("--eval-interval needs a validation split (the middle number of --split is 0)")
    if args.data is None:
        if cfg.image_size < 16 or cfg.image_channels != 3:
            raise ArgumentError(
                f"--model vlm without --data draws the embedded shapes: they need RGB images of at "
                f"least 16 pixels (--image-size {cfg.image_size}, {cfg.image_channels} channels)"
            )
        return
    prefix = args.data
    if "," in prefix:
        raise ArgumentError(f"--data {prefix}: a vision-language model reads one image-text prefix (no blends)")
    if not is_image_text(prefix):
        raise ArgumentError(
            f"--data {prefix}: {prefix}.idx is missing or not an image-text index (make one with "
            "megakernels preprocess --images DIR --captions FILE.jsonl)"
        )
    ds = _open_data(ImageTextIndexed, prefix, args, tok)
    want = (cfg.image_size, cfg.image_size, cfg.image_channels)
    bad = np.flatnonzero((ds.shapes != np.asarray(want)).any(axis=1))
    if len(bad):
        h, w, c = ds.shapes[bad[0]]
        raise ArgumentError(
            f"--data {prefix}: image {bad[0]} is {h}x{w}x{c} but the model takes {want[0]}x{want[1]}x"
            f"{want[2]} (--image-size {cfg.image_size}); preprocess with --image-size {cfg.image_size}"
        )
    if not split_documents(len(ds), split)[0]:
        raise ArgumentError(
            f"--data {prefix}: its {len(ds)} samples leave no training samples with --split {args.split}"
        )


def caption_datasets(cfg, tok, data: str | None, seed: int, split=(949, 50, 1)):
    """``(train, valid, test)`` captioning datasets of a vision-language model: the splits of the image–text prefix
    ``data``'s samples (None for an empty split), or without it the embedded shapes drawn with seed ``seed + 1000·i``
    for split i (disjoint draws, endless)."""
    pad = tok.pad if tok.has("pad") else tok.eod
    if data is None:
        return tuple(
            CaptionDataset(
                ShapesSource(seed + 1000 * i, cfg.image_size, tok), cfg.seq_length, seed + 1000 * i, tok.eod, pad
            )
            for i in range(3)
        )
    source = ImageTextIndexed(data)
    return tuple(
        CaptionDataset(source, cfg.seq_length, seed + 1000 * i, tok.eod, pad, documents=docs) if docs else None
        for i, docs in enumerate(split_documents(len(source), split))
    )
