"""Optimizers and multi-tensor utilities built on the fused kernels of csrc/optim.

- :class:`FusedAdamW`: torch.optim.AdamW's algorithm, one multi-tensor pass per (device, dtype) group, with
  optional fp32 master weights and fused loss-scale unscaling + inf/NaN skip (no host sync on CUDA).
- :func:`multi_tensor_l2norm`: the 2-norm of many tensors in one fused pass (for gradient clipping), and
  :func:`clip_grad_norm_` on top of it.
- :class:`Muon`: Newton-Schulz-orthogonalised momentum for the hidden matrices and the fused AdamW for the rest,
  in one optimizer (``muon_param_groups`` groups a model by rule).
- :class:`DynamicLossScaler`: the fp16 loss scale (backs off on overflow, grows after a run of clean steps).
- :class:`WarmupCosineSchedule`: linear warmup then cosine decay of the learning rate.
"""

from megakernels.optim.adamw import FusedAdamW
from megakernels.optim.loss_scaler import DynamicLossScaler
from megakernels.optim.lr_schedule import WarmupCosineSchedule
from megakernels.optim.multi_tensor import clip_grad_norm_, multi_tensor_l2norm
from megakernels.optim.muon import Muon, muon_param_groups

__all__ = [
    "FusedAdamW",
    "Muon",
    "muon_param_groups",
    "multi_tensor_l2norm",
    "clip_grad_norm_",
    "DynamicLossScaler",
    "WarmupCosineSchedule",
]
