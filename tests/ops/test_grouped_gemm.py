"""grouped_gemm against a loop of per-group products in fp64: forward and both gradients, empty groups, one group
taking every row, odd sizes; on the CPU path, on the Triton kernels under the interpreter (cuda_emu: fp32/fp16, its
bf16 dots are wrong) and on a GPU (cuda: bf16 too); opcheck; bad input named."""

from __future__ import annotations

import pytest
import torch

from megakernels.ops.grouped_gemm import grouped_gemm, grouped_gemm_reference
from tests.helpers import assert_close_to_reference, make

CASES = [
    ([3, 0, 5, 1], 7, 5),
    ([0, 0, 9], 4, 6),
    ([13], 8, 3),
    ([1, 1, 1, 1, 1], 5, 7),
    ([0, 0], 3, 2),
    ([0, 40, 0, 17], 33, 20),
    ([37, 0, 0], 16, 48),
]  # the last two cross the interpreter's 16-wide tiles

BACKEND_DTYPES = [
    pytest.param("cpu", torch.float64, id="cpu-float64"),
    pytest.param("cpu", torch.float32, id="cpu-float32"),
    pytest.param("cpu", torch.bfloat16, id="cpu-bfloat16"),
    pytest.param("cuda_emu", torch.float32, id="cuda_emu-float32"),
    pytest.param("cuda_emu", torch.float16, id="cuda_emu-float16"),
    pytest.param("cuda", torch.float32, id="cuda-float32", marks=pytest.mark.cuda),
    pytest.param("cuda", torch.float16, id="cuda-float16", marks=pytest.mark.cuda),
    pytest.param("cuda", torch.bfloat16, id="cuda-bfloat16", marks=pytest.mark.cuda),
]


def _inputs(sizes, k, n, dtype, device, seed=0):
    g = torch.tensor(sizes, device=device)
    x = make((sum(sizes), k), dtype, device, seed=seed)
    w = make((len(sizes), n, k), dtype, device, scale=0.5, seed=seed + 1)
    dy = make((sum(sizes), n), dtype, device, seed=seed + 2)
    return x, w, g, dy


def _check_against_loop(x, w, g, dy, dtype):
    xk, wk = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    out = grouped_gemm(xk, wk, g)
    out.backward(dy)
    xr = x.detach().double().cpu().requires_grad_(True)
    wr = w.detach().double().cpu().requires_grad_(True)
    ref = grouped_gemm_reference(xr, wr, g.cpu())
    ref.backward(dy.double().cpu())
    k = x.shape[1]
    assert_close_to_reference(out, ref, dtype, "out", factor=max(1.0, k**0.5 / 4))
    assert_close_to_reference(xk.grad, xr.grad, dtype, "dx", factor=max(1.0, w.shape[1] ** 0.5 / 4))
    assert_close_to_reference(wk.grad, wr.grad, dtype, "dweight", factor=max(1.0, x.shape[0] ** 0.5 / 4))
    return wk.grad


@pytest.mark.parametrize("sizes,k,n", CASES)
@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPES, indirect=["backend"])
def test_forward_and_backward_match_the_per_group_loop(sizes, k, n, backend, dtype, triton_backend):
    x, w, g, dy = _inputs(sizes, k, n, dtype, backend.device)
    dw = _check_against_loop(x, w, g, dy, dtype)
    for e, size in enumerate(sizes):
        if size == 0:
            assert torch.all(dw[e] == 0)  # an empty group's weight gets no gradient


@pytest.mark.parametrize("backend,dtype", [p for p in BACKEND_DTYPES if p.values[0] != "cpu"], indirect=["backend"])
def test_int32_group_sizes_on_the_cpu_drive_the_triton_kernels(backend, dtype, triton_backend):
    x, w, _, dy = _inputs([5, 0, 12], 24, 16, dtype, backend.device)
    _check_against_loop(x, w, torch.tensor([5, 0, 12], dtype=torch.int32), dy, dtype)


@pytest.mark.cuda
def test_cuda_grouped_gemm_never_synchronises_with_the_host():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    x, w, g, dy = _inputs([300, 0, 129, 77], 256, 192, torch.bfloat16, "cuda")
    x.requires_grad_(True)
    w.requires_grad_(True)
    grouped_gemm(x, w, g).backward(dy)  # the first call may tune the configs (which synchronises)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grouped_gemm(x, w, g).backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_opcheck_cpu_path():
    x, w = torch.randn(6, 4, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64)
    torch.library.opcheck(torch.ops.megakernels.grouped_gemm, (x, w, torch.tensor([2, 0, 4]), False))


def test_opcheck_triton_path_under_the_interpreter():
    from megakernels.triton import interpreting

    if not interpreting():
        pytest.skip("Triton kernels were compiled for the GPU (TRITON_INTERPRET unset): no interpreter run")
    x, w = torch.randn(6, 16), torch.randn(3, 16, 16)
    torch.library.opcheck(torch.ops.megakernels.grouped_gemm, (x, w, torch.tensor([2, 0, 4]), True))


def test_float64_is_refused_under_cuda_emu():
    import megakernels

    with megakernels.backend("cuda_emu"), pytest.raises(ValueError, match="x has dtype torch.float64"):
        grouped_gemm(
            torch.randn(4, 3, dtype=torch.float64), torch.randn(2, 5, 3, dtype=torch.float64), torch.tensor([2, 2])
        )


@pytest.mark.parametrize(
    "args,error,match",
    [
        (lambda: (torch.randn(4, 3), torch.randn(2, 5, 3), torch.tensor([1, 2])), ValueError, "sum to x's 4 rows"),
        (lambda: (torch.randn(4, 3), torch.randn(2, 5, 2), torch.tensor([2, 2])), ValueError, "weight has k=2"),
        (lambda: (torch.randn(4, 3), torch.randn(2, 5, 3), torch.tensor([2.0, 2.0])), ValueError, "int32 or int64"),
        (lambda: (torch.randn(4, 3), torch.randn(2, 5, 3), torch.tensor([5, -1])), ValueError, ">= 0"),
        (lambda: (torch.randn(4, 3), torch.randn(5, 3), torch.tensor([4])), ValueError, "weight must be 3-D"),
        (
            lambda: (torch.randn(4, 3), torch.randn(2, 5, 3, dtype=torch.float64), torch.tensor([2, 2])),
            ValueError,
            "weight has dtype",
        ),
        (lambda: ("x", torch.randn(2, 5, 3), torch.tensor([2, 2])), TypeError, "x must be a torch.Tensor"),
    ],
)
def test_bad_input_is_named(args, error, match):
    with pytest.raises(error, match=match):
        grouped_gemm(*args())
