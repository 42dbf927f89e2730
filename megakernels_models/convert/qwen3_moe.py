"""HuggingFace ``Qwen3MoeForCausalLM`` <-> megakernels Qwen with mixture-of-experts layers: exact both ways.

Qwen 3 MoE is Qwen 3 (per-head q/k norms, no biases, a ``head_dim`` of its own) whose MLPs are ``num_experts``
SwiGLU experts behind a top-``num_experts_per_tok`` router: softmax over every expert, the top k kept and, with
``norm_topk_prob``, renormalised (megakernels' ``moe_normalize``). Per layer the router is ``mlp.gate`` and expert
``e`` is ``mlp.experts.<e>`` with ``gate_proj``, ``up_proj`` and ``down_proj``; megakernels packs ``[gate; up]``
as the expert's ``fc1`` and stores every expert under its global name (any expert-parallel size loads it).

Refused, naming the setting: MoE layers other than every layer (``decoder_sparse_step`` > 1 or ``mlp_only_layers``),
and what ``qwen3`` refuses.
"""

from __future__ import annotations

from megakernels_models.convert import common, llama, qwen3
from megakernels_models.convert.common import ConversionError
from megakernels_models.models.config import ModelConfig

MODEL_TYPE = "qwen3_moe"
IGNORED = llama.IGNORED
normalize, tied = llama.normalize, llama.tied


def rules(cfg: ModelConfig):
    def moe(i, a, m):
        names = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
        return llama.expert_rules(cfg, m, a + "mlp.gate.weight", a + "mlp.experts.{}.", names)

    return llama.rules(cfg, mlp=moe)


def config_to_ours(hf: dict, rope_interleaved: bool = False) -> ModelConfig:
    """The megakernels MoE Qwen of a HuggingFace Qwen 3 MoE config."""
    if int(hf.get("decoder_sparse_step", 1)) != 1 or hf.get("mlp_only_layers"):
        raise ConversionError(
            f"decoder_sparse_step {hf.get('decoder_sparse_step')} / mlp_only_layers {hf.get('mlp_only_layers')}: "
            "megakernels converts Qwen 3 MoE models with experts in every layer"
        )
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    return qwen3.config_to_ours(hf, rope_interleaved).replace(
        num_experts=int(experts),
        moe_top_k=int(hf["num_experts_per_tok"]),
        moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
        moe_normalize=bool(hf.get("norm_topk_prob", False)),
        moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)),
    )


def config_to_theirs(cfg: ModelConfig) -> dict:
    """The HuggingFace Qwen 3 MoE config of a megakernels MoE Qwen (experts in every layer, no shared experts, no
    capacity, q/k norms, no biases).

    Raises:
        ConversionError: a MoE model Qwen 3 MoE cannot express.
    """
    if (
        cfg.moe_layer_freq != 1
        or cfg.moe_shared_experts
        or cfg.moe_capacity_factor is not None
        or common.deepseek_routing(cfg)
    ):
        raise ConversionError(
            "Qwen 3 MoE has a MoE MLP in every layer, softmax top-k routing, no shared experts and no capacity; "
            "this model differs"
        )
    out = qwen3.config_to_theirs(cfg)
    out.update(
        architectures=["Qwen3MoeForCausalLM"],
        model_type=MODEL_TYPE,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.moe_top_k,
        moe_intermediate_size=cfg.moe_ffn_hidden_size,
        norm_topk_prob=cfg.moe_normalize,
        router_aux_loss_coef=cfg.moe_aux_loss_coeff,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=False,
    )
    return out
