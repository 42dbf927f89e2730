"""HuggingFace ``GptOssForCausalLM`` (model_type ``gpt_oss``) <-> megakernels gpt-oss: exact both ways.

The attention is a Llama's (``llama.rules``: k/v packed, biases on q/k/v/o when ``attention_bias``) plus each
layer's ``self_attn.sinks``. Each MoE layer's router is ``mlp.router`` (weight and bias) and its experts are four
stacked tensors: ``gate_up_proj`` ``[E, h, 2f]`` whose columns interleave gate and up (gate at even columns, up at
odd), ``gate_up_proj_bias`` ``[E, 2f]`` alike, ``down_proj`` ``[E, f, h]`` and ``down_proj_bias`` ``[E, h]``.
megakernels stores expert ``e`` under its global name, ``fc1`` ``[2f, h]`` = [gate; up] (de-interleaved and
transposed), ``fc2`` ``[h, f]`` and the biases ``fc1_bias`` (de-interleaved) and ``fc2_bias``; every step is a
permutation or a transpose, so both directions are bit-exact.

The published checkpoints store the experts' matrices as MXFP4 (``*_blocks``: two 4-bit E2M1 values a byte, low
nibble first, 32 values a block along the input dimension; ``*_scales``: one E8M0 exponent a block, biased by 127):
``normalize`` dequantises them to fp32 (exact: every product of a 4-bit value and a power of two is an fp32
number) and says so in one line on stderr. A ``quantization_config`` of another method is refused.

YaRN rotary scaling maps to ``ModelConfig.rope_scaling="yarn"`` (``llama.rope_scaling_to_ours``). Refused, naming
the setting: another quantisation, YaRN's ``attention_factor`` / ``partial_rotary_factor``, and on export what
transformers' gpt-oss cannot express (no sinks, biases on only some attention projections, q/k norms, a capacity,
per-layer rotary parameters).
"""

from __future__ import annotations

import sys

import torch

from megakernels_models.convert import common, llama
from megakernels_models.convert.common import ConversionError, Rule, copy
from megakernels_models.models.config import ModelConfig

MODEL_TYPE = "gpt_oss"
IGNORED = llama.IGNORED
tied = llama.tied

