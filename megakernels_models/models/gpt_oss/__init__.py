"""The gpt-oss family (OpenAI's open mixture-of-experts models): a causal language model whose every MLP is a
mixture of experts with biases (the router's and each expert's gate/up and down projections), routed to the top 4
with the softmax over the chosen logits, the experts' clamped SwiGLU (``g' = min(g, 7)``,
``g' · sigmoid(1.702 g') · (clamp(u, ±7) + 1)``), biases on the query, key, value and output projections, an
attention sink per head, sliding-window (128) and full layers alternating (the first sliding), YaRN rotary scaling
(factor 32 over 4096 positions, the ramp untruncated) and RMSNorm.

Presets: ``gpt-oss-tiny`` (the CPU default), ``gpt-oss-20b`` (20.9 B parameters, 3.6 B active per token) and
``gpt-oss-120b`` (116.8 B, 5.1 B active); both published models at 4096 tokens a sample (their pre-training length;
YaRN carries them to 131072, ``--seq-length``).
"""

from __future__ import annotations

import dataclasses
import math

from megakernels_models.models.config import ModelConfig, sized
from megakernels_models.models.registry import FamilySpec, register
from megakernels_models.models.tasks import CausalLMTask
from megakernels_models.settings import setting


@dataclasses.dataclass(frozen=True)
class GptOssConfig(ModelConfig):
    """A gpt-oss model (``ModelConfig``'s fields, gpt-oss's defaults) and its own fields.

    Attributes:
        swiglu_limit: the experts' clamp bound (``ops.swiglu``'s ``limit``: the gate clamped above, the up
            projection on both sides).
        swiglu_alpha: the slope of the experts' sigmoid (``ops.swiglu``'s ``alpha``).
    """

    model: str = "gpt_oss"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    sinks: bool = True
    moe_top_k: int = 4
    family = "gpt_oss"
    moe_biases = True
    moe_softmax_topk = True
    DEFAULTS = dict(norm="rmsnorm", position_embedding="rope", activation="swiglu", bias=True, tie_embeddings=False)

    def _check_family(self) -> None:
        for name in ("swiglu_limit", "swiglu_alpha"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v)):
                raise ValueError(f"GptOssConfig: {name} must be a finite number > 0, got {v!r}")
        if not self.num_experts:
            raise ValueError("GptOssConfig: num_experts must be > 0 (every gpt-oss MLP is a mixture of experts)")
        if self.moe_layer_freq != 1 or self.moe_shared_experts:
            raise ValueError(
                "GptOssConfig: gpt-oss has a mixture of experts in every layer (moe_layer_freq 1) and no shared "
                f"experts, got moe_layer_freq={self.moe_layer_freq}, moe_shared_experts={self.moe_shared_experts}"
            )

    def _check_architecture(self) -> None:
        if self.norm != "rmsnorm" or self.position_embedding != "rope" or self.norm_position != "pre":
            raise ValueError("GptOssConfig: gpt-oss is a pre-norm RMSNorm model with rotary positions")
        if self.activation != "swiglu":
            raise ValueError(f"GptOssConfig: the experts' activation is the clamped SwiGLU, got {self.activation!r}")

    @property
    def swiglu_clamp(self) -> tuple[float, float]:
        return float(self.swiglu_limit), float(self.swiglu_alpha)


@dataclasses.dataclass
class GptOssSettings:
    """``megakernels train``'s flags for this family (each replaces the preset's field of the same name)."""

    swiglu_limit: float | None = setting(None, "the experts' SwiGLU clamp bound (default: the preset's, 7)", "gpt-oss")
    swiglu_alpha: float | None = setting(
        None, "the slope of the experts' SwiGLU sigmoid (default: the preset's, 1.702)", "gpt-oss"
    )


def pattern(num_layers: int) -> tuple[str, ...]:
    """gpt-oss's layer types: sliding and full alternating, the first sliding (transformers' rule)."""
    return tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers))


def _gpt_oss(layers, hidden, heads, kv, seq, vocab, ffn, experts, *, window, head_dim, original) -> GptOssConfig:
    return sized(
        GptOssConfig,
        layers,
        hidden,
        heads,
        kv,
        seq,
        vocab,
        ffn,
        num_experts=experts,
        moe_top_k=4,
        moe_aux_loss_coeff=0.001,
        layernorm_eps=1e-5,
        head_dim=head_dim,
        sliding_window=window,
        layer_types=pattern(layers),
        rope_theta=150000.0,
        rope_scaling="yarn",
        rope_scaling_factor=32.0,
        rope_original_max_positions=original,
        rope_beta_fast=32.0,
        rope_beta_slow=1.0,
        rope_truncate=False,
    )


PRESETS = {
    # byte-level vocabulary, for the CPU: both layer types, a window shorter than the sequence, YaRN over 64 positions
    "gpt-oss-tiny": _gpt_oss(4, 128, 8, 2, 256, 261, 128, 8, window=64, head_dim=32, original=64),
    "gpt-oss-20b": _gpt_oss(24, 2880, 64, 8, 4096, 201088, 2880, 32, window=128, head_dim=64, original=4096),
    "gpt-oss-120b": _gpt_oss(36, 2880, 64, 8, 4096, 201088, 2880, 128, window=128, head_dim=64, original=4096),
}


def _model():
    from megakernels_models.models.gpt_oss.model import GptOssModel

    return GptOssModel


def _hf(config):
    from megakernels_models.convert import gpt_oss

    return gpt_oss


SPEC = register(
    FamilySpec(
        "gpt_oss", "gpt-oss", GptOssConfig, _model, CausalLMTask, "tokens", PRESETS, hf=_hf, settings=GptOssSettings
    )
)
