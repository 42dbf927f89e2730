"""Specification of bias_gelu (``gelu(x + bias)``, Megatron's fused bias-GeLU) on every backend: the row-wise op
spec (tests/ops/rowwise_spec.py) for both GeLU forms, and bad input raising errors that name the argument."""

from __future__ import annotations

import pytest
import torch

from megakernels.ops import bias_gelu
from tests.ops.cases import BIAS_GELU_CASES
from tests.ops.rowwise_spec import RowwiseOpSpec


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", BIAS_GELU_CASES, ids=str)


class TestBiasGeluSpec(RowwiseOpSpec):
    pass


def x32(*shape, device="cpu"):
    return torch.randn(*shape, device=device)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda d: bias_gelu(x32(2, 4, device=d), torch.ones(3, device=d)), ValueError, r"bias_gelu: bias has shape"),
        (
            lambda d: bias_gelu(x32(2, 4, device=d), torch.ones(4, device=d), approximate="sigmoid"),
            ValueError,
            "approximate must be",
        ),
        (
            lambda d: bias_gelu(torch.ones(2, 4, dtype=torch.int16, device=d), torch.ones(4, device=d)),
            TypeError,
            "bias_gelu: x has dtype",
        ),
        (lambda d: bias_gelu(x32(2, 4, device=d), None), TypeError, "bias must be a torch.Tensor"),
    ],
)
def test_bad_input_raises_naming_the_argument(backend, call, exc, match):
    with pytest.raises(exc, match=match):
        call(backend.device)


@pytest.mark.cuda
def test_bias_on_another_device_is_an_error():
    with pytest.raises(ValueError, match="bias is on cpu"):
        bias_gelu(x32(2, 4).cuda(), torch.ones(4))
