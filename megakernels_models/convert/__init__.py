"""``megakernels convert``: HuggingFace models (config.json + safetensors) <-> megakernels checkpoints.

    megakernels convert hf-to-megakernels --input HF_DIR --output CKPT_DIR     # then: train --load CKPT_DIR
    megakernels convert megakernels-to-hf --input CKPT_DIR --output HF_DIR     # then: from_pretrained(HF_DIR)

One module per family (``gpt2``, ``bert``) holds its config translation both ways and one table of tensor rules
(``common.Rule``) applied in both directions. The megakernels side is a DCP checkpoint directory as
``megakernels train --save`` writes it (``DIR/step-N`` + ``latest``), holding the model only (the optimizer starts
fresh when training resumes from it) at step 0, in full-model coordinates (so it loads at any layout). Nothing is
downloaded; ``transformers`` is not needed (only ``safetensors``).
"""

from __future__ import annotations

from megakernels_models.config import ModelConfig
from megakernels_models.convert import bert, gpt2
from megakernels_models.convert.common import ConversionError, apply, read_checkpoint, read_hf, write_checkpoint, \
    write_hf

FAMILIES = {m.MODEL_TYPE: m for m in (gpt2, bert)}
# megakernels model family -> the HuggingFace family it is written as
_OURS = {"gpt": gpt2, "bert": bert}

__all__ = ["hf_to_megakernels", "megakernels_to_hf", "write_checkpoint", "read_checkpoint", "ConversionError",
           "ModelConfig", "FAMILIES", "add_parser", "main"]


def _family(model_type):
    if model_type not in FAMILIES:
        raise ConversionError(f"model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def hf_to_megakernels(hf_dir: str, out_dir: str) -> str:
    """Convert a HuggingFace model directory into a megakernels checkpoint directory; returns the checkpoint's path.

    Raises:
        ConversionError: an unsupported model type or setting, a missing tensor, or an occupied ``out_dir``.
    """
    hf, tensors = read_hf(hf_dir)
    fam = _family(hf.get("model_type"))
    cfg = fam.config_to_ours(hf)
    ours = apply(fam.rules(cfg), fam.normalize(tensors), "to_ours")
    return write_checkpoint(ours, cfg, out_dir, f"hf-{fam.MODEL_TYPE}")


def megakernels_to_hf(ckpt_dir: str, out_dir: str) -> str:
    """Write a megakernels checkpoint as a HuggingFace directory (config.json + safetensors); returns ``out_dir``.

    Raises:
        ConversionError: a model HuggingFace's family cannot express (e.g. a pre-norm BERT).
    """
    meta, tensors = read_checkpoint(ckpt_dir)
    cfg = ModelConfig(**meta["config"])
    fam = _OURS.get(cfg.model)
    if fam is None:
        raise ConversionError(f"no HuggingFace family for a megakernels {cfg.model!r} model")
    config = fam.config_to_theirs(cfg)
    return write_hf(apply(fam.rules(cfg), tensors, "to_theirs"), config, out_dir)


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help=f"HuggingFace ({', '.join(FAMILIES)}) <-> megakernels checkpoint")
    p.add_argument("direction", choices=["hf-to-megakernels", "megakernels-to-hf"])
    p.add_argument("--input", required=True, help="HF model directory, or megakernels checkpoint directory")
    p.add_argument("--output", required=True, help="megakernels checkpoint directory, or HF model directory")
    p.set_defaults(_run=main)


def main(ns) -> int:
    import sys

    from megakernels_models.checkpoint import CheckpointError

    try:
        if ns.direction == "hf-to-megakernels":
            out = hf_to_megakernels(ns.input, ns.output)
        else:
            out = megakernels_to_hf(ns.input, ns.output)
    except (ConversionError, CheckpointError) as e:
        print(f"megakernels convert: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
