"""HuggingFace ``DeepseekV3ForCausalLM`` <-> megakernels DeepSeek: exact both ways.

Per layer: multi-head latent attention (``self_attn.q_a_proj`` + ``q_a_layernorm`` + ``q_b_proj``, or ``q_proj``
without a query latent; ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``: ours are
``attention.q_a`` / ``q_a_norm`` / ``q_b`` or ``q``, ``kv_a``, ``kv_a_norm``, ``kv_b``, ``proj``, the same matrices);
the first ``first_k_dense_replace`` layers a dense SwiGLU MLP, the rest ``mlp.gate`` (the router's weight and its
``e_score_correction_bias``: our ``mlp.router.expert_bias``), the routed experts (transformers' stacked
``gate_up_proj`` ``[E, 2F, h]`` and ``down_proj`` ``[E, h, F]``, or the per-expert tensors of DeepSeek's own
checkpoints; ours: every expert under its global name) and ``shared_experts`` (our ``mlp.shared``). The rotary
dims stay as stored: both read them as interleaved pairs when ``rope_interleave`` is set.

Refused, naming the setting: an activation other than SiLU, attention biases, a ``topk_method`` other than
``noaux_tc``, YaRN settings megakernels' YaRN lacks (``llama.rope_scaling_to_ours``), and a megakernels model
transformers' DeepSeek-V3 cannot express (softmax routing, a capacity, MoE layers other than every layer after the
dense ones, mismatched query/key widths).
"""

from __future__ import annotations

import re

import torch

from megakernels_models.convert import llama
from megakernels_models.convert.common import ConversionError, Rule, copy
from megakernels_models.models.config import ModelConfig

