"""HuggingFace ``Qwen3ForCausalLM`` (Qwen 3 dense) <-> megakernels Qwen: a Llama with an RMSNorm over each query and
key head (``qk_norm``: ``self_attn.q_norm`` / ``k_norm``) and no biases; exact both ways (the tensor rules are
``llama``'s).

Refused, naming the setting: a sliding window shorter than the context, attention biases, and what ``llama``
refuses.
"""

from __future__ import annotations

from megakernels_models.convert import llama, qwen2
from megakernels_models.convert.common import ConversionError
from megakernels_models.models.config import ModelConfig

MODEL_TYPE = "qwen3"
IGNORED = llama.IGNORED
rules, normalize, tied = llama.rules, llama.normalize, llama.tied


def config_to_ours(hf: dict, rope_interleaved: bool = False) -> ModelConfig:
    """The megakernels Qwen of a HuggingFace Qwen 3 config."""
    qwen2.check_window(hf)
    if hf.get("attention_bias"):
        raise ConversionError("attention_bias=True: megakernels' Qwen 3 has no attention biases")
    base = llama.config_to_ours(
        {**hf, "attention_bias": False, "mlp_bias": False, "sliding_window": None}, rope_interleaved
    )
    return ModelConfig("qwen", **{**base.shared(), "qk_norm": True, "qkv_bias": False, "bias": False})


def config_to_theirs(cfg: ModelConfig) -> dict:
    """The HuggingFace Qwen 3 config of a megakernels Qwen with q/k norms."""
    if not cfg.qk_norm or cfg.qkv_bias or cfg.bias:
        raise ConversionError("Qwen 3 has q/k norms and no biases; this model is not such a Qwen")
    out = llama.config_to_theirs(cfg)
    out.pop("mlp_bias")
    return {**out, "architectures": ["Qwen3ForCausalLM"], "model_type": MODEL_TYPE, "use_sliding_window": False}
