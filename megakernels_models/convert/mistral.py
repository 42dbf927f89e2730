"""HuggingFace ``MistralForCausalLM`` <-> megakernels Llama with a sliding window: exact both ways.

Mistral is a Llama whose attention sees only the last ``sliding_window`` positions (query i attends keys j with
``i - window < j <= i``, transformers' mask; ``ModelConfig.sliding_window``, a FlashAttention feature here). The
tensors are ``llama``'s; a window as long as the context is full attention (None).
"""

from __future__ import annotations

from megakernels_models.convert import llama
from megakernels_models.models.config import ModelConfig

MODEL_TYPE = "mistral"
IGNORED = llama.IGNORED
rules, normalize, tied = llama.rules, llama.normalize, llama.tied


def config_to_ours(hf: dict, rope_interleaved: bool = False) -> ModelConfig:
    """The megakernels Llama (with its window) of a HuggingFace Mistral config."""
    return llama.config_to_ours({**hf, "attention_bias": False, "mlp_bias": False}, rope_interleaved)


def config_to_theirs(cfg: ModelConfig) -> dict:
    """The HuggingFace Mistral config of a megakernels Llama with a sliding window."""
    out = llama.config_to_theirs(cfg)
    for key in ("attention_bias", "mlp_bias"):
        out.pop(key)
    return {
        **out,
        "architectures": ["MistralForCausalLM"],
        "model_type": MODEL_TYPE,
        "sliding_window": cfg.sliding_window,
    }