MODEL_TYPE = "deepseek_v3"
IGNORED = llama.IGNORED
tied = llama.tied
_PER_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def normalize(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Names of a ``DeepseekV3ForCausalLM``, and DeepSeek's per-expert tensors stacked as transformers keeps them
    (``experts.gate_up_proj`` = [gate; up] per expert, ``experts.down_proj``)."""
    tensors = llama.normalize(tensors)
    per: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for name, t in tensors.items():
        m = _PER_EXPERT.match(name)
        if m:
            per.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
        else:
            out[name] = t
    for prefix, experts in per.items():
        order = sorted(experts)
        if order != list(range(len(order))) or any(len(experts[e]) != 3 for e in order):
            raise ConversionError(f"{prefix}: the per-expert tensors are incomplete (experts {order})")
        out[prefix + ".gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in order]
        )
        out[prefix + ".down_proj"] = torch.stack([experts[e]["down_proj"] for e in order])
    return out


def _experts(m: str, theirs: str, leaf: str, num_experts: int) -> Rule:
    ours = tuple(f"{m}mlp.experts.{e}.{leaf}" for e in range(num_experts))
    return Rule(ours, (theirs,), lambda ts: [t.contiguous() for t in ts[0].unbind(0)], lambda ts: [torch.stack(ts)])


def _shared(ours: str, theirs: list[str]) -> Rule:
    """One of our tensors that the checkpoint stores several times (the embedding and the head, again in each
    multi-token prediction layer): written to each, read back from the first after checking that the copies agree."""

    def to_ours(ts):
        for name, t in zip(theirs[1:], ts[1:]):
            if not torch.equal(t, ts[0]):
                raise ConversionError(f"{name!r} differs from {theirs[0]!r}; megakernels shares one tensor")
        return [ts[0]]

    return Rule((ours,), tuple(theirs), to_ours, lambda ts: [ts[0]] + [ts[0].clone() for _ in theirs[1:]])


def rules(cfg: ModelConfig) -> list[Rule]:
    """Every layer's rules; with multi-token prediction its modules are the checkpoint's layers after the last
    (DeepSeek's layout: ``model.layers.<L + k>.{enorm, hnorm, eh_proj, shared_head.norm}`` and the decoder layer's
    tensors, with copies of the embedding and the head, ``embed_tokens`` and ``shared_head.head``)."""
    extra = [f"model.layers.{cfg.num_layers + j}." for j in range(cfg.mtp_layers)]
    out = [
        _shared("embedding.word.weight", ["model.embed_tokens.weight"] + [a + "embed_tokens.weight" for a in extra]),
        copy("final_norm.weight", "model.norm.weight"),
    ]
    if not cfg.tie_embeddings:
        out.append(_shared("output_layer.weight", ["lm_head.weight"] + [a + "shared_head.head.weight" for a in extra]))
    for i in range(cfg.num_layers):
        out += _layer(cfg, i, f"layers.{i}.", f"model.layers.{i}.")
    for j, a in enumerate(extra):
        m = f"mtp.{j}."
        out += [copy(m + n + ".weight", a + n + ".weight") for n in ("enorm", "hnorm", "eh_proj")]
        out += [copy(m + "norm.weight", a + "shared_head.norm.weight")]
        out += _layer(cfg, cfg.num_layers + j, m + "layer.", a)
    return out


def mtp_layers_in(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> int:
    """How many of the multi-token prediction layers ``cfg`` names the (normalised) checkpoint holds: those
    transformers saves are without them (it drops them on load), DeepSeek's own with them."""
    n = 0
    while n < cfg.mtp_layers and f"model.layers.{cfg.num_layers + n}.eh_proj.weight" in tensors:
        n += 1
    return n


def _layer(cfg: ModelConfig, i: int, m: str, a: str) -> list[Rule]:
    """Decoder layer ``i``'s rules: ours under ``m``, theirs under ``a``."""
    s = a + "self_attn."
    out = [
        copy(m + "input_norm.weight", a + "input_layernorm.weight"),
        copy(m + "post_attention_norm.weight", a + "post_attention_layernorm.weight"),
        copy(m + "attention.kv_a", s + "kv_a_proj_with_mqa.weight"),
        copy(m + "attention.kv_a_norm.weight", s + "kv_a_layernorm.weight"),
        copy(m + "attention.kv_b.weight", s + "kv_b_proj.weight"),
        copy(m + "attention.proj.weight", s + "o_proj.weight"),
    ]
    if cfg.q_lora_rank is None:
        out.append(copy(m + "attention.q.weight", s + "q_proj.weight"))
    else:
        out += [
            copy(m + "attention.q_a", s + "q_a_proj.weight"),
            copy(m + "attention.q_a_norm.weight", s + "q_a_layernorm.weight"),
            copy(m + "attention.q_b.weight", s + "q_b_proj.weight"),
        ]
    if not cfg.is_moe_layer(i):
        return out + [
            llama.packed_rule(m + "mlp.fc1.weight", (a + "mlp.gate_proj.weight", a + "mlp.up_proj.weight")),
            copy(m + "mlp.fc2.weight", a + "mlp.down_proj.weight"),
        ]
    x = a + "mlp."
    out += [
        copy(m + "mlp.router.weight", x + "gate.weight"),
        _experts(m, x + "experts.gate_up_proj", "fc1", cfg.num_experts),
        _experts(m, x + "experts.down_proj", "fc2", cfg.num_experts),
    ]
    if cfg.moe_expert_bias:  # always in DeepSeek-V3; DeepSeek-V2 (``deepseek_v2``) has none
        out.append(copy(m + "mlp.router.expert_bias", x + "gate.e_score_correction_bias"))
    if cfg.moe_shared_experts:
        out += [
            llama.packed_rule(
                m + "mlp.shared.fc1.weight",
                (x + "shared_experts.gate_proj.weight", x + "shared_experts.up_proj.weight"),
            ),
            copy(m + "mlp.shared.fc2.weight", x + "shared_experts.down_proj.weight"),
        ]
    return out


def config_to_ours(hf: dict, rope_interleaved: bool = False) -> ModelConfig:
    """The megakernels DeepSeek of a HuggingFace DeepSeek-V3 config.

    Raises:
        ConversionError: a setting megakernels' DeepSeek does not have (naming it).
    """
    if hf.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"hidden_act {hf['hidden_act']!r}: megakernels' DeepSeek MLPs are SwiGLU (silu)")
    if hf.get("attention_bias", False):
        raise ConversionError("attention_bias=True: megakernels' DeepSeek attention has no biases")
    if hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ConversionError(f"topk_method {hf['topk_method']!r}: megakernels routes DeepSeek-V3's 'noaux_tc'")
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    theta = float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    n = hf["num_attention_heads"]
    if int(hf.get("num_key_value_heads") or n) != n:
        raise ConversionError("num_key_value_heads != num_attention_heads: latent attention has a key per head")
    experts = int(hf.get("n_routed_experts") or 0)
    return ModelConfig(
        "deepseek",
        **llama.rope_scaling_to_ours(scaling, yarn=True, max_positions=hf["max_position_embeddings"]),
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_heads=n,
        num_kv_heads=n,
        seq_length=hf["max_position_embeddings"],
        vocab_size=hf["vocab_size"],
        ffn_hidden_size=hf["intermediate_size"],
        dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        layernorm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=int(hf["kv_lora_rank"]),
        qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
        qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
        v_head_dim=int(hf["v_head_dim"]),
        mla_rope_interleave=bool(hf.get("rope_interleave", True)),
        num_experts=experts,
        moe_top_k=int(hf.get("num_experts_per_tok") or 1),
        moe_ffn_hidden_size=int(hf.get("moe_intermediate_size") or hf["intermediate_size"]),
        moe_shared_experts=int(hf.get("n_shared_experts") or 0),
        moe_first_dense=int(hf.get("first_k_dense_replace", 0)),
        moe_n_group=int(hf.get("n_group") or 1),
        moe_topk_group=int(hf.get("topk_group") or 1),
        moe_routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
        moe_normalize=bool(hf.get("norm_topk_prob", True)),
        moe_score="sigmoid",
        moe_expert_bias=True,
        moe_aux_loss_coeff=0.0,  # transformers' config names none; the family's form if one is set
        moe_seq_aux_loss=True,
        mtp_layers=int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0),
    )


