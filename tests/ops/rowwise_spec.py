"""The specification every row-wise op with ``[hidden]`` parameters meets (layer_norm [+gelu], rms_norm,
bias_gelu) on every backend: forward and backward against an fp64 plain-PyTorch reference, fp64 gradcheck, shapes,
dtypes, mixed precision, determinism. A test module subclasses ``RowwiseOpSpec`` as ``Test...`` and parametrizes
``case`` over its ops (``pytest_generate_tests``)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import Backend, assert_close_to_reference, kernel_grads, make, reference_grads
from tests.ops.cases import DTYPES

HIDDEN_SIZES = [1, 3, 127, 1000, 1024, 4097, 12800, 65536]


def rows_for(backend, hidden):
    # The emulator runs every CUDA thread as a host thread: a few rows (still > one warp-group's 4) suffice.
    if backend.emulated:
        return 5 if hidden <= 4097 else 2
    return max(2, min(33, 400_000 // hidden))


def check_forward_backward(case, backend, shape, dtype, param_dtype=None, grad_factor=1.0):
    inputs = case.inputs(shape, dtype, backend.device, param_dtype)
    dy = make(shape, dtype, backend.device, seed=99)
    out, grads = kernel_grads(case.fused, inputs, dy)
    ref_out, ref_grads = reference_grads(case.reference, inputs, dy)
    assert out.dtype == dtype
    assert_close_to_reference(out, ref_out, dtype, f"{case} output")
    names = ["dx", "dweight", "dbias"] if case.n_params == 2 else ["dx", "dparam"]
    for name, g, rg, t in zip(names, grads, ref_grads, inputs):
        assert g.dtype == t.dtype, f"{case} {name}: dtype {g.dtype}, expected {t.dtype}"
        # Parameter grads sum over rows: allow accumulation noise growing with the row count. A norm's dx: noise
        # growing with the 1/std it divides by (``OpCase.rstd``).
        if name == "dx":
            factor = grad_factor * (max(1.0, case.rstd(inputs[0].double())) if case.rstd else 1.0)
        else:
            factor = grad_factor * max(1.0, math.prod(shape[:-1]) ** 0.5)
        assert_close_to_reference(
            g,
            rg,
            dtype if name == "dx" else t.dtype if t.dtype != torch.float32 else dtype,
            f"{case} {name}",
            factor=factor,
        )


class RowwiseOpSpec:
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("hidden", HIDDEN_SIZES)
    def test_forward_and_backward_match_fp64_reference(self, case, backend, dtype, hidden):
        check_forward_backward(case, backend, (rows_for(backend, hidden), hidden), dtype)

    @pytest.mark.parametrize("shape", [(7,), (3, 40), (2, 3, 96), (2, 1, 3, 64)], ids=lambda s: f"rank{len(s)}")
    def test_any_leading_shape(self, case, backend, shape):
        check_forward_backward(case, backend, shape, torch.float32)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
    def test_fp32_params_with_16bit_input(self, case, backend, dtype):
        """apex's MixedFusedLayerNorm: 16-bit activations, fp32 parameters; output in x's dtype, grads in fp32."""
        check_forward_backward(case, backend, (6, 264), dtype, param_dtype=torch.float32)

    @pytest.mark.parametrize("hidden", [5, 64])
    def test_gradcheck_fp64(self, case, backend, hidden):
        # Hidden 5 checks every entry of the Jacobian. Hidden 64 (the vectorised path) checks it along random
        # directions (fast_mode: u·J·v, numerical against analytical), which takes a handful of kernel launches
        # instead of two per input element -- through the emulator that is 0.5 s instead of 50.
        inputs = [t.requires_grad_(True) for t in case.inputs((3, hidden), torch.float64, backend.device)]
        assert torch.autograd.gradcheck(case.fused, inputs, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=hidden > 8)

    def test_empty_batch_gives_empty_result_and_zero_param_grads(self, case, backend):
        inputs = [t.requires_grad_(True) for t in case.inputs((0, 3, 16), torch.float32, backend.device)]
        out = case.fused(*inputs)
        assert out.shape == (0, 3, 16)
        out.sum().backward()
        assert inputs[0].grad.shape == (0, 3, 16)
        for p in inputs[1:]:
            assert torch.equal(p.grad, torch.zeros_like(p))

    def test_non_contiguous_input_is_handled(self, case, backend):
        x, *params = case.inputs((48, 6), torch.float32, backend.device)
        xt = x.t()  # [6, 48], non-contiguous, hidden 48
        params = [make((48,), torch.float32, backend.device, seed=7 + i) for i in range(len(params))]
        assert not xt.is_contiguous()
        assert_close_to_reference(
            case.fused(xt, *params),
            case.reference(xt.double(), *[p.double() for p in params]),
            torch.float32,
            f"{case} on a transposed input",
        )

    def test_deterministic_run_to_run(self, case, backend):
        inputs = case.inputs((37, 300), torch.float32, backend.device)
        dy = make((37, 300), torch.float32, backend.device, seed=3)
        first = kernel_grads(case.fused, inputs, dy)
        second = kernel_grads(case.fused, inputs, dy)
        assert torch.equal(first[0], second[0])
        for a, b in zip(first[1], second[1]):
            assert torch.equal(a, b)

    def test_cpu_result_independent_of_thread_count(self, case):
        inputs = case.inputs((300, 257), torch.float32, "cpu")
        dy = make((300, 257), torch.float32, "cpu", seed=4)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = kernel_grads(case.fused, inputs, dy)
            torch.set_num_threads(max(2, threads))
            many = kernel_grads(case.fused, inputs, dy)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one[0], many[0])
        for a, b in zip(one[1], many[1]):
            assert torch.equal(a, b)

    def test_fp64_input(self, case, backend):
        check_forward_backward(case, backend, (5, 33), torch.float64)

    @pytest.mark.cuda
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
    @pytest.mark.parametrize(
        "shape", [(8192, 1024), (4096, 4096), (2048, 12800), (16, 65536), (4097, 769)], ids=lambda s: f"{s[0]}x{s[1]}"
    )
    def test_gpu_sizes_match_reference(self, case, dtype, shape):
        """Real GPU sizes (GPU only): many rows per block/warp group, and the deterministic reduction at scale."""
        import megakernels

        with megakernels.backend("cuda"):
            check_forward_backward(case, Backend("cuda", "cuda"), shape, dtype)
