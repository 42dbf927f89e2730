"""HuggingFace ``Gemma3ForCausalLM`` (model_type ``gemma3_text``) <-> megakernels Gemma.

The tensors are a Llama's (``llama.rules``: k/v and gate/up packed) plus the two sandwich norms and the per-head
q/k norms. Gemma's RMSNorm multiplies by ``1 + weight``, and so does ours (``norm_offset``): every tensor is copied
as it is, so both round trips are bit-exact.

Refused, naming the setting: attention-logit soft-capping (``attn_logit_softcapping``: the FlashAttention kernels
have no cap on the scores), bidirectional attention, attention biases, an activation other than tanh-GeLU, rotary
scaling on the local layers, and the multimodal ``gemma3`` wrapper (another model_type: not in ``FAMILIES``).
"""

from __future__ import annotations

from megakernels_models.convert import llama
from megakernels_models.convert.common import ConversionError, Rule, copy
from megakernels_models.models.config import ModelConfig

MODEL_TYPE = "gemma3_text"
IGNORED = llama.IGNORED
normalize, tied = llama.normalize, llama.tied


def rules(cfg: ModelConfig) -> list[Rule]:
    """Gemma's tensor rules: a Llama's, plus the sandwich norms."""
    out = list(llama.rules(cfg))
    for i in range(cfg.num_layers):
        a, m = f"model.layers.{i}.", f"layers.{i}."
        out += [
            copy(m + "attention_output_norm.weight", a + "post_attention_layernorm.weight"),
            copy(m + "mlp_output_norm.weight", a + "post_feedforward_layernorm.weight"),
        ]
    # ours: post_attention_norm is the MLP's input norm (theirs pre_feedforward_layernorm)
    return [
        Rule(
            r.ours,
            tuple(t.replace("post_attention_layernorm", "pre_feedforward_layernorm") for t in r.theirs),
            r.to_ours,
            r.to_theirs,
        )
        if r.ours[0].endswith(".post_attention_norm.weight")
        else r
        for r in out
    ]


def config_to_ours(hf: dict, rope_interleaved: bool = False) -> ModelConfig:
    """The megakernels Gemma of a HuggingFace Gemma 3 text config.

    Raises:
        ConversionError: a setting megakernels' Gemma does not have (naming it).
    """
    if hf.get("attn_logit_softcapping") is not None:
        raise ConversionError(
            f"attn_logit_softcapping={hf['attn_logit_softcapping']}: megakernels' attention has no cap on the scores"
        )
    if hf.get("use_bidirectional_attention"):
        raise ConversionError("use_bidirectional_attention=True: megakernels' Gemma is causal")
    if hf.get("attention_bias"):
        raise ConversionError("attention_bias=True: megakernels' Gemma has no attention biases")
    if hf.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConversionError(f"hidden_activation {hf['hidden_activation']!r}: megakernels' Gemma MLP is GeGLU (tanh)")
    rope = hf.get("rope_parameters") or {}
    full, local = rope.get("full_attention", {}), rope.get("sliding_attention", {})
    if local.get("rope_type", "default") != "default":
        raise ConversionError(f"rope_parameters.sliding_attention of type {local['rope_type']!r}: not converted")
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % hf.get("sliding_window_pattern", 6) else "full_attention"
        for i in range(hf["num_hidden_layers"])
    ]
    scaling = hf.get("rope_scaling") or (full if full.get("rope_type", "default") != "default" else None)
    base = llama.config_to_ours(
        {
            **hf,
            "hidden_act": "silu",
            "rope_parameters": None,
            "rope_scaling": scaling,
            "sliding_window": None,
            "rope_theta": full.get("rope_theta") or hf.get("rope_theta") or 1e6,
        },
        rope_interleaved,
    )
    return ModelConfig(
        "gemma",
        **{
            **base.shared(),
            "activation": "geglu",
            "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
            "layer_types": tuple(layer_types),
            "sliding_window": hf.get("sliding_window") if "sliding_attention" in layer_types else None,
            "local_rope_theta": float(local.get("rope_theta") or hf.get("rope_local_base_freq") or 1e4),
            "local_rope_scaling": False,
            "qk_norm": True,
        },
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
        final_logit_softcapping=hf.get("final_logit_softcapping"),
    )


def config_to_theirs(cfg: ModelConfig) -> dict:
    """The HuggingFace Gemma 3 text config of a megakernels Gemma."""
    out = llama.config_to_theirs(cfg)
    for k in ("hidden_act", "mlp_bias", "rope_theta", "rope_scaling"):
        out.pop(k)
    scaling = llama.rope_scaling_to_theirs(cfg) or {"rope_type": "default"}
    return {
        **out,
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": MODEL_TYPE,
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": list(cfg.layer_types or ["full_attention"] * cfg.num_layers),
        "sliding_window": cfg.sliding_window,
        "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_dim,
        "final_logit_softcapping": cfg.final_logit_softcapping,
        "attn_logit_softcapping": None,
        "rope_parameters": {
            "full_attention": {**scaling, "rope_theta": cfg.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.local_rope_theta or cfg.rope_theta},
        },
    }
