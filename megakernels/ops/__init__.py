"""Functional fused ops. Each is a torch.library custom op (autograd + fake impl, works under torch.compile),
dispatched by device and backend (docs/design.md §2): CUDA tensor -> CUDA kernel, CPU tensor -> C++ CPU kernel, or the
emulated CUDA kernel under ``megakernels.backend("cuda_emu")``."""

from megakernels.ops.attention import flash_attention, flash_attention_varlen
from megakernels.ops.bias_gelu import bias_gelu
from megakernels.ops.cross_entropy import cross_entropy
from megakernels.ops.fp8 import fp8_gemm, fp8_grouped_gemm, fp8_linear, fp8_quantize
from megakernels.ops.linear_cross_entropy import linear_cross_entropy
from megakernels.ops.logprobs import linear_logprobs
from megakernels.ops.moe_permute import moe_permute, moe_permute_reference, moe_unpermute
from megakernels.ops.moe_router import moe_router, moe_router_reference
from megakernels.ops.muon import newton_schulz
from megakernels.ops.norms import layer_norm, rms_norm
from megakernels.ops.post_training import (
    cpo_loss,
    distill_loss,
    dpo_loss,
    group_advantages,
    grpo_loss,
    kto_loss,
    orpo_loss,
    sequence_logprobs,
    simpo_loss,
)
from megakernels.ops.rope import RopeScaling, fused_rope, rope_cos_sin_table, rope_inv_freq, rope_reference
from megakernels.ops.softmax import scaled_causal_softmax, scaled_masked_softmax, scaled_softmax
from megakernels.ops.swiglu import geglu, geglu_reference, swiglu, swiglu_reference

__all__ = [
    "layer_norm",
    "rms_norm",
    "bias_gelu",
    "scaled_softmax",
    "scaled_masked_softmax",
    "scaled_causal_softmax",
    "flash_attention",
    "flash_attention_varlen",
    "cross_entropy",
    "linear_cross_entropy",
    "linear_logprobs",
    "moe_router",
    "moe_permute",
    "moe_unpermute",
    "moe_permute_reference",
    "moe_router_reference",
    "sequence_logprobs",
    "dpo_loss",
    "orpo_loss",
    "simpo_loss",
    "cpo_loss",
    "kto_loss",
    "grpo_loss",
    "group_advantages",
    "distill_loss",
    "fp8_quantize",
    "fp8_gemm",
    "fp8_grouped_gemm",
    "fp8_linear",
    "fused_rope",
    "rope_reference",
    "rope_cos_sin_table",
    "rope_inv_freq",
    "RopeScaling",
    "swiglu",
    "swiglu_reference",
    "geglu",
    "geglu_reference",
    "newton_schulz",
]
