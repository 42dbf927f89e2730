"""The model families the integration knows: which of a family's modules get which replacement forward.

A family is named by its ``config.model_type``. Its classes are looked up in its transformers modeling module when
first needed, so nothing here imports transformers at import time.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field

from megakernels.integrations.transformers import _forwards as fw

_SILU = ("silu", "swish")  # transformers' ACT2FN: both are torch's SiLU


@dataclass(frozen=True)
class Family:
    """One model family: ``base`` is its PreTrainedModel class (class patching hooks its ``__init__``,
    ``post_init``, ``from_pretrained`` and ``_from_config``); ``rms_norms`` its RMSNorm classes (``input_dtype``:
    those whose output is the input's dtype whatever the weight's, gpt-oss's); ``gelu_mlps``
    class -> forward taking ``approximate``, used when the config's activation (attribute ``activation``) is a
    GeLU; ``gated_mlps`` its gated MLP classes (``gate_proj``, ``up_proj``, ``down_proj``), SwiGLU when that
    activation is SiLU and GeGLU when it is the tanh GeLU; ``experts`` its 3-D expert banks, used when that
    activation is SiLU (``clamped_experts``: those of them whose gate is gpt-oss's clamped SwiGLU, ``limit`` and
    ``alpha`` on the module); ``routers`` its top-k router classes -> ``_forwards.router_forward``'s options (bound
    with the MLPs); ``offset_rms_norms`` its RMSNorm classes computing ``x * (1 + weight)`` in fp32
    (Gemma's); ``scaled_embeddings`` its input-embedding classes whose lookup is ``nn.Embedding``'s times the
    ``embed_scale`` buffer in the weight's dtype (Gemma's), which a tied table may serve; ``attentions`` the
    modules that call transformers' attention interface. LayerNorms are ``torch.nn.LayerNorm`` in every family.
    Each is matched by its exact class: a subclass may compute something else. ``packs``: a decoder whose causal
    mask has no other reason than padding, a cache or packed sequences (no prefix or image blocks), so a
    padding-free packed batch runs FlashAttention over its sequences. ``module``:
    the name of its transformers modeling module where it is not the model type (``gemma3`` for ``gemma3_text``).
    ``attention_default``: what transformers resolves an unchosen attention implementation to for its classes
    (``"eager"`` for a family without an SDPA path); other than ``"sdpa"``, the patch switches such a model to
    ``"megakernels"`` (there is no default-named entry to dispatch)."""

    model_type: str
    base: str
    activation: str
    rms_norms: tuple[str, ...] = ()
    input_dtype: bool = False
    offset_rms_norms: tuple[str, ...] = ()
    gelu_mlps: dict = field(default_factory=dict)
    gated_mlps: tuple[str, ...] = ()
    experts: tuple[str, ...] = ()
    clamped_experts: tuple[str, ...] = ()
    routers: dict = field(default_factory=dict)
    scaled_embeddings: tuple[str, ...] = ()
    attentions: tuple[str, ...] = ()
    packs: bool = True
    fused_head: bool = False  # its *ForCausalLM is ``self.<body>`` then ``self.lm_head`` (no auxiliary loss)
    body: str = "model"  # the attribute of its *ForCausalLM that holds the decoder
    module: str | None = None
    attention_default: str = "sdpa"

    @functools.cached_property
    def modeling(self):
        name = self.module or self.model_type
        return importlib.import_module(f"transformers.models.{name}.modeling_{name}")

    @property
    def modeling_name(self) -> str:
        """The qualified name of its transformers modeling module (no import)."""
        name = self.module or self.model_type
        return f"transformers.models.{name}.modeling_{name}"

    def classes(self, names) -> tuple[type, ...]:
        return tuple(getattr(self.modeling, n) for n in names)


FAMILIES = {
    f.model_type: f
    for f in (
        Family(
            "gpt2",
            "GPT2PreTrainedModel",
            "activation_function",
            attentions=("GPT2Attention",),
            gelu_mlps={"GPT2MLP": fw.gpt2_mlp_forward},
            packs=False,  # learned positions: not checked with packed batches
            fused_head=True,
            body="transformer",
        ),
        Family(
            "bert",
            "BertPreTrainedModel",
            "hidden_act",
            attentions=("BertSelfAttention", "BertCrossAttention"),
            gelu_mlps={
                "BertIntermediate": fw.bert_intermediate_forward,
                "BertPredictionHeadTransform": fw.bert_head_transform_forward,
            },
            packs=False,  # an encoder
        ),
        Family(
            "llama",
            "LlamaPreTrainedModel",
            "hidden_act",
            attentions=("LlamaAttention",),
            rms_norms=("LlamaRMSNorm",),
            gated_mlps=("LlamaMLP",),
            fused_head=True,
        ),
        Family(
            "mistral",
            "MistralPreTrainedModel",
            "hidden_act",
            attentions=("MistralAttention",),
            rms_norms=("MistralRMSNorm",),
            gated_mlps=("MistralMLP",),
            fused_head=True,
        ),
        Family(
            "mixtral",
            "MixtralPreTrainedModel",
            "hidden_act",
            attentions=("MixtralAttention",),
            rms_norms=("MixtralRMSNorm",),
            experts=("MixtralExperts",),
            routers={"MixtralTopKRouter": {}},  # fp32 weights
        ),
        Family(
            "qwen2",
            "Qwen2PreTrainedModel",
            "hidden_act",
            attentions=("Qwen2Attention",),
            rms_norms=("Qwen2RMSNorm",),
            gated_mlps=("Qwen2MLP",),
            fused_head=True,
        ),
        Family(
            "qwen3",
            "Qwen3PreTrainedModel",
            "hidden_act",
            attentions=("Qwen3Attention",),
            rms_norms=("Qwen3RMSNorm",),
            gated_mlps=("Qwen3MLP",),
            fused_head=True,
        ),
        Family(
            "qwen3_moe",
            "Qwen3MoePreTrainedModel",
            "hidden_act",
            attentions=("Qwen3MoeAttention",),
            rms_norms=("Qwen3MoeRMSNorm",),
            gated_mlps=("Qwen3MoeMLP",),  # the dense layers between sparse ones (decoder_sparse_step > 1)
            experts=("Qwen3MoeExperts",),
            routers={"Qwen3MoeTopKRouter": {"cast": True}},
        ),
        Family(
            "gemma3_text",
            "Gemma3PreTrainedModel",
            "hidden_activation",
            attentions=("Gemma3Attention",),
            offset_rms_norms=("Gemma3RMSNorm",),  # the q/k norms too
            gated_mlps=("Gemma3MLP",),
            scaled_embeddings=("Gemma3TextScaledWordEmbedding",),
            packs=False,  # its text model serves the multimodal model too, whose masks add bidirectional image blocks
            fused_head=True,  # where the config has no final-logit soft-capping (``_forwards.head_fuses``)
            module="gemma3",
        ),
        Family(
            "gpt_oss",
            "GptOssPreTrainedModel",
            "hidden_act",
            attentions=("GptOssAttention",),
            rms_norms=("GptOssRMSNorm",),
            input_dtype=True,  # its norms stay fp32 in a bf16 model (_keep_in_fp32_modules) and return bf16
            experts=("GptOssExperts",),
            clamped_experts=("GptOssExperts",),
            routers={"GptOssTopKRouter": {"topk_softmax": True, "cast": True}},
            fused_head=True,  # where no router logits are asked for (their auxiliary loss: the class's forward)
            attention_default="eager",  # transformers has no SDPA path for gpt-oss (its sinks)
        ),
        Family(
            "deepseek_v3",
            "DeepseekV3PreTrainedModel",
            "hidden_act",
            attentions=("DeepseekV3Attention",),  # latent attention: query/key head dim apart from the value's
            rms_norms=("DeepseekV3RMSNorm",),  # the query and key/value latents' norms too
            gated_mlps=("DeepseekV3MLP",),  # the dense first layers' MLPs and the shared experts
            experts=("DeepseekV3Experts",),
            routers={"DeepseekV3TopkRouter": {"score": "sigmoid", "fp32": True}},  # group-limited, the bias
            fused_head=True,  # its loss is the causal-LM loss alone (no auxiliary loss)
        ),
        Family(
            "deepseek_v2",
            "DeepseekV2PreTrainedModel",
            "hidden_act",
            attentions=("DeepseekV2Attention",),  # latent attention, as DeepSeek-V3's
            rms_norms=("DeepseekV2RMSNorm",),
            gated_mlps=("DeepseekV2MLP",),
            experts=("DeepseekV2Experts",),
            # softmax scores, the top-k weights scaled, not renormalised (greedy top-k; group-limited: the class's)
            routers={"DeepseekV2TopkRouter": {"fp32": True, "normalize": False}},
            fused_head=True,
        ),
    )
}
fw.PACKING_MODEL_TYPES.update(name for name, f in FAMILIES.items() if f.packs)
fw.CLAMPED_SWIGLU_EXPERTS.update(f"{f.modeling_name}.{name}" for f in FAMILIES.values() for name in f.clamped_experts)


def family_of(model_type, op: str) -> Family:
    """The family of ``model_type``.

    Raises:
        ValueError: a model type the integration does not know (the message names it and the known ones).
    """
    if model_type not in FAMILIES:
        raise ValueError(
            f"{op}: model type {model_type!r} is not supported; supported model types: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]


def bind(module, forward, **kwargs) -> None:
    """``module.forward`` becomes ``forward(module, ...)`` for this instance only: the class, its other instances,
    the parameters and the state dict are untouched. The bound forward shows the class forward's signature (a
    ``functools.partial``, so copies of the module get their own)."""
    bound = functools.partial(forward, module, **kwargs)
    bound.megakernels = True
    bound.__signature__ = fw.bound_signature(type(module))
    module.forward = bound


def _mlp_owns_its_linears(m, names) -> bool:
    return all(fw.owned(getattr(m, n)) for n in names)


# the submodules whose weights each fused MLP reads (the others it calls)
_READS = {
    "GPT2MLP": ("c_fc",),
    "BertIntermediate": ("dense",),
    "BertPredictionHeadTransform": ("dense",),
}
_GATED_READS = ("gate_proj", "up_proj")


def patch_modules(model, family: Family, *, norms: bool, mlp: bool, linears: bool = False) -> dict:
    """Bind the fused forwards to every matching module of ``model``; returns how many of each kind (``linears``:
    every ``nn.Linear`` and transformers ``Conv1D`` of the exact class, through ``megakernels.ops.gemm``), and under
    ``"declined"`` the names of the MLPs whose linears are not ``owned`` now (wrapped by PEFT, quantised, hooked):
    their forwards are bound all the same and run transformers' own until the linears are plain again."""
    import torch

    act = getattr(model.config, family.activation, None)
    gelu = fw.gelu_kind(act)
    silu = isinstance(act, str) and act in _SILU
    glu = "silu" if silu else "gelu_tanh" if gelu == "tanh" else None  # the gated MLPs' fused activation
    rms = family.classes(family.rms_norms)
    offset_rms = family.classes(family.offset_rms_norms)
    gelu_mlps = dict(zip(family.classes(family.gelu_mlps), family.gelu_mlps.values()))
    gated = family.classes(family.gated_mlps)
    routers = dict(zip(family.classes(family.routers), family.routers.values()))
    conv1d = fw._conv1d_class()
    counts = {"norms": 0, "mlp": 0, "routers": 0, "linears": 0, "declined": []}
    for name, m in model.named_modules():
        cls = type(m)
        own = m.__dict__.get("forward")
        if own is not None and not getattr(own, "megakernels", False):
            continue  # a forward someone else bound (an accelerate hook, a wrapper): theirs
        if linears and (cls is torch.nn.Linear or cls is conv1d):
            bind(m, fw.linear_forward if cls is torch.nn.Linear else fw.conv1d_forward)
            counts["linears"] += 1
        elif norms and (cls is torch.nn.LayerNorm or cls in rms):
            if cls is torch.nn.LayerNorm:
                bind(m, fw.layer_norm_forward)
            else:
                bind(m, fw.rms_norm_forward, input_dtype=family.input_dtype)
            counts["norms"] += 1
        elif norms and cls in offset_rms:
            bind(m, fw.offset_rms_norm_forward)
            counts["norms"] += 1
        elif mlp and glu is not None and cls in gated:
            bind(m, fw.gated_mlp_forward, activation=glu)
            if _mlp_owns_its_linears(m, _GATED_READS):
                counts["mlp"] += 1
            else:
                counts["declined"].append(name)
        elif mlp and cls in routers:
            bind(m, fw.router_forward, **routers[cls])
            counts["routers"] += 1
        elif mlp and gelu is not None and cls in gelu_mlps:
            bind(m, gelu_mlps[cls], approximate=gelu)
            if _mlp_owns_its_linears(m, _READS[cls.__name__]):
                counts["mlp"] += 1
            else:
                counts["declined"].append(name)
    return counts


def mark(model, family: Family, kind: str) -> int:
    """Mark the modules of ``kind`` (``_dispatch.ATTENTION``: the attention modules; ``EXPERTS``: the expert banks,
    when the activation is SiLU or their gate is gpt-oss's clamped one) so that their calls under transformers'
    default implementation run megakernels' (``_dispatch``); returns how many."""
    from megakernels.integrations.transformers import _dispatch

    if kind == _dispatch.EXPERTS:
        act = getattr(model.config, family.activation, None)
        silu = isinstance(act, str) and act in _SILU
        # gpt-oss's clamped SwiGLU is its experts' own gate, whatever the config's activation says
        classes = family.classes(tuple(n for n in family.experts if silu or n in family.clamped_experts))
    else:
        classes = family.classes(family.attentions)
    n = 0
    for m in model.modules():
        if type(m) in classes:
            setattr(m, _dispatch.MARK[kind], True)
            n += 1
    return n
