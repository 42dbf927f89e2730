"""HuggingFace ``DeepseekV2ForCausalLM`` (DeepSeek-V2, V2-Lite) <-> megakernels DeepSeek: exact both ways.

The tensors are DeepSeek-V3's (``deepseek_v3``: latent attention, dense first layers, routed and shared experts)
without the router's correction bias. V2's router: softmax scores, the top-k weights as they are (not
renormalised) times ``routed_scaling_factor``; its sequence-wise balance loss (``aux_loss_alpha``, ``seq_aux``) is
ours (``moe_seq_aux_loss``). transformers' DeepSeek-V2 rotates the rotary dims as complex numbers, i.e. as
interleaved pairs: ours with ``mla_rope_interleave``.

Refused, naming the setting: ``topk_method`` ``group_limited_greedy`` (it scores a group by its best expert,
megakernels' group-limited routing by the sum of its two best), and what DeepSeek-V3's converter refuses; on export,
a model transformers' DeepSeek-V2 cannot express (sigmoid scores, the balancing bias, renormalised or group-limited
routing, rotary dims that are not interleaved, multi-token prediction, ...).
"""

from __future__ import annotations

from megakernels_models.convert import deepseek_v3 as v3
from megakernels_models.convert.common import ConversionError
from megakernels_models.models.config import ModelConfig

MODEL_TYPE = "deepseek_v2"
IGNORED = v3.IGNORED
tied = v3.tied
normalize = v3.normalize
rules = v3.rules  # without the correction bias: the config has no moe_expert_bias


def config_to_ours(hf: dict) -> ModelConfig:
    """The megakernels DeepSeek of a HuggingFace DeepSeek-V2 config.

    Raises:
        ConversionError: a setting megakernels' DeepSeek does not have (naming it).
    """
    method = hf.get("topk_method") or "greedy"
    if method != "greedy":
        raise ConversionError(
            f"topk_method {method!r}: megakernels routes DeepSeek-V2's 'greedy' (its 'group_limited_greedy' scores "
            "a group by its best expert; megakernels' group-limited routing by the sum of its two best)"
        )
    v3_form = {**hf, "topk_method": "noaux_tc", "num_nextn_predict_layers": 0, "rope_interleave": True}
    return v3.config_to_ours(v3_form).replace(
        moe_score="softmax",
        moe_expert_bias=False,
        moe_normalize=False,
        moe_n_group=1,
        moe_topk_group=None,
        moe_aux_loss_coeff=float(hf.get("aux_loss_alpha") or 0.0),
        moe_seq_aux_loss=bool(hf.get("seq_aux", True)),
    )


def config_to_theirs(cfg: ModelConfig) -> dict:
    """The HuggingFace DeepSeek-V2 config of a megakernels DeepSeek with V2's routing.

    Raises:
        ConversionError: a model transformers' DeepSeek-V2 cannot express (naming the setting).
    """
    refused = {
        "moe_score='sigmoid' (DeepSeek-V2 routes by softmax scores)": cfg.moe_score != "softmax",
        "moe_expert_bias (DeepSeek-V2's router has no correction bias)": cfg.moe_expert_bias,
        "moe_normalize (DeepSeek-V2 keeps the top-k weights as they are)": cfg.moe_normalize and cfg.moe_top_k > 1,
        "moe_n_group > 1 (DeepSeek-V2's group-limited routing scores groups otherwise)": cfg.moe_n_group != 1,
        "mla_rope_interleave=False (DeepSeek-V2 rotates interleaved pairs)": not getattr(cfg, "mla_rope_interleave", 1),
        "mtp_layers (DeepSeek-V2 has no multi-token prediction)": cfg.mtp_layers != 0,
    }
    out = v3.hf_fields(cfg, refused, "DeepSeek-V2")
    for key in ("rope_interleave", "num_nextn_predict_layers"):  # V3's alone
        del out[key]
    return out | {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": MODEL_TYPE,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
        "aux_loss_alpha": cfg.moe_aux_loss_coeff,
        "seq_aux": cfg.moe_seq_aux_loss,
    }
