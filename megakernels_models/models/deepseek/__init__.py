"""The DeepSeek-V3 family (DeepSeek-V3/V3.1, Kimi K2, Moonlight; DeepSeek-V2-Lite's softmax routing too): causal
language models with multi-head latent attention (a low-rank query path, one joint key/value latent with
per-head up-projections, a decoupled rotary part shared by the heads: query/key heads of ``qk_nope + qk_rope``
dims, values of ``v_head``), RMSNorm, SwiGLU, the first ``moe_first_dense`` layers dense and the rest fine-grained
mixtures of experts with shared experts, sigmoid scores routed group-limited with the auxiliary-loss-free
balancing bias, the chosen weights normalised and scaled; multi-token prediction with ``--mtp-layers`` (the
presets have none: DeepSeek-V3's checkpoint adds one module, 14 B parameters beyond its 671 B).

Presets: ``deepseek-tiny`` (the CPU default), ``deepseek-v3`` (671 B parameters, 37 B active per token),
``deepseek-v2-lite`` (15.7 B / 2.4 B), ``moonlight-16b-a3b`` and ``kimi-k2`` (1.04 T / 32 B), at 4096 tokens a
sample (their pre-training length; YaRN carries V3 and K2 further, ``--seq-length``).
"""

from __future__ import annotations

import dataclasses
import math

from megakernels_models.models.config import ModelConfig, sized
from megakernels_models.models.registry import FamilySpec, register
from megakernels_models.models.tasks import CausalLMTask
from megakernels_models.settings import setting

MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclasses.dataclass(frozen=True)
class DeepseekConfig(ModelConfig):
    """A DeepSeek model (``ModelConfig``'s fields, DeepSeek-V3's defaults) and its attention's own fields.

    Attributes:
        q_lora_rank: the query latent's size (None: a direct query projection, as V2-Lite and Moonlight).
        kv_lora_rank: the joint key/value latent's size.
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim: each head's non-rotary and rotary query/key dims and its
            value dim (``head_dim`` is their query/key sum).
        mla_rope_interleave: the rotary dims are interleaved pairs (DeepSeek's checkpoints).
    """

    model: str = "deepseek"
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_rope_interleave: bool = True
    moe_score: str = "sigmoid"
    moe_expert_bias: bool = True
    family = "deepseek"
    DEFAULTS = dict(norm="rmsnorm", position_embedding="rope", activation="swiglu", bias=False, tie_embeddings=False)

    def __post_init__(self):
        object.__setattr__(self, "head_dim", self.qk_nope_head_dim + self.qk_rope_head_dim)
        object.__setattr__(self, "num_kv_heads", self.num_heads)
        super().__post_init__()

    def _check_family(self) -> None:
        for name in MLA_FIELDS:
            v = getattr(self, name)
            if name == "q_lora_rank" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"DeepseekConfig: {name} must be a positive int, got {v!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"DeepseekConfig: qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    def _check_architecture(self) -> None:
        if self.norm != "rmsnorm" or self.position_embedding != "rope" or self.norm_position != "pre":
            raise ValueError("DeepseekConfig: DeepSeek is a pre-norm RMSNorm model with rotary positions")
        if self.sinks or self.sliding_window or self.layer_types is not None:
            raise ValueError("DeepseekConfig: multi-head latent attention has no sinks or sliding windows here")

    @property
    def mla(self) -> dict:
        """``megakernels.parallel.mla.ParallelMultiLatentAttention``'s sizes."""
        return {name: getattr(self, name) for name in MLA_FIELDS} | {"rope_interleave": self.mla_rope_interleave}

    @property
    def softmax_scale(self) -> float:
        """``(qk_nope + qk_rope)^-1/2``, times YaRN's ``mscale(mscale_all_dim)²`` when set (DeepSeek's fold of the
        attention factor into the non-rotary dims too)."""
        scale = self.head_dim**-0.5
        if self.rope_scaling == "yarn" and self.rope_mscale_all_dim and self.rope_scaling_factor > 1:
            m = 0.1 * self.rope_mscale_all_dim * math.log(self.rope_scaling_factor) + 1.0
            scale *= m * m
        return scale

    def main_forward_flops_per_token(self) -> dict[str, float]:
        """As ``ModelConfig``'s with latent attention's projections: ``2·(h·q_rank + q_rank·heads·d_qk)`` (or
        ``2·h·heads·d_qk``) for the query, ``2·h·(kv_rank + d_rope) + 2·kv_rank·heads·(d_nope + d_v)`` for the
        keys and values, ``2·heads·d_v·h`` out; the scores ``2·heads·d_qk`` and the weighted values ``2·heads·d_v``
        per attended key."""
        out = super().main_forward_flops_per_token()
        h, a, l = self.hidden_size, self.num_heads, self.num_layers
        d_qk, d_v = self.head_dim, self.v_head_dim
        gqa = (h * (self.q_size + 2 * self.kv_size) + self.q_size * h) * l
        q = h * a * d_qk if self.q_lora_rank is None else h * self.q_lora_rank + self.q_lora_rank * a * d_qk
        kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * a * (self.qk_nope_head_dim + d_v)
        mla = (q + kv + a * d_v * h) * l
        out["layers_gemm"] += 2.0 * (mla - gqa)
        keys = sum(self.layer_attended_keys(i) for i in range(l))
        out["attention"] = 2.0 * a * (d_qk + d_v) * keys
        return out


