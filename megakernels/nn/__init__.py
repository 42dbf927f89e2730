"""Drop-in modules built on megakernels.ops."""

from megakernels.nn.attention import ATTENTION_CORES, FlashSelfAttention, TorchSelfAttention, attention_core
from megakernels.nn.bias_gelu import FusedBiasGeLU
from megakernels.nn.norms import FusedLayerNorm, FusedRMSNorm
from megakernels.nn.softmax import FusedScaleMaskSoftmax

__all__ = ["FusedLayerNorm", "FusedRMSNorm", "FusedBiasGeLU", "FusedScaleMaskSoftmax", "FlashSelfAttention",
           "TorchSelfAttention", "attention_core", "ATTENTION_CORES"]
