"""The vision-language family (``--model vlm``): a ViT encoder and a projector in front of a GPT or Llama language
model, the image tokens a prefix of the text (LLaVA) or read by gated cross-attention layers (Flamingo), trained on
captions (with an optional CLIP-style contrastive loss).

Presets: ``vlm-tiny`` and ``vlm-llama-tiny`` for the CPU, ``vlm-7b`` (LLaVA-1.5's ViT-L/14-336 + Llama-2-7B shape).
"""

from __future__ import annotations

import dataclasses

from megakernels.validation import positive_int
from megakernels_models.models.config import ModelConfig, human
from megakernels_models.models.registry import DEFAULT, FamilySpec, families, family, register
from megakernels_models.settings import ArgumentError, setting


def language_models() -> tuple[str, ...]:
    """The families a vision-language model's language model may be (the text-only causal LMs)."""
    return tuple(s.name for s in families() if s.text_generation)


@dataclasses.dataclass(frozen=True)
class VLMConfig(ModelConfig):
    """A vision-language model: the language model's ``ModelConfig`` fields (its family in ``lm``) and the vision
    encoder's, projector's and cross-attention's.

    Attributes:
        lm: the language model's family (default ``registry.DEFAULT``); the architecture fields left None take its
            defaults.
        image_size, patch_size, image_channels: the images (square) and the ViT's patches.
        vision_layers, vision_hidden_size, vision_heads, vision_ffn_hidden_size (default 4x), vision_activation:
            the encoder's Transformer (bidirectional, a BERT-family configuration: ``encoder_config``).
        vision_class_token, vision_pre_norm, vision_final_norm: CLIP's class token, norm before the layers and
            none after them.
        projector_hidden_size: the 2-layer projector's width (default the language model's hidden size).
        cross_attention_every: 0: the image tokens precede the text; N: a gated cross-attention layer after every
            N-th language layer.
        contrastive_coeff, contrastive_temperature: the CLIP-style image-caption loss beside the captions'.
    """

    model: str = "vlm"
    lm: str | None = None
    image_size: int = 32
    patch_size: int = 8
    image_channels: int = 3
    vision_layers: int = 2
    vision_hidden_size: int = 64
    vision_heads: int = 4
    vision_ffn_hidden_size: int | None = None
    vision_activation: str = "gelu_tanh"
    vision_class_token: bool = False
    vision_pre_norm: bool = False
    vision_final_norm: bool = True
    projector_hidden_size: int | None = None
    cross_attention_every: int = 0
    contrastive_coeff: float = 0.0
    contrastive_temperature: float = 0.07
    family = "vlm"

    def _check_family(self) -> None:
        if self.lm is None:
            object.__setattr__(self, "lm", DEFAULT)
        if self.lm not in language_models():
            raise ValueError(
                f"ModelConfig: lm (the language model of a vlm) must be one of {language_models()}, got {self.lm!r}"
            )
        for name in (
            "image_size",
            "patch_size",
            "image_channels",
            "vision_layers",
            "vision_hidden_size",
            "vision_heads",
        ):
            positive_int(getattr(self, name), name, where="ModelConfig")
        if self.image_size % self.patch_size:
            raise ValueError(
                f"ModelConfig: image_size={self.image_size} is not divisible by patch_size={self.patch_size}"
            )
        if self.vision_hidden_size % self.vision_heads:
            raise ValueError(
                f"ModelConfig: vision_hidden_size={self.vision_hidden_size} is not divisible by "
                f"vision_heads={self.vision_heads}"
            )
        if self.vision_activation not in ("gelu", "gelu_tanh"):
            raise ValueError(
                f"ModelConfig: vision_activation must be 'gelu' or 'gelu_tanh', got {self.vision_activation!r}"
            )
        if self.projector_hidden_size is None:
            object.__setattr__(self, "projector_hidden_size", self.hidden_size)
        positive_int(self.projector_hidden_size, "projector_hidden_size", where="ModelConfig")
        positive_int(self.cross_attention_every, "cross_attention_every", minimum=0, where="ModelConfig")
        if self.num_experts:
            raise ValueError("ModelConfig: a vision-language model's language model is dense (num_experts=0)")
        if not self.contrastive_coeff >= 0 or not self.contrastive_temperature > 0:
            raise ValueError("ModelConfig: contrastive_coeff must be >= 0 and contrastive_temperature > 0")

    def family_defaults(self) -> dict:
        return family(self.lm).config_class.DEFAULTS

    @property
    def num_patches(self) -> int:
        """Patches per image (``(image_size / patch_size)²``)."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_image_tokens(self) -> int:
        """Image tokens the vision encoder gives per image: the patches, plus a class token when it has one."""
        return self.num_patches + self.vision_class_token

    def encoder_config(self) -> ModelConfig:
        """The vision encoder's Transformer as a bidirectional (BERT-family) configuration: its layers are the
        same ``TransformerLayer`` every family stacks."""
        from megakernels_models.models.bert import BertConfig

        return BertConfig(
            num_layers=self.vision_layers,
            hidden_size=self.vision_hidden_size,
            num_heads=self.vision_heads,
            seq_length=self.num_image_tokens,
            vocab_size=1,
            ffn_hidden_size=self.vision_ffn_hidden_size,
            activation=self.vision_activation,
            dropout=self.dropout,
            attention_dropout=self.attention_dropout,
            layernorm_eps=self.layernorm_eps,
            init_std=self.init_std,
        )

    def language_config(self) -> ModelConfig:
        """The language model alone (of family ``lm``, with this model's shared fields)."""
        return family(self.lm).config_class(**self.shared())

    def has_cross_attention_after(self, layer: int) -> bool:
        """Whether a gated cross-attention layer follows language layer ``layer`` (every ``cross_attention_every``
        layers; never with 0, where the image tokens are the sequence's prefix)."""
        n = self.cross_attention_every
        return n > 0 and (layer + 1) % n == 0

    def _follow(self, changes: dict) -> None:
        if "hidden_size" in changes and "projector_hidden_size" not in changes:
            if self.projector_hidden_size == self.hidden_size:
                changes["projector_hidden_size"] = changes["hidden_size"]

    def _layout_limits(self) -> dict:
        v = self.encoder_config()
        no_sp = "is not supported for --model vlm (the image tokens are not split over ranks)"
        return {
            "tp_widths": (
                ("vision_heads", v.num_heads),
                ("vision_hidden_size", v.hidden_size),
                ("vision ffn_hidden_size", v.ffn_hidden_size),
                ("projector_hidden_size", self.projector_hidden_size),
            ),
            "sequence_parallel": no_sp,
            "context_parallel": " " + no_sp,
        }

    def flops_per_token(self, recompute: str = "none") -> float:
        """Per *text* token: the FLOPs of a sample (encoder, projector and language model; ``costs``) over
        ``seq_length``."""
        from megakernels_models.models.config import RECOMPUTE
        from megakernels_models.models.vlm.costs import vlm_flops_per_sample

        if recompute not in RECOMPUTE:
            raise ValueError(f"flops_per_token: recompute must be one of {RECOMPUTE}, got {recompute!r}")
        return vlm_flops_per_sample(self, recompute) / self.seq_length

    def report(self) -> tuple[dict, list[str]]:
        per_sample = self.flops_per_token("none") * self.seq_length
        line = (
            f"vision: {self.image_size}px images, patch {self.patch_size}, {self.num_image_tokens} image tokens "
            f"per sample, encoder {self.vision_layers} layers × {self.vision_hidden_size}; "
            f"{human(per_sample, 'FLOP')} per sample (encoder, projector and language model)"
        )
        return {"flops_per_sample": per_sample, "image_tokens_per_sample": self.num_image_tokens}, [line]


VISION = "vision-language (--model vlm)"


@dataclasses.dataclass
class VisionSettings:
    """``megakernels train``'s flags for this family (each replaces the preset's field of the same name)."""

    lm: str | None = setting(
        None, "the language model of a vlm (default: the preset's)", VISION, choices=language_models
    )
    image_size: int | None = setting(None, "image side in pixels (default: the preset's)", VISION)
    patch_size: int | None = setting(
        None, "ViT patch side in pixels; must divide --image-size (default: the preset's)", VISION
    )
    vision_layers: int | None = setting(None, "vision encoder layers (default: the preset's)", VISION)
    vision_hidden_size: int | None = setting(None, "vision encoder width (default: the preset's)", VISION)
    vision_heads: int | None = setting(None, "vision encoder attention heads (default: the preset's)", VISION)
    cross_attention_every: int | None = setting(
        None,
        "0: image tokens before the text (LLaVA); N: a gated "
        "cross-attention layer after every N-th language layer (Flamingo) "
        "(default: the preset's)",
        VISION,
    )
    contrastive_coeff: float | None = setting(
        None, "weight of the CLIP-style image-caption contrastive loss (default: the preset's, 0)", VISION
    )

    @staticmethod
    def check(a) -> None:
        """The flags' own rules, naming them."""
        for name in ("image_size", "patch_size", "vision_layers", "vision_hidden_size", "vision_heads"):
            positive_int(getattr(a, name), "--" + name.replace("_", "-"), allow_none=True, error=ArgumentError)
        positive_int(
            a.cross_attention_every, "--cross-attention-every", minimum=0, allow_none=True, error=ArgumentError
        )
        if a.image_size is not None and a.patch_size is not None and a.image_size % a.patch_size:
            raise ArgumentError(
                f"--image-size {a.image_size} is not divisible by --patch-size {a.patch_size} (an "
                "image is cut into whole patches)"
            )


_TINY = dict(
    image_size=32,
    patch_size=8,
    vision_layers=2,
    vision_hidden_size=64,
    vision_heads=4,
    num_layers=4,
    hidden_size=128,
    num_heads=4,
    seq_length=48,
    vocab_size=261,
    dropout=0.0,
    attention_dropout=0.0,
)
PRESETS = {
    # For the CPU: a 2-layer 64-wide ViT over 32×32 images and a 4-layer GPT; vlm-tiny reads 16-pixel patches (a 2×2
    # grid, one per cell of the embedded shapes) and trains with the contrastive loss beside the captions' (with
    # 8-pixel patches, or without it, its default run of 300 steps did not learn to read the shapes). The same encoder
    # at 8-pixel patches (16 image tokens) with
    # Flamingo-style gated cross-attention every second layer over a tiny Llama.
    "vlm-tiny": VLMConfig(lm="gpt", **{**_TINY, "patch_size": 16}, contrastive_coeff=0.5),
    "vlm-llama-tiny": VLMConfig(lm="llama", **{**_TINY, "num_kv_heads": 2}, cross_attention_every=2),
    # LLaVA-1.5 shape: a ViT-L/14 (CLIP) encoder at 336 px (576 patches) and a Llama-2-7B.
    "vlm-7b": VLMConfig(
        lm="llama",
        image_size=336,
        patch_size=14,
        vision_layers=24,
        vision_hidden_size=1024,
        vision_heads=16,
        vision_ffn_hidden_size=4096,
        vision_activation="gelu",
        vision_class_token=True,
        vision_pre_norm=True,
        vision_final_norm=False,
        projector_hidden_size=4096,
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        seq_length=2048,
        vocab_size=32000,
        ffn_hidden_size=11008,
        dropout=0.0,
        attention_dropout=0.0,
        layernorm_eps=1e-5,
    ),
}


def _model():
    from megakernels_models.models.vlm.model import VLMModel

    return VLMModel


def _task(config, model_class):
    from megakernels_models.models.vlm.task import VisionLanguageTask

    return VisionLanguageTask(config, model_class)


SPEC = register(
    FamilySpec(
        "vlm",
        "vision-language model",
        VLMConfig,
        _model,
        _task,
        "captions",
        PRESETS,
        text_generation=False,
        settings=VisionSettings,
    )
)