@dataclasses.dataclass
class DeepseekSettings:
    """``megakernels train``'s flags for this family (each replaces the preset's field of the same name)."""

    q_lora_rank: int | None = setting(None, "the query latent's size (default: the preset's)", "DeepSeek")
    kv_lora_rank: int | None = setting(None, "the key/value latent's size (default: the preset's)", "DeepSeek")
    qk_nope_head_dim: int | None = setting(
        None, "each head's non-rotary query/key dims (default: the preset's)", "DeepSeek"
    )
    qk_rope_head_dim: int | None = setting(
        None, "each head's rotary query/key dims (default: the preset's)", "DeepSeek"
    )
    v_head_dim: int | None = setting(None, "each head's value dims (default: the preset's)", "DeepSeek")


def _deepseek(layers, hidden, heads, vocab, ffn, *, q_lora, experts, top_k, moe_ffn, shared, dense, groups,
              topk_groups, scaling, yarn=None, softmax=False, seq=4096, **kw) -> DeepseekConfig:  # fmt: skip
    rope = {}
    if yarn is not None:
        rope = dict(
            rope_scaling="yarn", rope_scaling_factor=yarn, rope_original_max_positions=4096, rope_beta_fast=32.0,
            rope_beta_slow=1.0, rope_mscale=1.0, rope_mscale_all_dim=1.0,
        )  # fmt: skip
    return sized(
        DeepseekConfig, layers, hidden, heads, heads, seq, vocab, ffn, q_lora_rank=q_lora, num_experts=experts,
        moe_top_k=top_k, moe_ffn_hidden_size=moe_ffn, moe_shared_experts=shared, moe_first_dense=dense,
        moe_n_group=groups, moe_topk_group=topk_groups, moe_routed_scaling=scaling,
        moe_aux_loss_coeff=1e-3 if softmax else 1e-4, moe_seq_aux_loss=True,
        moe_score="softmax" if softmax else "sigmoid", moe_expert_bias=not softmax, moe_normalize=not softmax,
        layernorm_eps=1e-6, rope_theta=kw.pop("rope_theta", 10000.0), **rope, **kw,
    )  # fmt: skip


PRESETS = {
    # byte-level vocabulary, for the CPU: a query latent, the first layer dense, 8 experts in 4 groups
    "deepseek-tiny": _deepseek(
        4,
        128,
        4,
        261,
        256,
        q_lora=64,
        experts=8,
        top_k=2,
        moe_ffn=64,
        shared=1,
        dense=1,
        groups=4,
        topk_groups=2,
        scaling=2.5,
        seq=256,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    ),  # fmt: skip
    "deepseek-v3": _deepseek(
        61,
        7168,
        128,
        129280,
        18432,
        q_lora=1536,
        experts=256,
        top_k=8,
        moe_ffn=2048,
        shared=1,
        dense=3,
        groups=8,
        topk_groups=4,
        scaling=2.5,
        yarn=40.0,
    ),  # fmt: skip
    "deepseek-v2-lite": _deepseek(
        27,
        2048,
        16,
        102400,
        10944,
        q_lora=None,
        experts=64,
        top_k=6,
        moe_ffn=1408,
        shared=2,
        dense=1,
        groups=1,
        topk_groups=1,
        scaling=1.0,
        softmax=True,
    ),  # fmt: skip
    "moonlight-16b-a3b": _deepseek(
        27,
        2048,
        16,
        163840,
        11264,
        q_lora=None,
        experts=64,
        top_k=6,
        moe_ffn=1408,
        shared=2,
        dense=1,
        groups=1,
        topk_groups=1,
        scaling=2.446,
        rope_theta=50000.0,
    ),  # fmt: skip
    "kimi-k2": _deepseek(
        61,
        7168,
        64,
        163840,
        18432,
        q_lora=1536,
        experts=384,
        top_k=8,
        moe_ffn=2048,
        shared=1,
        dense=1,
        groups=1,
        topk_groups=1,
        scaling=2.827,
        yarn=32.0,
        rope_theta=50000.0,
    ),  # fmt: skip
}


def _model():
    from megakernels_models.models.deepseek.model import DeepseekModel

    return DeepseekModel


def _hf(config):
    """DeepSeek-V2's converter for V2's softmax routing, DeepSeek-V3's otherwise."""
    from megakernels_models.convert import deepseek_v2, deepseek_v3

    return deepseek_v2 if config.moe_score == "softmax" else deepseek_v3


SPEC = register(
    FamilySpec(
        "deepseek", "DeepSeek", DeepseekConfig, _model, CausalLMTask, "tokens", PRESETS, hf=_hf,
        settings=DeepseekSettings,
    )
)  # fmt: skip
