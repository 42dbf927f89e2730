"""HuggingFace ``LlamaForCausalLM`` <-> megakernels Llama: the same architecture, so both directions are exact.

Layouts: HuggingFace keeps separate ``k_proj``/``v_proj`` and ``gate_proj``/``up_proj``; megakernels packs them
(``attention.kv`` = keys then values, ``mlp.fc1`` = gate then up: the full-model layout of the strided
tensor-parallel shards). HuggingFace's rotary layout rotates the pairs ``(i, i + d/2)`` of each head, as
megakernels' default does, so the query and key rows map as they are. A megakernels model with the interleaved
layout (``rope_interleaved``, pairs ``(2i, 2i+1)``, the layout of Meta's original weights) gets each head's query
and key rows permuted so that both layouts compute the same attention: row ``2i`` is HuggingFace's row ``i`` and
row ``2i+1`` its row ``i + d/2``.

Rotary position scaling: ``llama3`` (Llama 3.1+) and ``linear`` map to ``ModelConfig.rope_scaling``; other kinds
(``dynamic``, ``yarn``, ``longrope``) are refused by name. A megakernels model with ``yarn`` scaling exports with
its YaRN parameters (transformers' Llama applies them as megakernels does).

Refused, naming the setting: an activation other than SiLU, biases on only some projections. A ``head_dim`` other
than ``hidden_size / num_attention_heads`` maps to ``ModelConfig.head_dim``.
"""

from __future__ import annotations

import torch

from megakernels_models.convert.common import ConversionError, Rule, copy
from megakernels_models.models.config import ModelConfig

MODEL_TYPE = "llama"
# Buffers older transformers saved that are no weights: the rotary inverse frequencies (recomputed from the config).
IGNORED = (r"\.rotary_emb\.inv_freq$",)


def _interleave(t: torch.Tensor, heads: int, to_interleaved: bool) -> torch.Tensor:
    """Permute each head's rows between the half-rotated and the interleaved rotary layouts."""
    rest = t.shape[1:]
    h = t.reshape(heads, 2, -1, *rest) if to_interleaved else t.reshape(heads, -1, 2, *rest)
    return h.transpose(1, 2).reshape(-1, *rest).contiguous()


def _rows(cfg: ModelConfig, heads: int):
    """(to_ours, to_theirs) of one q or k tensor: identity, or the interleaving permutation."""
    if not cfg.rope_interleaved:
        return (lambda t: t), (lambda t: t)
    return (lambda t: _interleave(t, heads, True)), (lambda t: _interleave(t, heads, False))


def packed_rule(ours: str, theirs: tuple[str, str], first=None) -> Rule:
    """Our ``[a; b]`` packed rows <-> their two tensors (``first`` maps the first part, e.g. the key rows)."""
    to_ours_first, to_theirs_first = first or ((lambda t: t), (lambda t: t))

    def to_ours(ts):
        return [torch.cat([to_ours_first(ts[0]), ts[1]])]

    def to_theirs(ts):
        a, b = ts[0].chunk(2)
        return [to_theirs_first(a).contiguous(), b.contiguous()]

    return Rule((ours,), theirs, to_ours, to_theirs)


