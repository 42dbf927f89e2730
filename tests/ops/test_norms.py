"""Specification of the norm-family ops (layer_norm [+gelu], rms_norm) on every backend: the row-wise op spec
(tests/ops/rowwise_spec.py) plus what is particular to normalisation: optional parameters, what is saved for
backward, rows with a large mean."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_close_to_reference, kernel_grads, make, reference_grads
from tests.ops.cases import LAYER_NORM, LAYER_NORM_GELU, NORM_CASES
from tests.ops.rowwise_spec import RowwiseOpSpec


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", NORM_CASES, ids=str)


class TestNormSpec(RowwiseOpSpec):
    pass


@pytest.mark.parametrize("affine", ["none", "weight_only", "bias_only"])
def test_layer_norm_optional_params(backend, affine):
    from megakernels.ops import layer_norm
    from megakernels.ops.norms import layer_norm_reference

    x, w, b = LAYER_NORM.inputs((4, 50), torch.float32, backend.device)
    w = w if affine == "weight_only" else None
    b = b if affine == "bias_only" else None
    check = lambda x, w=w, b=b: layer_norm(x, w, b, 1e-5, "gelu")  # noqa: E731
    ref = lambda x, w=w, b=b: layer_norm_reference(x, w, b, 1e-5, "gelu", compute_dtype=x.dtype)  # noqa: E731
    dy = make(x.shape, torch.float32, backend.device, seed=5)
    out, (dx,) = kernel_grads(check, [x], dy)
    ref_out, (rdx,) = reference_grads(ref, [x], dy)
    assert_close_to_reference(out, ref_out, torch.float32, "output")
    assert_close_to_reference(dx, rdx, torch.float32, "dx")


def test_rms_norm_without_weight(backend):
    from megakernels.ops import rms_norm
    from megakernels.ops.norms import rms_norm_reference

    x = make((3, 77), torch.float32, backend.device, shift=3.0)
    assert_close_to_reference(rms_norm(x), rms_norm_reference(x), torch.float32, "rms_norm(x)")


def test_layer_norm_saves_only_input_and_row_statistics(backend):
    """Backward state: x, weight, bias and two [rows] fp32 vectors (mean, rstd) -- not the normalised tensor."""
    x, w, b = [t.requires_grad_(True) for t in LAYER_NORM_GELU.inputs((8, 128), torch.bfloat16, backend.device)]
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        LAYER_NORM_GELU.fused(x, w, b)
    shapes = sorted(tuple(t.shape) for t in saved)
    assert shapes == sorted([(8, 128), (128,), (128,), (8,), (8,)]), shapes
    stats = [t for t in saved if t.shape == (8,)]
    assert all(t.dtype == torch.float32 for t in stats)
    big = [t for t in saved if t.shape == (8, 128)]
    assert len(big) == 1 and big[0].data_ptr() == x.data_ptr()


def test_large_mean_rows_are_stable(backend):
    """Rows with |mean| >> std: a sum/sum-of-squares variance would cancel to garbage in fp32."""
    x = make((4, 1024), torch.float32, backend.device, scale=1.0, shift=1e4)
    from megakernels.ops import layer_norm
    from megakernels.ops.norms import layer_norm_reference

    assert_close_to_reference(layer_norm(x), layer_norm_reference(x), torch.float32, "layer_norm", factor=50)
