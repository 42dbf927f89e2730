"""HuggingFace ``MixtralForCausalLM`` <-> megakernels Llama with mixture-of-experts layers: exact both ways.

Mixtral is a Llama whose every MLP is ``num_local_experts`` SwiGLU experts behind a top-``num_experts_per_tok``
router with renormalised weights, as megakernels' ``MoELayer`` with ``moe_normalize=True``. Per layer the router is
``block_sparse_moe.gate`` and expert ``e`` is ``block_sparse_moe.experts.<e>`` with ``w1`` (gate), ``w3`` (up) and
``w2`` (down): megakernels packs ``[w1; w3]`` as the expert's ``fc1`` and stores every expert under its global name,
so the checkpoint loads at any expert-parallel size. The attention and the rest follow ``llama``.

A sliding window maps to ``ModelConfig.sliding_window``. Refused, naming the setting: router jitter noise, and what
``llama`` refuses.
"""

from __future__ import annotations

import torch

from megakernels_models.convert import common, llama
from megakernels_models.convert.common import ConversionError
from megakernels_models.models.config import ModelConfig

MODEL_TYPE = "mixtral"
IGNORED = llama.IGNORED
tied = llama.tied


def rules(cfg: ModelConfig):
    def moe(i, a, m):
        b = a + "block_sparse_moe."
        names = ("w1.weight", "w3.weight", "w2.weight")
        return llama.expert_rules(cfg, m, b + "gate.weight", b + "experts.{}.", names)

    return llama.rules(cfg, mlp=moe)


def normalize(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return llama.normalize(tensors)


def config_to_ours(hf: dict, rope_interleaved: bool = False) -> ModelConfig:
    """The megakernels MoE Llama of a HuggingFace Mixtral config.

    Raises:
        ConversionError: a setting megakernels does not have (naming it).
    """
    if hf.get("router_jitter_noise"):
        raise ConversionError(f"router_jitter_noise {hf['router_jitter_noise']}: megakernels' router has no jitter")
    base = llama.config_to_ours({**hf, "attention_bias": False, "mlp_bias": False}, rope_interleaved)
    return base.replace(
        num_experts=hf["num_local_experts"],
        moe_top_k=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["intermediate_size"],
        moe_normalize=True,
        moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.02)),
    )


def config_to_theirs(cfg: ModelConfig) -> dict:
    """The HuggingFace Mixtral config of a megakernels MoE Llama (every layer MoE, renormalised top-k, no shared
    experts, no capacity).

    Raises:
        ConversionError: a MoE model Mixtral cannot express.
    """
    if (
        cfg.moe_layer_freq != 1
        or cfg.moe_shared_experts
        or cfg.moe_capacity_factor is not None
        or not cfg.moe_normalize
        or cfg.bias
        or common.deepseek_routing(cfg)
    ):
        raise ConversionError(
            "Mixtral has a MoE MLP in every layer, renormalised softmax top-k routing, no shared experts, "
            "no capacity and no biases; this model differs"
        )
    out = llama.config_to_theirs(cfg)
    for key in ("attention_bias", "mlp_bias", "head_dim"):
        out.pop(key, None)
    out.update(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        intermediate_size=cfg.moe_ffn_hidden_size,
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.moe_top_k,
        router_aux_loss_coef=cfg.moe_aux_loss_coeff,
        router_jitter_noise=0.0,
        sliding_window=cfg.sliding_window,
        output_router_logits=False,
    )
    return out
