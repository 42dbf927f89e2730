"""``megakernels convert``: HuggingFace models (config.json + safetensors) <-> megakernels checkpoints.

    megakernels convert hf-to-megakernels --input HF_DIR --output CKPT_DIR     # then: train --load CKPT_DIR
    megakernels convert megakernels-to-hf --input CKPT_DIR --output HF_DIR     # then: from_pretrained(HF_DIR)
    megakernels convert hf-to-megakernels --input LM_DIR --vision CLIP_DIR --output CKPT_DIR   # a LLaVA-style vlm

One module per family (``gpt2``, ``bert``, ``llama``, ``mixtral``) holds its config translation both ways and one table
of
tensor rules (``common.Rule``) applied in both directions. A ``tokenizer.json`` travels with the weights: the HF
directory's becomes ``CKPT_DIR/tokenizer.json`` (which ``megakernels train --load`` and ``megakernels eval``
default to), and a checkpoint's goes to the HF directory. The megakernels side is a DCP checkpoint directory as
``megakernels train --save`` writes it (``DIR/step-N`` + ``latest``), holding the model only (the optimizer starts
fresh when training resumes from it) at step 0, in full-model coordinates (so it loads at any layout). Nothing is
downloaded; ``transformers`` is not needed (only ``safetensors``).
"""

from __future__ import annotations

import json
import os

from megakernels_models.convert import (
    bert,
    deepseek_v2,
    deepseek_v3,
    gemma3,
    gpt2,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    qwen2,
    qwen3,
    qwen3_moe,
)
from megakernels_models.convert.common import (
    ConversionError,
    apply,
    read_checkpoint,
    read_hf,
    write_checkpoint,
    write_hf,
)
from megakernels_models.models.config import ModelConfig
from megakernels_models.models.registry import family
from megakernels_models.training.checkpoint_store import GENERATION_CONFIG, copy_tokenizer

FAMILIES = {
    m.MODEL_TYPE: m
    for m in (gpt2, bert, llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, gemma3, gpt_oss, deepseek_v2, deepseek_v3)
}
TOKENIZER = "tokenizer.json"

__all__ = [
    "hf_to_megakernels",
    "megakernels_to_hf",
    "write_checkpoint",
    "read_checkpoint",
    "ConversionError",
    "ModelConfig",
    "FAMILIES",
    "add_parser",
    "main",
]


def _family(model_type):
    if model_type not in FAMILIES:
        raise ConversionError(f"model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def hf_to_megakernels(
    hf_dir: str, out_dir: str, rope_interleaved: bool = False, vision_dir: str | None = None, seed: int = 1234
) -> str:
    """Convert a HuggingFace model directory into a megakernels checkpoint directory; returns the checkpoint's path.
    ``rope_interleaved``: a Llama becomes a megakernels Llama with the interleaved rotary layout (rows permuted).
    ``vision_dir``: a HuggingFace CLIP directory whose vision tower goes in front of the language model, making a
    vision-language checkpoint with a projector initialised from ``seed`` (``clip.with_clip_vision``).

    Raises:
        ConversionError: an unsupported model type or setting, a missing tensor, or an occupied ``out_dir``.
    """
    hf, tensors = read_hf(hf_dir)
    fam = _family(hf.get("model_type"))
    rotary = fam in (llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, gemma3, gpt_oss)
    if rope_interleaved and not rotary:
        raise ConversionError(f"--rope-interleaved is for Llama and Mixtral models, not {fam.MODEL_TYPE}")
    cfg = fam.config_to_ours(hf, rope_interleaved) if rotary else fam.config_to_ours(hf)
    tensors = fam.normalize(tensors)
    if getattr(cfg, "mtp_layers", 0) and hasattr(fam, "mtp_layers_in"):  # the config may name layers not saved
        cfg = cfg.replace(mtp_layers=fam.mtp_layers_in(tensors, cfg))
    ours = apply(fam.rules(cfg), tensors, "to_ours", fam.IGNORED, fam.tied(cfg))
    source = f"hf-{fam.MODEL_TYPE}"
    if vision_dir is not None:
        from megakernels_models.convert.clip import with_clip_vision

        cfg, ours = with_clip_vision(cfg, ours, vision_dir, seed)
        source += "+clip"
    path = write_checkpoint(ours, cfg, out_dir, source)
    copy_tokenizer(hf_dir, out_dir)
    special = _special_tokens(hf_dir, hf)
    if special:
        _write_json(os.path.join(out_dir, GENERATION_CONFIG), special)
    return path


SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id")


