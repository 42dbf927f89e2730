"""HuggingFace ``Qwen2ForCausalLM`` (Qwen 2 / 2.5) <-> megakernels Qwen: a Llama whose query, key and value
projections have biases (``qkv_bias``) and whose output projection and MLP have none; exact both ways (the tensor
rules are ``llama``'s).

Refused, naming the setting: a sliding window shorter than the context (``use_sliding_window``), and what
``llama`` refuses.
"""

from __future__ import annotations

from megakernels_models.convert import llama
from megakernels_models.convert.common import ConversionError
from megakernels_models.models.config import ModelConfig

MODEL_TYPE = "qwen2"
IGNORED = llama.IGNORED
rules, normalize, tied = llama.rules, llama.normalize, llama.tied


def check_window(hf: dict) -> None:
    window = hf.get("sliding_window")
    if hf.get("use_sliding_window") and window is not None and window < hf["max_position_embeddings"]:
        raise ConversionError(f"use_sliding_window with sliding_window {window}: megakernels' attention is full")


def config_to_ours(hf: dict, rope_interleaved: bool = False) -> ModelConfig:
    """The megakernels Qwen of a HuggingFace Qwen 2 config."""
    check_window(hf)
    base = llama.config_to_ours(
        {**hf, "attention_bias": False, "mlp_bias": False, "sliding_window": None}, rope_interleaved
    )
    return ModelConfig("qwen", **{**base.shared(), "qkv_bias": True, "bias": False})


def config_to_theirs(cfg: ModelConfig) -> dict:
    """The HuggingFace Qwen 2 config of a megakernels Qwen with q/k/v biases."""
    if not cfg.qkv_bias or cfg.bias or cfg.qk_norm:
        raise ConversionError("Qwen 2 has biases on q/k/v only and no q/k norms; this model is not such a Qwen")
    out = llama.config_to_theirs(cfg)
    for key in ("attention_bias", "mlp_bias", "head_dim"):
        out.pop(key)
    return {**out, "architectures": ["Qwen2ForCausalLM"], "model_type": MODEL_TYPE, "use_sliding_window": False}