def rules(cfg: ModelConfig, mlp=None) -> list[Rule]:
    """The tensor rules of a Llama; ``mlp(i, a, m)`` gives layer ``i``'s MLP rules instead of the dense SwiGLU's
    (``a``/``m``: the layer's HuggingFace and megakernels name prefixes)."""
    q_to_ours, q_to_theirs = _rows(cfg, cfg.num_heads)
    out = [copy("embedding.word.weight", "model.embed_tokens.weight"), copy("final_norm.weight", "model.norm.weight")]
    if not cfg.tie_embeddings:
        out.append(copy("output_layer.weight", "lm_head.weight"))
    for i in range(cfg.num_layers):
        a, m = f"model.layers.{i}.", f"layers.{i}."
        out += [
            copy(m + "input_norm.weight", a + "input_layernorm.weight"),
            copy(m + "post_attention_norm.weight", a + "post_attention_layernorm.weight"),
            Rule(
                (m + "attention.q.weight",),
                (a + "self_attn.q_proj.weight",),
                lambda ts: [q_to_ours(ts[0])],
                lambda ts: [q_to_theirs(ts[0])],
            ),
            packed_rule(
                m + "attention.kv.weight",
                (a + "self_attn.k_proj.weight", a + "self_attn.v_proj.weight"),
                _rows(cfg, cfg.num_kv_heads),
            ),
            copy(m + "attention.proj.weight", a + "self_attn.o_proj.weight"),
        ]
        out += (
            mlp(i, a, m)
            if mlp is not None
            else [
                packed_rule(m + "mlp.fc1.weight", (a + "mlp.gate_proj.weight", a + "mlp.up_proj.weight")),
                copy(m + "mlp.fc2.weight", a + "mlp.down_proj.weight"),
            ]
        )
        if cfg.qkv_bias:
            out += [
                Rule(
                    (m + "attention.q.bias",),
                    (a + "self_attn.q_proj.bias",),
                    lambda ts: [q_to_ours(ts[0])],
                    lambda ts: [q_to_theirs(ts[0])],
                ),
                packed_rule(
                    m + "attention.kv.bias",
                    (a + "self_attn.k_proj.bias", a + "self_attn.v_proj.bias"),
                    _rows(cfg, cfg.num_kv_heads),
                ),
            ]
        if cfg.qk_norm:
            out += [
                copy(m + "attention.q_norm.weight", a + "self_attn.q_norm.weight"),
                copy(m + "attention.k_norm.weight", a + "self_attn.k_norm.weight"),
            ]
        if cfg.bias:
            out.append(copy(m + "attention.proj.bias", a + "self_attn.o_proj.bias"))
        if cfg.bias and mlp is None:  # the dense MLP's; a family's own MLP rules carry its biases
            out += [
                packed_rule(m + "mlp.fc1.bias", (a + "mlp.gate_proj.bias", a + "mlp.up_proj.bias")),
                copy(m + "mlp.fc2.bias", a + "mlp.down_proj.bias"),
            ]
    return out


def tied(cfg: ModelConfig) -> dict[str, str]:
    """A tied model's head, where a checkpoint stores it anyway: it must be the word embedding."""
    return {"lm_head.weight": "model.embed_tokens.weight"} if cfg.tie_embeddings else {}


def expert_rules(cfg: ModelConfig, m: str, router: str, expert: str, names: tuple[str, str, str]) -> list[Rule]:
    """A MoE layer's rules: the router (their ``router``) and each expert ``e`` (their ``expert.format(e)`` prefix
    with the gate, up and down ``names``) <-> ours (``m`` + ``mlp.router``, ``mlp.experts.<e>.fc1`` = [gate; up],
    ``.fc2`` = down: every expert under its global name, so any expert-parallel size loads it)."""
    gate, up, down = names
    out = [copy(m + "mlp.router.weight", router)]
    for e in range(cfg.num_experts):
        x = expert.format(e)
        out += [
            packed_rule(f"{m}mlp.experts.{e}.fc1", (x + gate, x + up)),
            copy(f"{m}mlp.experts.{e}.fc2", x + down),
        ]
    return out


