"""Drop-in modules built on megakernels.ops."""

from megakernels.nn.bias_gelu import FusedBiasGeLU
from megakernels.nn.norms import FusedLayerNorm, FusedRMSNorm

__all__ = ["FusedLayerNorm", "FusedRMSNorm", "FusedBiasGeLU"]