def config_to_theirs(cfg: ModelConfig) -> dict:
    """The HuggingFace DeepSeek-V3 config of a megakernels DeepSeek.

    Raises:
        ConversionError: a model transformers' DeepSeek-V3 cannot express (naming the setting).
    """
    routing = {
        "moe_score='softmax' (DeepSeek-V3 routes by sigmoid scores)": cfg.moe_score != "sigmoid",
        "moe_expert_bias=False (DeepSeek-V3's router always has its correction bias)": not cfg.moe_expert_bias,
    }
    return hf_fields(cfg, routing, "DeepSeek-V3")


def hf_fields(cfg: ModelConfig, refused: dict, name: str) -> dict:
    """The config fields of ``cfg`` that transformers' DeepSeek-V3 and V2 share (V3's architecture and model
    type; ``deepseek_v2`` replaces what differs), after refusing what neither expresses and ``refused`` (the
    version's own: reason -> whether it applies).

    Raises:
        ConversionError: naming every setting refused, for transformers' ``name``.
    """
    refused = {
        "a model other than DeepSeek (multi-head latent attention)": getattr(cfg, "mla", None) is None,
        **refused,
        "moe_capacity_factor (transformers' experts are dropless)": cfg.moe_capacity_factor is not None,
        "moe_layer_freq > 1 (every layer after the dense ones is a MoE layer)": cfg.moe_layer_freq != 1,
        "num_experts=0 (a DeepSeek model has routed experts)": not cfg.num_experts,
        "bias": cfg.bias,
    }
    bad = [reason for reason, refuse in refused.items() if refuse]
    if bad:
        raise ConversionError(f"transformers' {name} cannot express: {', '.join(bad)}")
    scaling = llama.rope_scaling_to_theirs(cfg)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if scaling is not None:
        rope.update(scaling, rope_theta=cfg.rope_theta)
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "moe_intermediate_size": cfg.moe_ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads,
        "n_shared_experts": cfg.moe_shared_experts,
        "n_routed_experts": cfg.num_experts,
        "routed_scaling_factor": cfg.moe_routed_scaling,
        "kv_lora_rank": cfg.kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "n_group": cfg.moe_n_group,
        "topk_group": cfg.moe_n_group if cfg.moe_topk_group is None else cfg.moe_topk_group,
        "num_experts_per_tok": cfg.moe_top_k,
        "first_k_dense_replace": cfg.moe_first_dense,
        "norm_topk_prob": cfg.moe_normalize,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_length,
        "rms_norm_eps": cfg.layernorm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": rope,
        "rope_interleave": cfg.mla_rope_interleave,
        "num_nextn_predict_layers": cfg.mtp_layers,
        "attention_bias": False,
        "attention_dropout": cfg.attention_dropout,
        "torch_dtype": "float32",
    }
