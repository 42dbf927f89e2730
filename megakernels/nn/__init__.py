"""Drop-in modules built on megakernels.ops."""

from megakernels.nn.attention import FlashSelfAttention
from megakernels.nn.bias_gelu import FusedBiasGeLU
from megakernels.nn.norms import FusedLayerNorm, FusedRMSNorm
from megakernels.nn.softmax import FusedScaleMaskSoftmax

__all__ = ["FusedLayerNorm", "FusedRMSNorm", "FusedBiasGeLU", "FusedScaleMaskSoftmax", "FlashSelfAttention"]
