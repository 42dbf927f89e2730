"""HuggingFace CLIP vision tower -> the vision encoder of a megakernels vision-language model (``vision.py``).

A ``CLIPVisionModel`` is a ViT with a class token, learned positions over ``1 + (image / patch)²`` tokens, a
LayerNorm before the layers (``pre_layrnorm``) and pre-norm layers with biases; its ``last_hidden_state`` is the
features LLaVA projects. It converts exactly into our encoder with ``vision_class_token``, ``vision_pre_norm`` and
no final norm (``post_layernorm`` only normalises the pooled class token, which a vision-language model does not
use): the patch convolution becomes the patch linear over (row, col, channel)-flattened patches (bias zero), the
query/key/value projections our fused head-major QKV. Our fused MLP is GeLU (erf or tanh); CLIP's ``quick_gelu``
(OpenAI's checkpoints) is refused rather than approximated.

    fields = vision_fields(clip.config)           # ModelConfig fields of the encoder
    cfg = VLMConfig(**fields, ...)
    encoder.load_state_dict(vision_state_dict(clip.state_dict(), cfg))

``megakernels convert hf-to-megakernels --input LM_DIR --vision CLIP_DIR`` (``with_clip_vision``) puts a CLIP vision
tower in front of a converted GPT-2 or Llama, LLaVA's starting point: a vision-language checkpoint whose projector
is freshly initialised (from ``--seed``), to be trained first with ``--freeze vision,lm``.
"""

from __future__ import annotations

import torch

from megakernels_models.convert.bert import HF_ACTIVATIONS, split_qkv_rule
from megakernels_models.convert.common import ConversionError, Rule, apply, copy, read_hf
from megakernels_models.models.config import ModelConfig
from megakernels_models.models.vlm import VLMConfig, language_models

# What a CLIPModel holds besides the vision tower, which a vision-language model does not use: the text tower and
# the two contrastive projections, and the norm of the pooled class token (``post_layernorm``); position id buffers.
IGNORED = (
    r"^text_model\.",
    r"^(text|visual)_projection\.",
    r"^logit_scale$",
    r"post_layernorm\.",
    r"\.position_ids$",
)


def vision_fields(hf) -> dict:
    """The ``ModelConfig`` fields of the encoder of a ``CLIPVisionConfig`` (or its dict).

    Raises:
        ConversionError: an activation our fused MLP does not compute (``quick_gelu``).
    """
    hf = hf if isinstance(hf, dict) else hf.to_dict()
    act = HF_ACTIVATIONS.get(hf.get("hidden_act"))
    if act is None:
        raise ConversionError(
            f"hidden_act {hf.get('hidden_act')!r}: megakernels' fused MLP computes GeLU (erf or "
            "tanh), not this activation"
        )
    return dict(
        image_size=hf["image_size"],
        patch_size=hf["patch_size"],
        image_channels=hf.get("num_channels", 3),
        vision_layers=hf["num_hidden_layers"],
        vision_hidden_size=hf["hidden_size"],
        vision_heads=hf["num_attention_heads"],
        vision_ffn_hidden_size=hf["intermediate_size"],
        vision_activation=act,
        vision_class_token=True,
        vision_pre_norm=True,
        vision_final_norm=False,
        layernorm_eps=hf.get("layer_norm_eps", 1e-5),
    )


def _patch_rule(ours: str, theirs: str, channels: int, patch: int) -> Rule:
    """Conv weight ``[d, C, p, p]`` <-> our patch linear ``[d, p·p·C]`` ((row, col, channel) order)."""
    to_ours = lambda ts: [ts[0].permute(0, 2, 3, 1).reshape(ts[0].shape[0], -1).contiguous()]  # noqa: E731
    to_theirs = lambda ts: [
        ts[0]
        .reshape(ts[0].shape[0], patch, patch, channels)
        .permute(0, 3, 1, 2)  # noqa: E731
        .contiguous()
    ]
    return Rule((ours,), (theirs,), to_ours, to_theirs)


