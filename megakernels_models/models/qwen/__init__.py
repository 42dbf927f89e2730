"""The Qwen family (Qwen 2.5 and Qwen 3 dense): Llama-architecture causal language models (RMSNorm, rotary
positions with θ 1e6, SwiGLU, grouped-query attention), with biases on the query/key/value projections only
(Qwen 2.5) or an RMSNorm over each query and key head and no biases (Qwen 3).

Presets: ``qwen-tiny`` (the CPU default, Qwen 3 style), ``qwen2.5-7b`` (7.61 B parameters), ``qwen3-8b`` (8.19 B),
``qwen3-30b-a3b`` (Qwen 3 MoE: 30.5 B parameters, 3.3 B active per token).
"""

from __future__ import annotations

import dataclasses

from megakernels_models.models.config import ModelConfig, sized
from megakernels_models.models.registry import FamilySpec, register
from megakernels_models.models.tasks import CausalLMTask
from megakernels_models.settings import setting


@dataclasses.dataclass(frozen=True)
class QwenConfig(ModelConfig):
    """A Qwen model (``ModelConfig``'s fields, Qwen's defaults: ``qkv_bias`` and ``qk_norm`` tell 2.5 from 3)."""

    model: str = "qwen"
    family = "qwen"
    DEFAULTS = dict(norm="rmsnorm", position_embedding="rope", activation="swiglu", bias=False, tie_embeddings=False)


@dataclasses.dataclass
class QwenSettings:
    """``megakernels train``'s flags for this family (each replaces the preset's field of the same name)."""

    qkv_bias: bool | None = setting(
        None, "biases on the query, key and value projections (Qwen 2.5) (default: the preset's)", "Qwen"
    )
    qk_norm: bool | None = setting(
        None,
        "an RMSNorm over each query and key head before the rotary embedding (Qwen 3) (default: the preset's)",
        "Qwen",
    )


def _qwen(*sizes: int, **kw) -> QwenConfig:
    return sized(QwenConfig, *sizes, layernorm_eps=1e-6, rope_theta=1e6, **kw)


PRESETS = {
    "qwen-tiny": _qwen(4, 256, 8, 2, 256, 261, 704, qk_norm=True),  # byte-level vocabulary, for the CPU
    "qwen2.5-7b": _qwen(28, 3584, 28, 4, 8192, 152064, 18944, qkv_bias=True),
    "qwen3-8b": _qwen(36, 4096, 32, 8, 8192, 151936, 12288, qk_norm=True),
    # Qwen 3 MoE: 128 experts of 768, top 8 renormalised, no shared expert; heads of 128 over a 2048-wide model
    "qwen3-30b-a3b": _qwen(
        48,
        2048,
        32,
        4,
        8192,
        151936,
        6144,
        qk_norm=True,
        head_dim=128,
        num_experts=128,
        moe_top_k=8,
        moe_ffn_hidden_size=768,
        moe_aux_loss_coeff=0.001,
    ),
}


def _model():
    from megakernels_models.models.qwen.model import QwenModel

    return QwenModel


def _hf(config):
    from megakernels_models.convert import qwen2, qwen3, qwen3_moe

    return (qwen3_moe if config.num_experts else qwen3) if config.qk_norm else qwen2


SPEC = register(
    FamilySpec("qwen", "Qwen", QwenConfig, _model, CausalLMTask, "tokens", PRESETS, hf=_hf, settings=QwenSettings)
)
