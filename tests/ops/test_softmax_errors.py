"""Bad input to the softmax-family ops: a clear exception naming the argument, never a crash or a wrong answer."""

from __future__ import annotations

import pytest
import torch

from megakernels.ops import scaled_causal_softmax, scaled_masked_softmax, scaled_softmax


def x4(*shape, device="cpu"):
    return torch.randn(*(shape or (2, 3, 4, 5)), device=device)


def mask(*shape, dtype=torch.bool, device="cpu"):
    return torch.zeros(*(shape or (2, 1, 4, 5)), dtype=dtype, device=device)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        # x
        (
            lambda d: scaled_softmax(torch.ones(2, 4, dtype=torch.int64, device=d)),
            TypeError,
            "scaled_softmax: x has dtype",
        ),
        (lambda d: scaled_softmax(torch.ones(2, 4, dtype=torch.bool, device=d)), TypeError, "x has dtype"),
        (lambda d: scaled_softmax(torch.tensor(1.0, device=d)), ValueError, "at least 1 dimension"),
        (lambda d: scaled_softmax([1.0, 2.0]), TypeError, "x must be a torch.Tensor"),
        (
            lambda d: scaled_masked_softmax(torch.ones(2, 3, 4, 5, dtype=torch.int32, device=d), mask(device=d)),
            TypeError,
            "scaled_masked_softmax: x has dtype",
        ),
        (
            lambda d: scaled_masked_softmax(x4(3, 4, 5, device=d), mask(1, 4, 5, device=d)),
            ValueError,
            r"x has shape \[3, 4, 5\]; expected 4",
        ),
        (
            lambda d: scaled_masked_softmax(x4(1, 2, 3, 4, 5, device=d), mask(4, 5, device=d)),
            ValueError,
            "expected 4 dims",
        ),
        (lambda d: scaled_masked_softmax(None, mask(device=d)), TypeError, "x must be a torch.Tensor"),
        (lambda d: scaled_causal_softmax(torch.randn(5, device=d)), ValueError, "scaled_causal_softmax: x has shape"),
        (lambda d: scaled_causal_softmax(torch.ones(3, 3, dtype=torch.int8, device=d)), TypeError, "x has dtype"),
        (lambda d: scaled_causal_softmax("x"), TypeError, "x must be a torch.Tensor"),
        # mask
        (lambda d: scaled_masked_softmax(x4(device=d), mask(dtype=torch.uint8, device=d)), TypeError, "mask has dtype"),
        (
            lambda d: scaled_masked_softmax(x4(device=d), mask(dtype=torch.float32, device=d)),
            TypeError,
            "mask has dtype",
        ),
        (
            lambda d: scaled_masked_softmax(x4(device=d), mask(2, 1, 4, 6, device=d)),
            ValueError,
            r"mask has shape \[2, 1, 4, 6\]",
        ),
        (lambda d: scaled_masked_softmax(x4(device=d), mask(2, 1, 4, 1, device=d)), ValueError, "mask has shape"),
        (lambda d: scaled_masked_softmax(x4(device=d), mask(3, 1, 4, 5, device=d)), ValueError, "not broadcastable"),
        (lambda d: scaled_masked_softmax(x4(device=d), mask(2, 2, 4, 5, device=d)), ValueError, "not broadcastable"),
        (lambda d: scaled_masked_softmax(x4(device=d), mask(1, 2, 1, 4, 5, device=d)), ValueError, "mask has shape"),
        (lambda d: scaled_masked_softmax(x4(device=d), mask(5, device=d)), ValueError, "mask has shape"),
        (lambda d: scaled_masked_softmax(x4(device=d), [[True]]), TypeError, "mask must be a torch.Tensor"),
        (lambda d: scaled_masked_softmax(x4(device=d), None), TypeError, "mask must be a torch.Tensor"),
        # scale
        (lambda d: scaled_softmax(x4(device=d), "0.5"), TypeError, "scale must be a real number"),
        (lambda d: scaled_softmax(x4(device=d), torch.tensor(0.5, device=d)), TypeError, "scale must be a real number"),
        (lambda d: scaled_masked_softmax(x4(device=d), mask(device=d), None), TypeError, "scale must be a real number"),
        (lambda d: scaled_causal_softmax(x4(device=d), True), TypeError, "scale must be a real number"),
        (lambda d: scaled_softmax(x4(device=d), float("nan")), ValueError, "scale must be a finite number"),
        (lambda d: scaled_causal_softmax(x4(device=d), float("inf")), ValueError, "scale must be a finite number"),
    ],
)
def test_bad_input_raises_naming_the_argument(backend, call, exc, match):
    with pytest.raises(exc, match=match):
        call(backend.device)


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
