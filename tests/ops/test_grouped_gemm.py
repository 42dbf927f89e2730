"""grouped_gemm against a loop of per-group products in fp64: forward and both gradients, empty groups, one group
taking every row, odd sizes; opcheck; bad input named."""

from __future__ import annotations

import pytest
import torch

from megakernels.ops.grouped_gemm import grouped_gemm, grouped_gemm_reference

CASES = [([3, 0, 5, 1], 7, 5), ([0, 0, 9], 4, 6), ([13], 8, 3), ([1, 1, 1, 1, 1], 5, 7), ([0, 0], 3, 2)]


@pytest.mark.parametrize("sizes,k,n", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_and_backward_match_the_per_group_loop(sizes, k, n, dtype):
    torch.manual_seed(0)
    g = torch.tensor(sizes)
    x = torch.randn(sum(sizes), k, dtype=dtype, requires_grad=True)
    w = torch.randn(len(sizes), n, k, dtype=dtype, requires_grad=True)
    out = grouped_gemm(x, w, g)
    xr, wr = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    ref = grouped_gemm_reference(xr, wr, g)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    dy = torch.randn_like(out)
    out.backward(dy)
    ref.backward(dy.double())
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(w.grad.double(), wr.grad, rtol=tol, atol=tol)
    for e, size in enumerate(sizes):
        if size == 0:
            assert torch.all(w.grad[e] == 0)  # an empty group's weight gets no gradient


def test_opcheck():
    x, w = torch.randn(6, 4, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64)
    torch.library.opcheck(torch.ops.megakernels.grouped_gemm, (x, w, torch.tensor([2, 0, 4])))


@pytest.mark.parametrize("args,error,match", [
    (lambda: (torch.randn(4, 3), torch.randn(2, 5, 3), torch.tensor([1, 2])), ValueError, "sum to x's 4 rows"),
    (lambda: (torch.randn(4, 3), torch.randn(2, 5, 2), torch.tensor([2, 2])), ValueError, "weight has k=2"),
    (lambda: (torch.randn(4, 3), torch.randn(2, 5, 3), torch.tensor([2.0, 2.0])), ValueError, "int32 or int64"),
    (lambda: (torch.randn(4, 3), torch.randn(2, 5, 3), torch.tensor([5, -1])), ValueError, ">= 0"),
    (lambda: (torch.randn(4, 3), torch.randn(5, 3), torch.tensor([4])), ValueError, "weight must be 3-D"),
    (lambda: (torch.randn(4, 3), torch.randn(2, 5, 3, dtype=torch.float64), torch.tensor([2, 2])), ValueError,
     "weight has dtype"),
    (lambda: ("x", torch.randn(2, 5, 3), torch.tensor([2, 2])), TypeError, "x must be a torch.Tensor"),
])
def test_bad_input_is_named(args, error, match):
    with pytest.raises(error, match=match):
        grouped_gemm(*args())
