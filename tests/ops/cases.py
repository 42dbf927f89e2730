"""The row-wise ops with [hidden] parameters as test cases: each pairs the fused op with its plain-PyTorch reference
and knows how to
make its inputs, so one specification (tests/ops/rowwise_spec.py) covers layer_norm (with each activation),
rms_norm and bias_gelu."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from megakernels.ops import bias_gelu, layer_norm, rms_norm
from megakernels.ops.bias_gelu import bias_gelu_reference
from megakernels.ops.norms import layer_norm_reference, rms_norm_reference
from tests.helpers import make


@dataclasses.dataclass(frozen=True)
class OpCase:
    name: str
    fused: Callable  # fused(x, *params)
    reference: Callable  # reference(x, *params) in the inputs' dtype (callers pass fp64 copies)
    n_params: int  # weight (+ bias) of shape [hidden]
    # The largest 1/std the norm divides by, from x (fp64): a norm's dx is rstd times a difference of O(|dy·w|)
    # terms, so its rounding error grows with rstd (a row of one element, or of equal values, has rstd
    # 1/sqrt(eps) ~ 300 while its exact dx is 0). None: not a norm.
    rstd: Callable | None = None

    def inputs(self, shape, dtype, device, param_dtype=None, seed=0):
        """x with a non-zero mean (exercises the variance's cancellation) and random params."""
        hidden = shape[-1]
        x = make(shape, dtype, device, scale=2.0, shift=0.5, seed=seed)
        pd = param_dtype or dtype
        params = [
            make((hidden,), pd, device, scale=0.5, shift=1.0 if i == 0 else 0.0, seed=seed + 1 + i)
            for i in range(self.n_params)
        ]
        return [x, *params]

    def __str__(self) -> str:
        return self.name


def _ln(activation):
    return OpCase(
        name=f"layer_norm{'_' + activation if activation else ''}",
        fused=lambda x, w, b: layer_norm(x, w, b, 1e-5, activation),
        reference=lambda x, w, b: layer_norm_reference(x, w, b, 1e-5, activation, compute_dtype=x.dtype),
        n_params=2,
        rstd=lambda x: (x.var(-1, unbiased=False) + 1e-5).rsqrt().amax().item() if x.numel() else 1.0,
    )


LAYER_NORM = _ln(None)
LAYER_NORM_GELU = _ln("gelu")
LAYER_NORM_GELU_TANH = _ln("gelu_tanh")
RMS_NORM = OpCase(
    name="rms_norm",
    fused=lambda x, w: rms_norm(x, w, 1e-6),
    reference=lambda x, w: rms_norm_reference(x, w, 1e-6, compute_dtype=x.dtype),
    n_params=1,
    rstd=lambda x: (x.pow(2).mean(-1) + 1e-6).rsqrt().amax().item() if x.numel() else 1.0,
)
BIAS_GELU = OpCase(
    name="bias_gelu_tanh",
    fused=lambda x, b: bias_gelu(x, b, "tanh"),
    reference=lambda x, b: bias_gelu_reference(x, b, "tanh", compute_dtype=x.dtype),
    n_params=1,
)
BIAS_GELU_ERF = OpCase(
    name="bias_gelu_erf",
    fused=lambda x, b: bias_gelu(x, b, "none"),
    reference=lambda x, b: bias_gelu_reference(x, b, "none", compute_dtype=x.dtype),
    n_params=1,
)

NORM_CASES = [LAYER_NORM, LAYER_NORM_GELU, LAYER_NORM_GELU_TANH, RMS_NORM]
BIAS_GELU_CASES = [BIAS_GELU, BIAS_GELU_ERF]
ALL_CASES = NORM_CASES + BIAS_GELU_CASES
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
