"""Bad input to the norm-family ops: a clear exception naming the argument, never a crash or a wrong answer."""

from __future__ import annotations

import pytest
import torch

from megakernels.ops import layer_norm, rms_norm


def x32(*shape, device="cpu"):
    return torch.randn(*shape, device=device)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda d: layer_norm(torch.ones(2, 4, dtype=torch.int64, device=d)), TypeError, "layer_norm: x has dtype"),
        (lambda d: layer_norm(torch.ones(2, 4, dtype=torch.bool, device=d)), TypeError, "x has dtype"),
        (
            lambda d: layer_norm(x32(2, 4, device=d), torch.ones(3, device=d)),
            ValueError,
            r"weight has shape \[3\], expected \[4\]",
        ),
        (lambda d: layer_norm(x32(2, 4, device=d), torch.ones(2, 2, device=d)), ValueError, "weight has shape"),
        (
            lambda d: layer_norm(x32(2, 4, device=d), torch.ones(4, device=d), torch.ones(5, device=d)),
            ValueError,
            "bias has shape",
        ),
        (
            lambda d: layer_norm(x32(2, 4, device=d), torch.ones(4, dtype=torch.float64, device=d)),
            TypeError,
            "weight has dtype",
        ),
        (
            lambda d: layer_norm(x32(2, 4, device=d), torch.ones(4, dtype=torch.bfloat16, device=d)),
            TypeError,
            "weight has dtype",
        ),
        (
            lambda d: layer_norm(
                x32(2, 4, device=d).bfloat16(), torch.ones(4, device=d), torch.ones(4, device=d).bfloat16()
            ),
            TypeError,
            "bias has dtype",
        ),
        (lambda d: layer_norm(x32(2, 0, device=d)), ValueError, "empty last dimension"),
        (lambda d: layer_norm(torch.tensor(1.0, device=d)), ValueError, "at least 1 dimension"),
        (lambda d: layer_norm(x32(2, 4, device=d), eps=-1.0), ValueError, "eps must be"),
        (lambda d: layer_norm(x32(2, 4, device=d), eps=float("nan")), ValueError, "eps must be"),
        (lambda d: layer_norm(x32(2, 4, device=d), activation="relu"), ValueError, "activation must be"),
        (lambda d: layer_norm([1.0, 2.0]), TypeError, "x must be a torch.Tensor"),
        (lambda d: layer_norm(x32(2, 4, device=d), "weight"), TypeError, "weight must be a torch.Tensor"),
        (lambda d: rms_norm(x32(2, 4, device=d), torch.ones(5, device=d)), ValueError, r"rms_norm: weight has shape"),
        (lambda d: rms_norm(torch.ones(2, 4, dtype=torch.int32, device=d)), TypeError, "rms_norm: x has dtype"),
    ],
)
def test_bad_input_raises_naming_the_argument(backend, call, exc, match):
    with pytest.raises(exc, match=match):
        call(backend.device)


def test_cuda_emu_refuses_cuda_tensors_and_cuda_refuses_cpu_tensors():
    import megakernels

    with megakernels.backend("cuda"):
        with pytest.raises(ValueError, match="backend cuda requested, but x is on cpu"):
            layer_norm(x32(2, 4))


@pytest.mark.cuda
def test_device_mismatch_is_an_error():
    with pytest.raises(ValueError, match="weight is on cpu but x is on cuda"):
        layer_norm(x32(2, 4).cuda(), torch.ones(4))


def test_backward_with_wrong_grad_shape_is_an_error():
    x = x32(3, 4)
    y, mean, rstd = torch.ops.megakernels.norm_fwd(x, None, None, 1e-5, 0, False, False)
    with pytest.raises(ValueError, match="grad_output has shape"):
        torch.ops.megakernels.norm_bwd(x32(3, 5), x, None, None, mean, rstd, 0, False, False)