def _special_tokens(hf_dir: str, hf: dict) -> dict:
    """The model's special token ids: its config's, replaced by its ``generation_config.json``'s where that has
    them (Llama 3.1's instruction models stop on several eos ids there); None values left out."""
    out = {k: hf.get(k) for k in SPECIAL}
    path = os.path.join(hf_dir, GENERATION_CONFIG)
    if os.path.exists(path):
        with open(path) as f:
            gen = json.load(f)
        out.update({k: gen[k] for k in SPECIAL if gen.get(k) is not None})
    return {k: v for k, v in out.items() if v is not None}


def checkpoint_special_tokens(ckpt_dir: str) -> dict:
    """The special token ids that travel with a checkpoint directory (``generation_config.json`` in it or its
    parent, written by conversion and kept by training), else those of its tokenizer (eos = its end-of-document
    token, pad), else ``{}``."""
    for d in (ckpt_dir, os.path.dirname(os.path.abspath(ckpt_dir))):
        path = os.path.join(d, GENERATION_CONFIG)
        if os.path.exists(path):
            with open(path) as f:
                gen = json.load(f)
            return {k: gen[k] for k in SPECIAL if gen.get(k) is not None}
    spec = checkpoint_tokenizer(ckpt_dir)
    if spec is None:
        return {}
    from megakernels_models.data.tokenizer import build_tokenizer

    tok = build_tokenizer(spec)
    return {f"{k}_token_id": getattr(tok, role) for k, role in (("eos", "eod"), ("pad", "pad")) if tok.has(role)}


def _write_json(path: str, value: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
    os.replace(tmp, path)


def checkpoint_tokenizer(ckpt_dir: str) -> str | None:
    """``hf:PATH`` of the tokenizer that travels with a checkpoint directory (or its parent for ``DIR/step-N``),
    or None."""
    for d in (ckpt_dir, os.path.dirname(os.path.abspath(ckpt_dir))):
        path = os.path.join(d, TOKENIZER)
        if os.path.exists(path):
            return f"hf:{path}"
    return None


def megakernels_to_hf(ckpt_dir: str, out_dir: str) -> str:
    """Write a megakernels checkpoint as a HuggingFace directory (config.json + safetensors, the tokenizer and a
    ``generation_config.json`` with the special token ids that travel with it: ``checkpoint_special_tokens``);
    returns ``out_dir``.

    Raises:
        ConversionError: a model HuggingFace's family cannot express (e.g. a pre-norm BERT).
    """
    meta, tensors = read_checkpoint(ckpt_dir)
    cfg = ModelConfig.from_dict(meta["config"])
    spec = family(cfg)
    fam = spec.hf(cfg) if spec.hf is not None else None
    if fam is None:
        raise ConversionError(f"no HuggingFace family for a megakernels {cfg.model!r} model")
    special = checkpoint_special_tokens(ckpt_dir)
    config = {**fam.config_to_theirs(cfg), **special}
    write_hf(apply(fam.rules(cfg), tensors, "to_theirs"), config, out_dir)
    _write_json(os.path.join(out_dir, GENERATION_CONFIG), special)
    spec = checkpoint_tokenizer(ckpt_dir)
    if spec is not None:
        copy_tokenizer(os.path.dirname(spec[3:]), out_dir)
    return out_dir


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help=f"HuggingFace ({', '.join(FAMILIES)}) <-> megakernels checkpoint")
    p.add_argument("direction", choices=["hf-to-megakernels", "megakernels-to-hf"])
    p.add_argument("--input", required=True, help="HF model directory, or megakernels checkpoint directory")
    p.add_argument("--output", required=True, help="megakernels checkpoint directory, or HF model directory")
    p.add_argument(
        "--rope-interleaved",
        action="store_true",
        help="hf-to-megakernels of a Llama: use the "
        "interleaved rotary layout (pairs 2i, 2i+1), permuting the query/key rows to match",
    )
    p.add_argument(
        "--vision",
        metavar="CLIP_DIR",
        help="hf-to-megakernels: a HuggingFace CLIP model (or CLIP vision "
        "model) directory whose vision tower goes in front of the language model, making a vision-language "
        "checkpoint (LLaVA) with a fresh projector; train it first with --freeze vision,lm",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=1234,
        help="with --vision: the projector's initialisation seed (as megakernels train --seed)",
    )
    p.set_defaults(_run=main)


def main(ns) -> int:
    import sys

    from megakernels_models.training.checkpoint import CheckpointError

    try:
        if ns.direction == "hf-to-megakernels":
            out = hf_to_megakernels(ns.input, ns.output, ns.rope_interleaved, ns.vision, ns.seed)
        elif ns.vision is not None:
            raise ConversionError(
                "--vision is for hf-to-megakernels (a vision-language checkpoint converts to "
                "HuggingFace only through its parts)"
            )
        else:
            out = megakernels_to_hf(ns.input, ns.output)
    except (ConversionError, CheckpointError) as e:
        print(f"megakernels convert: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
