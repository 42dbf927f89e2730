"""The Qwen family (Qwen 2.5 and Qwen 3 dense): Llama-architecture causal language models (RMSNorm, rotary
positions with θ 1e6, SwiGLU, grouped-query attention), with biases on the query/key/value projections only
(Qwen 2.5) or an RMSNorm over each query and key head and no biases (Qwen 3).

Presets: ``qwen-tiny`` (the CPU default, Qwen 3 style), ``qwen2.5-7b`` (7.61 B parameters), ``qwen3-8b`` (8.19 B).
"""

from __future__ import annotations

import dataclasses

from megakernels_models.models.config import ModelConfig, sized
from megakernels_models.models.registry import FamilySpec, causal_lm_task, register


@dataclasses.dataclass(frozen=True)
class QwenConfig(ModelConfig):
    """A Qwen model (``ModelConfig``'s fields, Qwen's defaults: ``qkv_bias`` and ``qk_norm`` tell 2.5 from 3)."""

    model: str = "qwen"
    family = "qwen"
    DEFAULTS = dict(norm="rmsnorm", position_embedding="rope", activation="swiglu", bias=False, tie_embeddings=False)


def _qwen(*sizes: int, **kw) -> QwenConfig:
    return sized(QwenConfig, *sizes, layernorm_eps=1e-6, rope_theta=1e6, **kw)


PRESETS = {
    "qwen-tiny": _qwen(4, 256, 8, 2, 256, 261, 704, qk_norm=True),  # byte-level vocabulary, for the CPU
    "qwen2.5-7b": _qwen(28, 3584, 28, 4, 8192, 152064, 18944, qkv_bias=True),
    "qwen3-8b": _qwen(36, 4096, 32, 8, 8192, 151936, 12288, qk_norm=True),
}


def _model():
    from megakernels_models.models.qwen.model import QwenModel

    return QwenModel


def _hf(config):
    from megakernels_models.convert import qwen2, qwen3

    return qwen3 if config.qk_norm else qwen2


SPEC = register(FamilySpec("qwen", "Qwen", QwenConfig, _model, causal_lm_task, "tokens", PRESETS, hf=_hf))
