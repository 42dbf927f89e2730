"""Drop-in modules built on megakernels.ops."""

from megakernels.nn.attention import (
    ATTENTION_CORES,
    DocumentMask,
    FlashSelfAttention,
    TorchSelfAttention,
    attention_core,
)
from megakernels.nn.bias_gelu import FusedBiasGeLU
from megakernels.nn.kv_cache import KVCache
from megakernels.nn.norms import FusedLayerNorm, FusedRMSNorm
from megakernels.nn.rope import RotaryEmbedding
from megakernels.nn.softmax import FusedScaleMaskSoftmax
from megakernels.nn.swiglu import FusedSwiGLU
from megakernels.nn.tied_embedding import TiedEmbedding

__all__ = [
    "FusedLayerNorm",
    "FusedRMSNorm",
    "FusedBiasGeLU",
    "FusedScaleMaskSoftmax",
    "FlashSelfAttention",
    "TorchSelfAttention",
    "DocumentMask",
    "attention_core",
    "ATTENTION_CORES",
    "RotaryEmbedding",
    "FusedSwiGLU",
    "KVCache",
    "TiedEmbedding",
]
