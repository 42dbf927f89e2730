"""The Llama family: a causal language model of the Llama 2 / Llama 3 architecture: RMSNorm, rotary positions,
SwiGLU MLP, no biases, its own output layer (tied in the small Llama 3.2 models); grouped-query attention;
mixture-of-experts layers as an option (Mixtral); sliding-window attention as an option (Mistral).

Presets: ``llama-tiny`` (the CPU default), Llama 3.2 1B, Llama 3 8B and Llama 2 7B shapes, a tiny MoE, Mixtral
8x7B (46.7B parameters, 12.9B active per token), and Llama 3.1 8B / 70B and 3.2 1B / 3B with their llama3 rotary
scaling (8.03 B, 70.6 B, 1.24 B, 3.21 B parameters), and Mistral 7B (7.24B; a 4096-token sliding window).
"""

from __future__ import annotations

import dataclasses

from megakernels_models.models.config import ModelConfig, sized
from megakernels_models.models.registry import FamilySpec, register
from megakernels_models.models.tasks import CausalLMTask


@dataclasses.dataclass(frozen=True)
class LlamaConfig(ModelConfig):
    """A Llama model (``ModelConfig``'s fields, Llama's defaults)."""

    model: str = "llama"
    family = "llama"
    DEFAULTS = dict(norm="rmsnorm", position_embedding="rope", activation="swiglu", bias=False, tie_embeddings=False)


def _llama(*sizes: int, **kw) -> LlamaConfig:
    return sized(LlamaConfig, *sizes, layernorm_eps=1e-5, **kw)


_LLAMA31 = dict(rope_theta=500000.0, rope_scaling="llama3", rope_scaling_factor=8.0)
_LLAMA32 = dict(rope_theta=500000.0, rope_scaling="llama3", rope_scaling_factor=32.0)
PRESETS = {
    "llama-tiny": _llama(4, 256, 8, 2, 256, 261, 704, rope_theta=10000.0),  # byte-level vocabulary, for the CPU
    "llama3-1b": _llama(16, 2048, 32, 8, 8192, 128256, 8192, rope_theta=500000.0, tie_embeddings=True),
    "llama3-8b": _llama(32, 4096, 32, 8, 8192, 128256, 14336, rope_theta=500000.0),
    "llama-moe-tiny": _llama(4, 256, 8, 2, 256, 261, 704, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=352),
    "mixtral-8x7b": _llama(
        32, 4096, 32, 8, 32768, 32000, 14336, rope_theta=1e6, num_experts=8, moe_top_k=2, moe_aux_loss_coeff=0.02
    ),
    "llama2-7b": _llama(32, 4096, 32, 32, 4096, 32000, 11008, rope_theta=10000.0),
    # Llama 3.1 / 3.2 (128k context through llama3 rotary scaling; trained here at 8k tokens a sample)
    "llama3.1-8b": _llama(32, 4096, 32, 8, 8192, 128256, 14336, **_LLAMA31),
    "llama3.1-70b": _llama(80, 8192, 64, 8, 8192, 128256, 28672, **_LLAMA31),
    "llama3.2-1b": _llama(16, 2048, 32, 8, 8192, 128256, 8192, **_LLAMA32, tie_embeddings=True),
    "llama3.2-3b": _llama(28, 3072, 24, 8, 8192, 128256, 8192, **_LLAMA32, tie_embeddings=True),
    "mistral-7b": _llama(32, 4096, 32, 8, 32768, 32000, 14336, rope_theta=1e6, sliding_window=4096),
}


def _model():
    from megakernels_models.models.llama.model import LlamaModel

    return LlamaModel


def _hf(config):
    from megakernels_models.convert import llama, mistral, mixtral

    return mixtral if config.num_experts else mistral if config.sliding_window else llama


SPEC = register(FamilySpec("llama", "Llama", LlamaConfig, _model, CausalLMTask, "tokens", PRESETS, hf=_hf))
