"""Multi-tensor ops behind ``megakernels.optim``: one kernel pass over a whole list of tensors (csrc/optim).

A list is cut into chunks of ``chunk_size`` elements (default 65536); on CUDA one launch serves many tensors (a
table of tensors and of (tensor, chunk) pairs travels in the kernel's arguments, apex's multi_tensor_apply), on
the CPU the chunks are the tasks of one ``at::parallel_for``. Every list given to these ops must hold tensors of
one device and one dtype (float32, float16 or bfloat16); :mod:`megakernels.optim` groups a model's parameters.

- ``adamw_``: the AdamW update of every tensor, torch.optim.AdamW's arithmetic (see csrc/optim/optim.h), grads
  optionally divided by ``grad_scale``, the whole call a no-op on the device when ``found_inf != 0``; then every
  ``steps[i] += 1`` (unless skipped). With ``master_params`` (fp32 copies of 16-bit params) the moments are fp32,
  the update runs on the masters and the rounded result is written to the params in the same pass.
- ``multi_tensor_nonfinite_check_``: ``found_inf = 1`` when any ``x / grad_scale`` is inf or NaN (else unchanged).
- ``multi_tensor_l2norm``: the 2-norm of the concatenation, fp32 accumulation, deterministic.

None of them synchronises a CUDA device with the host.
"""

from __future__ import annotations

import torch

import megakernels._lib  # noqa: F401  (registers torch.ops.megakernels.*)
from megakernels._backend import emulate_for
from megakernels.ops import _checks

DEFAULT_CHUNK = 0  # 0: the kernels' default (65536 elements)


@torch.library.register_fake("megakernels::adamw_")
def _adamw_fake(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    master_params,
    steps,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    grad_scale,
    found_inf,
    chunk_size,
    emulate,
):
    if params:
        _checks.same_device(
            "adamw",
            "params[0]",
            params[0],
            ("params", params),
            ("grads", grads),
            ("exp_avgs", exp_avgs),
            ("exp_avg_sqs", exp_avg_sqs),
            ("master_params", master_params),
            ("steps", steps),
            ("grad_scale", grad_scale),
            ("found_inf", found_inf),
        )
    return None


@torch.library.register_fake("megakernels::multi_tensor_nonfinite_check_")
def _nonfinite_fake(tensors, grad_scale, found_inf, chunk_size, emulate):
    if tensors:
        _checks.same_device(
            "multi_tensor_nonfinite_check",
            "tensors[0]",
            tensors[0],
            ("tensors", tensors),
            ("grad_scale", grad_scale),
            ("found_inf", found_inf),
        )
    return None


@torch.library.register_fake("megakernels::multi_tensor_l2norm")
def _l2norm_fake(tensors, chunk_size, emulate):
    _checks.same_device("multi_tensor_l2norm", "tensors[0]", tensors[0], ("tensors", tensors))
    return tensors[0].new_empty((), dtype=torch.float32)


def adamw_(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    master_params,
    steps,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> None:
    """In-place multi-tensor AdamW step on one (device, dtype) list; see the module docstring.

    Args:
        params: contiguous float32/float16/bfloat16 tensors, one device and dtype; updated in place.
        grads: same shapes and dtype (any strides); with ``master_params`` also float32 (every grad: the fp32
            gradient buffers of 16-bit params), the update then reads them at full precision.
        exp_avgs, exp_avg_sqs: moments, params' dtype, or float32 when ``master_params`` is given.
        master_params: ``[]`` or float32 copies of params (mixed precision), updated in place.
        steps: float32 one-element tensors on the params' device: steps taken so far; incremented.
        grad_scale, found_inf: float32 one-element tensors on the params' device, or None.

    Raises:
        TypeError/ValueError naming the argument: mixed dtypes or devices, sparse or complex tensors, shape
        mismatches, non-contiguous params or state, lr/eps/weight_decay < 0, betas outside [0, 1).
    """
    if not params:
        return
    torch.ops.megakernels.adamw_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        master_params,
        steps,
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        grad_scale,
        found_inf,
        int(chunk_size),
        emulate_for("adamw", params[0]),
    )


def nonfinite_check_(
    tensors, found_inf: torch.Tensor, grad_scale: torch.Tensor | None = None, chunk_size: int = DEFAULT_CHUNK
) -> None:
    """Sets ``found_inf`` (float32, one element, on the tensors' device) to 1.0 when any element of ``tensors``
    (one device and dtype), divided by ``grad_scale`` if given, is inf or NaN; leaves it unchanged otherwise."""
    if not tensors:
        return
    torch.ops.megakernels.multi_tensor_nonfinite_check_(
        tensors, grad_scale, found_inf, int(chunk_size), emulate_for("multi_tensor_nonfinite_check", tensors[0])
    )


def l2norm(tensors, chunk_size: int = DEFAULT_CHUNK) -> torch.Tensor:
    """2-norm of the concatenation of ``tensors`` (one device and dtype) as a float32 scalar on their device."""
    return torch.ops.megakernels.multi_tensor_l2norm(
        tensors, int(chunk_size), emulate_for("multi_tensor_l2norm", tensors[0])
    )
