"""Bad input to the softmax-family ops: a clear exception naming the argument, never a crash or a wrong answer."""

from __future__ import annotations

import pytest
import torch

from megakernels.ops import scaled_causal_softmax, scaled_masked_softmax, scaled_softmax


def x4(*shape):
    return torch.randn(*(shape or (2, 3, 4, 5)))


def mask(*shape, dtype=torch.bool):
    return torch.zeros(*(shape or (2, 1, 4, 5)), dtype=dtype)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        # x
        (lambda: scaled_softmax(torch.ones(2, 4, dtype=torch.int64)), TypeError, "scaled_softmax: x has dtype"),
        (lambda: scaled_softmax(torch.ones(2, 4, dtype=torch.bool)), TypeError, "x has dtype"),
        (lambda: scaled_softmax(torch.tensor(1.0)), ValueError, "at least 1 dimension"),
        (lambda: scaled_softmax([1.0, 2.0]), TypeError, "x must be a torch.Tensor"),
        (lambda: scaled_masked_softmax(torch.ones(2, 3, 4, 5, dtype=torch.int32), mask()), TypeError,
         "scaled_masked_softmax: x has dtype"),
        (lambda: scaled_masked_softmax(x4(3, 4, 5), mask(1, 4, 5)), ValueError, r"x has shape \[3, 4, 5\]; expected 4"),
        (lambda: scaled_masked_softmax(x4(1, 2, 3, 4, 5), mask(4, 5)), ValueError, "expected 4 dims"),
        (lambda: scaled_masked_softmax(None, mask()), TypeError, "x must be a torch.Tensor"),
        (lambda: scaled_causal_softmax(torch.randn(5)), ValueError, "scaled_causal_softmax: x has shape"),
        (lambda: scaled_causal_softmax(torch.ones(3, 3, dtype=torch.int8)), TypeError, "x has dtype"),
        (lambda: scaled_causal_softmax("x"), TypeError, "x must be a torch.Tensor"),
        # mask
        (lambda: scaled_masked_softmax(x4(), mask(dtype=torch.uint8)), TypeError, "mask has dtype"),
        (lambda: scaled_masked_softmax(x4(), mask(dtype=torch.float32)), TypeError, "mask has dtype"),
        (lambda: scaled_masked_softmax(x4(), mask(2, 1, 4, 6)), ValueError, r"mask has shape \[2, 1, 4, 6\]"),
        (lambda: scaled_masked_softmax(x4(), mask(2, 1, 4, 1)), ValueError, "mask has shape"),
        (lambda: scaled_masked_softmax(x4(), mask(3, 1, 4, 5)), ValueError, "not broadcastable"),
        (lambda: scaled_masked_softmax(x4(), mask(2, 2, 4, 5)), ValueError, "not broadcastable"),
        (lambda: scaled_masked_softmax(x4(), mask(1, 2, 1, 4, 5)), ValueError, "mask has shape"),
        (lambda: scaled_masked_softmax(x4(), mask(5)), ValueError, "mask has shape"),
        (lambda: scaled_masked_softmax(x4(), [[True]]), TypeError, "mask must be a torch.Tensor"),
        (lambda: scaled_masked_softmax(x4(), None), TypeError, "mask must be a torch.Tensor"),
        # scale
        (lambda: scaled_softmax(x4(), "0.5"), TypeError, "scale must be a real number"),
        (lambda: scaled_softmax(x4(), torch.tensor(0.5)), TypeError, "scale must be a real number"),
        (lambda: scaled_masked_softmax(x4(), mask(), None), TypeError, "scale must be a real number"),
        (lambda: scaled_causal_softmax(x4(), True), TypeError, "scale must be a real number"),
        (lambda: scaled_softmax(x4(), float("nan")), ValueError, "scale must be a finite number"),
        (lambda: scaled_causal_softmax(x4(), float("inf")), ValueError, "scale must be a finite number"),
    ],
)
def test_bad_input_raises_naming_the_argument(backend, call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_cuda_backend_refuses_cpu_tensors():
    import megakernels

    with megakernels.backend("cuda"):
        with pytest.raises(ValueError, match="scaled_masked_softmax: backend cuda requested, but x is on cpu"):
            scaled_masked_softmax(x4(), mask())


def test_raw_op_refuses_mask_together_with_causal():
    with pytest.raises(ValueError, match="either a mask or causal=True"):
        torch.ops.megakernels.softmax_fwd(x4(), mask(), 1.0, True, False)


def test_backward_with_wrong_grad_shape_is_an_error():
    y = scaled_softmax(x4())
    with pytest.raises(ValueError, match="grad_output has shape"):
        torch.ops.megakernels.softmax_bwd(x4(2, 3, 4, 6), y, 1.0, False, False)
    with pytest.raises(TypeError, match="grad_output has dtype"):
        torch.ops.megakernels.softmax_bwd(y.double(), y, 1.0, False, False)


@pytest.mark.cuda
def test_device_mismatch_is_an_error():
    with pytest.raises(ValueError, match="mask is on cpu but x is on cuda"):
        scaled_masked_softmax(x4().cuda(), mask())