def normalize(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Names of a ``LlamaForCausalLM`` (a bare ``LlamaModel`` saves them without the ``model.`` prefix)."""
    return {k if k.startswith(("model.", "lm_head.")) else "model." + k: v for k, v in tensors.items()}


def config_to_ours(hf: dict, rope_interleaved: bool = False) -> ModelConfig:
    """The megakernels Llama of a HuggingFace Llama config.

    Raises:
        ConversionError: a setting megakernels' Llama does not have (naming it).
    """
    # transformers < 5 writes rope_theta (+ rope_scaling); 5.x writes rope_parameters {rope_type, rope_theta, ...}
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    theta = float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    if hf.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"hidden_act {hf['hidden_act']!r}: megakernels' Llama MLP is SwiGLU (silu)")
    h, n = hf["hidden_size"], hf["num_attention_heads"]
    attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        raise ConversionError(
            f"attention_bias={attention_bias} with mlp_bias={mlp_bias}: megakernels' Llama has "
            "biases on every projection or on none"
        )
    window = hf.get("sliding_window")  # Mistral's (keys within the last `window` positions); Llama has none
    return ModelConfig(
        "llama",
        **rope_scaling_to_ours(scaling),
        sliding_window=window if window is not None and window < hf["max_position_embeddings"] else None,
        num_layers=hf["num_hidden_layers"],
        hidden_size=h,
        num_heads=n,
        num_kv_heads=hf.get("num_key_value_heads") or n,
        head_dim=hf.get("head_dim") or h // n,
        seq_length=hf["max_position_embeddings"],
        vocab_size=hf["vocab_size"],
        ffn_hidden_size=hf["intermediate_size"],
        dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        layernorm_eps=hf.get("rms_norm_eps", 1e-6),
        init_std=hf.get("initializer_range", 0.02),
        rope_theta=theta,
        rope_interleaved=rope_interleaved,
        bias=attention_bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def rope_scaling_to_ours(scaling: dict | None, yarn: bool = False, max_positions: int | None = None) -> dict:
    """``ModelConfig`` fields of a HuggingFace ``rope_scaling`` / ``rope_parameters`` (``llama3`` and ``linear``;
    with ``yarn``, also YaRN as transformers computes it: a missing ``factor`` is ``max_positions`` over the
    original positions, ``mscale`` and ``mscale_all_dim`` each kept where set and non-zero: the attention factor of
    the rotary tables takes both, DeepSeek's softmax scale ``mscale_all_dim`` alone).

    Raises:
        ConversionError: another kind (``dynamic``, ``longrope``, ``yarn`` without ``yarn``, ...), or a YaRN setting
            megakernels' YaRN has no field for (``attention_factor``, ``partial_rotary_factor``), named.
    """
    if not scaling:
        return {}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return {}
    if kind == "linear":
        return {"rope_scaling": "linear", "rope_scaling_factor": float(scaling["factor"])}
    if kind == "llama3":
        return {
            "rope_scaling": "llama3",
            "rope_scaling_factor": float(scaling["factor"]),
            "rope_low_freq_factor": float(scaling.get("low_freq_factor", 1.0)),
            "rope_high_freq_factor": float(scaling.get("high_freq_factor", 4.0)),
            "rope_original_max_positions": int(scaling["original_max_position_embeddings"]),
        }
    if kind == "yarn" and yarn:
        return _yarn_to_ours(scaling, max_positions)
    raise ConversionError(
        f"rope_scaling of type {kind!r}: megakernels' rotary embeddings scale positions as 'llama3' or 'linear' only"
    )


def _yarn_to_ours(scaling: dict, max_positions: int | None) -> dict:
    for key in ("attention_factor", "partial_rotary_factor"):
        if scaling.get(key) is not None and not (key == "partial_rotary_factor" and scaling[key] == 1.0):
            raise ConversionError(f"rope_parameters.{key}={scaling[key]}: megakernels' YaRN has no such setting")
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    if factor is None:
        if max_positions is None:
            raise ConversionError("rope_parameters of type 'yarn' without factor nor max_position_embeddings")
        factor = max_positions / original
    out = {
        "rope_scaling": "yarn",
        "rope_scaling_factor": float(factor),
        "rope_original_max_positions": original,
        "rope_beta_fast": float(scaling.get("beta_fast") or 32.0),
        "rope_beta_slow": float(scaling.get("beta_slow") or 1.0),
        "rope_truncate": bool(scaling.get("truncate", True)),
    }
    # each kept on its own where set and non-zero (transformers' test): the rotary tables' attention factor takes
    # both, DeepSeek's softmax-scale fold takes mscale_all_dim alone (transformers' ``yarn_apply_mscale``)
    for key in ("mscale", "mscale_all_dim"):
        if scaling.get(key):
            out[f"rope_{key}"] = float(scaling[key])
    return out


def rope_scaling_to_theirs(cfg: ModelConfig) -> dict | None:
    """The HuggingFace ``rope_scaling`` of a megakernels configuration (``linear``, ``llama3`` or ``yarn``), or
    None."""
    if cfg.rope_scaling is None:
        return None
    out = {"rope_type": cfg.rope_scaling, "factor": cfg.rope_scaling_factor}
    if cfg.rope_scaling == "llama3":
        out.update(
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_max_positions,
        )
    if cfg.rope_scaling == "yarn":
        out.update(
            original_max_position_embeddings=cfg.rope_original_max_positions,
            beta_fast=cfg.rope_beta_fast,
            beta_slow=cfg.rope_beta_slow,
            truncate=cfg.rope_truncate,
        )
        for key in ("mscale", "mscale_all_dim"):
            if getattr(cfg, f"rope_{key}") is not None:
                out[key] = getattr(cfg, f"rope_{key}")
    return out


def config_to_theirs(cfg: ModelConfig) -> dict:
    """The HuggingFace Llama config of a megakernels Llama."""
    scaling = rope_scaling_to_theirs(cfg)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_length,
        "rms_norm_eps": cfg.layernorm_eps,
        "initializer_range": cfg.init_std,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": cfg.rope_theta},
        "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias,
        "attention_dropout": cfg.attention_dropout,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": "float32",
    }