# E2M1: the sixteen values of a 4-bit code (sign bit 3, two exponent bits, one mantissa bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 matrices of MXFP4-packed expert weights, transposed as transformers' gpt-oss holds them.

    Args:
        blocks: uint8 ``[E, out, G, 16]``: per row of the output dimension, ``G`` blocks of 32 four-bit codes along
            the input dimension, two a byte (the low nibble first).
        scales: uint8 ``[E, out, G]``: each block's exponent, biased by 127.

    Returns:
        fp32 ``[E, G * 32, out]`` (``gate_up_proj`` / ``down_proj``'s ``[E, in, out]``).

    Raises:
        ConversionError: a dtype other than uint8, or shapes that do not pair.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ConversionError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ConversionError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: expected [E, out, G, 16] and "
            "[E, out, G]"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    E, rows, G, _ = blocks.shape
    out = torch.empty(E, G * 32, rows, dtype=torch.float32)
    for e in range(E):  # one expert at a time: the codes' index tensor is 16 bytes a weight
        codes = torch.stack((blocks[e] & 0x0F, blocks[e] >> 4), -1).long()  # [out, G, 16, 2]: low nibble first
        values = torch.ldexp(lut[codes].flatten(-2), scales[e].long().sub(127).unsqueeze(-1).float())
        out[e] = values.flatten(-2).t()
    return out


def normalize(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Names of a ``GptOssForCausalLM`` (``llama.normalize``), MXFP4-packed experts (``X_blocks`` + ``X_scales``)
    dequantised into ``X`` (one note on stderr).

    Raises:
        ConversionError: a ``*_blocks`` tensor without its ``*_scales`` (or the reverse), named.
    """
    out = llama.normalize(tensors)
    packed = sorted(k[: -len("_blocks")] for k in out if k.endswith("_blocks"))
    unpaired = sorted(
        {k for k in out if k.endswith("_scales") and k[: -len("_scales")] not in packed}
        | {k + "_blocks" for k in packed if k + "_scales" not in out}
    )
    if unpaired:
        raise ConversionError(f"the MXFP4 tensor {unpaired[0]!r} has no blocks/scales partner")
    if packed:
        print(
            f"megakernels convert: dequantising {len(packed)} MXFP4-packed expert tensors to fp32",
            file=sys.stderr,
        )
    for name in packed:
        out[name] = dequantize_mxfp4(out.pop(name + "_blocks"), out.pop(name + "_scales"))
    return out


def _experts(m: str, theirs: str, leaf: str, num_experts: int, to_ours, to_theirs) -> Rule:
    """One stacked HuggingFace expert tensor <-> our ``num_experts`` tensors ``m.mlp.experts.<e>.leaf``."""
    ours = tuple(f"{m}mlp.experts.{e}.{leaf}" for e in range(num_experts))
    return Rule(
        ours,
        (theirs,),
        lambda ts: [to_ours(t).contiguous() for t in ts[0].unbind(0)],
        lambda ts: [torch.stack([to_theirs(t) for t in ts])],
    )


def _split(t: torch.Tensor) -> torch.Tensor:
    """Interleaved gate/up along the last dim -> [gate | up]."""
    return torch.cat((t[..., 0::2], t[..., 1::2]), -1)


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """[gate | up] along the last dim -> interleaved gate/up."""
    gate, up = t.chunk(2, -1)
    return torch.stack((gate, up), -1).flatten(-2).contiguous()


def rules(cfg: ModelConfig) -> list[Rule]:
    """gpt-oss's tensor rules: a Llama's attention with sinks, and the router and stacked experts per layer."""
    E = cfg.num_experts

    def moe(i, a, m):
        x = a + "mlp.experts."
        return [
            copy(m + "mlp.router.weight", a + "mlp.router.weight"),
            copy(m + "mlp.router.bias", a + "mlp.router.bias"),
            _experts(m, x + "gate_up_proj", "fc1", E, lambda t: _split(t).t(), lambda t: _interleave(t.t())),
            _experts(m, x + "gate_up_proj_bias", "fc1_bias", E, _split, _interleave),
            _experts(m, x + "down_proj", "fc2", E, lambda t: t.t(), lambda t: t.t().contiguous()),
            _experts(m, x + "down_proj_bias", "fc2_bias", E, lambda t: t, lambda t: t.clone()),
            copy(m + "attention.sinks", a + "self_attn.sinks"),
        ]

    return llama.rules(cfg, mlp=moe)


def config_to_ours(hf: dict, rope_interleaved: bool = False) -> ModelConfig:
    """The megakernels gpt-oss of a HuggingFace gpt-oss config.

    Raises:
        ConversionError: a setting megakernels' gpt-oss does not have (naming it).
    """
    quant = hf.get("quantization_config")
    if quant and quant.get("quant_method") != "mxfp4":
        raise ConversionError(
            f"quantization_config.quant_method {quant.get('quant_method')!r}: megakernels dequantises MXFP4 only"
        )
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
    ]
    window = hf.get("sliding_window")
    if window is None:  # transformers' sliding layers then see every position
        layer_types = ["full_attention"] * layers
    bias = bool(hf.get("attention_bias", True))
    base = llama.config_to_ours(
        {
            **hf,
            "hidden_act": "silu",  # transformers' gpt-oss experts ignore it (their clamped SwiGLU)
            "rope_parameters": None,
            "rope_scaling": None,
            "rope_theta": rope.get("rope_theta") or hf.get("rope_theta") or 150000.0,
            "sliding_window": None,
            "attention_bias": bias,
            "mlp_bias": bias,
            "rms_norm_eps": hf.get("rms_norm_eps", 1e-5),
        },
        rope_interleaved,
    )
    return ModelConfig(
        "gpt_oss",
        **{
            **base.shared(),
            **llama.rope_scaling_to_ours(rope, yarn=True, max_positions=hf.get("max_position_embeddings")),
            "num_experts": int(hf["num_local_experts"]),
            "moe_top_k": int(hf["num_experts_per_tok"]),
            "moe_ffn_hidden_size": None,
            "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.001)),
            "layer_types": tuple(layer_types),
            "sliding_window": window if "sliding_attention" in layer_types else None,
            "sinks": True,
        },
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
    )


def config_to_theirs(cfg: ModelConfig) -> dict:
    """The HuggingFace gpt-oss config of a megakernels gpt-oss.

    Raises:
        ConversionError: a model transformers' gpt-oss cannot express (naming the setting).
    """
    refused = {
        "sinks=False (transformers' gpt-oss always has sinks)": not cfg.sinks,
        "qkv_bias other than bias (attention_bias covers q, k, v and o)": cfg.qkv_bias != cfg.bias,
        "qk_norm": cfg.qk_norm,
        "moe_capacity_factor (transformers' experts are dropless)": cfg.moe_capacity_factor is not None,
        **{f"{name} (softmax routing)": True for name in common.deepseek_routing(cfg)},
        "local_rope_theta / local_rope_scaling (one rotary embedding for every layer)": (
            cfg.local_rope_theta is not None or not cfg.local_rope_scaling
        ),
    }
    bad = [name for name, refuse in refused.items() if refuse]
    if bad:
        raise ConversionError(f"{bad[0]}: not expressible as a HuggingFace gpt_oss model")
    scaling = llama.rope_scaling_to_theirs(cfg) or {"rope_type": "default"}
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.moe_ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.moe_top_k,
        "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
        "output_router_logits": False,
        "swiglu_limit": cfg.swiglu_limit,
        "swiglu_alpha": cfg.swiglu_alpha,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_length,
        "rms_norm_eps": cfg.layernorm_eps,
        "initializer_range": cfg.init_std,
        "rope_parameters": {**scaling, "rope_theta": cfg.rope_theta},
        "layer_types": [cfg.layer_type(i) for i in range(cfg.num_layers)],
        "sliding_window": cfg.sliding_window,
        "attention_bias": cfg.bias,
        "attention_dropout": cfg.attention_dropout,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": "float32",
    }
