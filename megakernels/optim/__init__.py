"""Optimizers and multi-tensor utilities built on the fused kernels of csrc/optim.

- :class:`FusedAdamW`: torch.optim.AdamW's algorithm, one multi-tensor pass per (device, dtype) group, with
  optional fp32 master weights and fused loss-scale unscaling + inf/NaN skip (no host sync on CUDA).
- :func:`multi_tensor_l2norm`: the 2-norm of many tensors in one fused pass (for gradient clipping), and
  :func:`clip_grad_norm_` on top of it.
"""

from megakernels.optim.adamw import FusedAdamW
from megakernels.optim.multi_tensor import clip_grad_norm_, multi_tensor_l2norm

__all__ = ["FusedAdamW", "multi_tensor_l2norm", "clip_grad_norm_"]
