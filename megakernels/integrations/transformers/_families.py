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
    """One model family: ``base`` is its PreTrainedModel class (class patching hooks its ``post_init``);
    ``rms_norms`` its RMSNorm classes; ``gelu_mlps`` class -> forward taking ``approximate``, used when the
    config's activation (attribute ``activation``) is a GeLU; ``gated_mlps`` its SwiGLU MLP classes and ``experts``
    its 3-D expert banks, used when that activation is SiLU. LayerNorms are ``torch.nn.LayerNorm`` in every
    family. ``packs``: a decoder whose causal mask has no other reason than padding, a cache or packed sequences
    (no prefix or image blocks), so a padding-free packed batch runs FlashAttention over its sequences."""

    model_type: str
    base: str
    activation: str
    rms_norms: tuple[str, ...] = ()
    gelu_mlps: dict = field(default_factory=dict)
    gated_mlps: tuple[str, ...] = ()
    experts: tuple[str, ...] = ()
    packs: bool = True
    fused_head: bool = False  # its *ForCausalLM is ``self.<body>`` then ``self.lm_head`` (no auxiliary loss)
    body: str = "model"  # the attribute of its *ForCausalLM that holds the decoder

    @functools.cached_property
    def modeling(self):
        return importlib.import_module(f"transformers.models.{self.model_type}.modeling_{self.model_type}")

    def classes(self, names) -> tuple[type, ...]:
        return tuple(getattr(self.modeling, n) for n in names)


FAMILIES = {
    f.model_type: f
    for f in (
        Family(
            "gpt2",
            "GPT2PreTrainedModel",
            "activation_function",
            gelu_mlps={"GPT2MLP": fw.gpt2_mlp_forward},
            packs=False,  # learned positions: not checked with packed batches
            fused_head=True,
            body="transformer",
        ),
        Family(
            "bert",
            "BertPreTrainedModel",
            "hidden_act",
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
            rms_norms=("LlamaRMSNorm",),
            gated_mlps=("LlamaMLP",),
            fused_head=True,
        ),
        Family(
            "mistral",
            "MistralPreTrainedModel",
            "hidden_act",
            rms_norms=("MistralRMSNorm",),
            gated_mlps=("MistralMLP",),
            fused_head=True,
        ),
        Family(
            "mixtral",
            "MixtralPreTrainedModel",
            "hidden_act",
            rms_norms=("MixtralRMSNorm",),
            experts=("MixtralExperts",),
        ),
        Family(
            "qwen2",
            "Qwen2PreTrainedModel",
            "hidden_act",
            rms_norms=("Qwen2RMSNorm",),
            gated_mlps=("Qwen2MLP",),
            fused_head=True,
        ),
        Family(
            "qwen3",
            "Qwen3PreTrainedModel",
            "hidden_act",
            rms_norms=("Qwen3RMSNorm",),
            gated_mlps=("Qwen3MLP",),
            fused_head=True,
        ),
        Family(
            "qwen3_moe",
            "Qwen3MoePreTrainedModel",
            "hidden_act",
            rms_norms=("Qwen3MoeRMSNorm",),
            gated_mlps=("Qwen3MoeMLP",),  # the dense layers between sparse ones (decoder_sparse_step > 1)
            experts=("Qwen3MoeExperts",),
        ),
    )
}


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


def _bind(module, forward, **kwargs) -> None:
    """``module.forward`` becomes ``forward(module, ...)`` for this instance only: the class, its other instances,
    the parameters and the state dict are untouched."""
    bound = functools.partial(forward, module, **kwargs)
    bound.megakernels = True
    module.forward = bound


def patch_modules(model, family: Family, *, norms: bool, mlp: bool, linears: bool = False) -> dict[str, int]:
    """Bind the fused forwards to every matching module of ``model``; returns how many of each kind (``linears``:
    every ``nn.Linear`` and transformers ``Conv1D`` of the exact class, through ``megakernels.ops.gemm``)."""
    import torch

    act = getattr(model.config, family.activation, None)
    gelu = fw.gelu_kind(act)
    silu = isinstance(act, str) and act in _SILU
    rms = family.classes(family.rms_norms)
    gelu_mlps = list(zip(family.classes(family.gelu_mlps), family.gelu_mlps.values()))
    gated = family.classes(family.gated_mlps)
    experts = family.classes(family.experts)
    counts = {"norms": 0, "mlp": 0, "experts": 0, "linears": 0}
    for m in model.modules():
        if linears and type(m) is torch.nn.Linear:
            _bind(m, fw.linear_forward)
            counts["linears"] += 1
        elif linears and type(m).__name__ == "Conv1D" and type(m).__module__.startswith("transformers."):
            _bind(m, fw.conv1d_forward)
            counts["linears"] += 1
        elif norms and isinstance(m, torch.nn.LayerNorm):
            _bind(m, fw.layer_norm_forward)
            counts["norms"] += 1
        elif norms and rms and isinstance(m, rms):
            _bind(m, fw.rms_norm_forward)
            counts["norms"] += 1
        elif mlp and silu and gated and isinstance(m, gated):
            _bind(m, fw.gated_mlp_forward)
            counts["mlp"] += 1
        elif mlp and silu and experts and isinstance(m, experts):
            _bind(m, fw.experts_forward)
            counts["experts"] += 1
        elif mlp and gelu is not None:
            for cls, forward in gelu_mlps:
                if isinstance(m, cls):
                    _bind(m, forward, approximate=gelu)
                    counts["mlp"] += 1
                    break
    return counts