def rules(cfg: ModelConfig, prefix: str = "") -> list[Rule]:
    """Our encoder's names (``VisionEncoder.state_dict()``) <-> a ``CLIPVisionModel``'s (``prefix``: what precedes
    ``embeddings.``, e.g. ``vision_model.`` in a ``CLIPModel``)."""
    e = f"{prefix}embeddings."
    out = [
        _patch_rule("patch.weight", f"{e}patch_embedding.weight", cfg.image_channels, cfg.patch_size),
        copy("positions.weight", f"{e}position_embedding.weight"),
        copy("class_token", f"{e}class_embedding"),
    ]
    for x in ("weight", "bias"):
        out.append(copy(f"pre_norm.{x}", f"{prefix}pre_layrnorm.{x}"))
    for i in range(cfg.vision_layers):
        a, m = f"{prefix}encoder.layers.{i}.", f"layers.{i}."
        for x in ("weight", "bias"):
            out.append(
                split_qkv_rule(
                    f"{m}attention.qkv.{x}", tuple(f"{a}self_attn.{y}_proj.{x}" for y in "qkv"), cfg.vision_heads
                )
            )
            for ours, theirs in (
                ("attention.proj", "self_attn.out_proj"),
                ("input_norm", "layer_norm1"),
                ("mlp.fc1", "mlp.fc1"),
                ("mlp.fc2", "mlp.fc2"),
                ("post_attention_norm", "layer_norm2"),
            ):
                out.append(copy(f"{m}{ours}.{x}", f"{a}{theirs}.{x}"))
    return out


def vision_state_dict(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our ``VisionEncoder`` state dict (tp 1) from a ``CLIPVisionModel``'s (or a ``CLIPModel``'s) tensors; the patch
    bias, which CLIP's convolution lacks, is zero.

    Raises:
        ConversionError: a tensor is missing (naming it), or ``cfg`` is not a CLIP-shaped encoder.
    """
    if not (cfg.vision_class_token and cfg.vision_pre_norm and not cfg.vision_final_norm):
        raise ConversionError(
            "a CLIP vision tower needs vision_class_token=True, vision_pre_norm=True and "
            "vision_final_norm=False (see vision_fields)"
        )
    prefix = "vision_model." if "vision_model.embeddings.patch_embedding.weight" in tensors else ""
    out = apply(rules(cfg, prefix), tensors, "to_ours", IGNORED)
    out["patch.bias"] = torch.zeros(cfg.vision_hidden_size, dtype=out["patch.weight"].dtype)
    return out


def with_clip_vision(
    cfg: ModelConfig, tensors: dict[str, torch.Tensor], clip_dir: str, seed: int
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A vision-language model (``VLMConfig``, image tokens a prefix) from a converted language model (``cfg``,
    its full tensors) and the HuggingFace CLIP directory ``clip_dir`` (a ``CLIPVisionModel`` or a ``CLIPModel``,
    whose vision tower is taken): the vision tensors under ``vision.``, a projector as wide as the language model
    initialised from ``seed`` (as ``megakernels train --seed`` would) under ``projector.``.

    Raises:
        ConversionError: ``clip_dir`` is not a CLIP model, the language model is not a dense GPT or Llama, or the
            two models' LayerNorm epsilons differ (one ``layernorm_eps`` serves both).
    """
    hf, clip = read_hf(clip_dir)
    if hf.get("model_type") not in ("clip", "clip_vision_model"):
        raise ConversionError(
            f"--vision {clip_dir}: model_type {hf.get('model_type')!r} is not a CLIP model "
            "('clip' or 'clip_vision_model')"
        )
    if cfg.model not in language_models() or cfg.num_experts:
        raise ConversionError(
            f"--vision: the language model of a vision-language model must be a dense "
            f"{' or '.join(language_models())}, got a {cfg.model} with {cfg.num_experts} experts"
        )
    fields = vision_fields(hf["vision_config"] if hf["model_type"] == "clip" else hf)
    eps = fields.pop("layernorm_eps")
    if eps != cfg.layernorm_eps:
        raise ConversionError(
            f"--vision: CLIP's layer_norm_eps {eps:g} differs from the language model's "
            f"{cfg.layernorm_eps:g} (megakernels uses one layernorm_eps for both)"
        )
    vlm = VLMConfig(**cfg.shared(), lm=cfg.model, **fields)
    out = dict(tensors)
    out.update({f"vision.{k}": v for k, v in vision_state_dict(clip, vlm).items()})
    out.update({f"projector.{k}": v for k, v in _fresh_projector(vlm, seed).items()})
    return vlm, out


def _fresh_projector(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """The projector's full tensors as ``megakernels train --seed seed`` initialises them (built at tp 1)."""
    from megakernels.parallel import state
    from megakernels.parallel.launch import single_process_world
    from megakernels_models.models.vlm.vision import Projector

    if state.is_initialized():
        return Projector(cfg, seed).state_dict()
    with single_process_world(parallel=True):
        return Projector(cfg, seed).state_dict()
