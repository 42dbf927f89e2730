"""Muon's Newton-Schulz iteration (megakernels.ops.muon) against the plain iteration in fp64: the C++ CPU kernel
(fp32; wide, tall and square matrices across its 6-row tiles and padded columns, batches, 0..6 steps, other
coefficients, the same bits at any thread count), the Triton kernels under the interpreter (cuda_emu: fp32/fp16,
its bf16 dots are wrong; shapes crossing the interpreter's 16-wide tiles and the lower triangle's mirror) and on a
GPU (cuda: bf16 too); opcheck of both ops; bad input named."""

from __future__ import annotations

import pytest
import torch

import megakernels
from megakernels.ops.muon import COEFFICIENTS, newton_schulz, newton_schulz_reference
from tests.helpers import assert_close_to_reference

CPU_SHAPES = [(1, 1, 1), (3, 7, 20), (2, 33, 17), (1, 64, 64), (2, 49, 131), (4, 13, 13)]
TRITON_SHAPES = [(2, 20, 36), (1, 36, 20), (3, 17, 17)]


def _input(shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cpu_kernel_matches_fp64(shape):
    x = _input(shape)
    got = newton_schulz(x)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert_close_to_reference(got, newton_schulz_reference(x.double()), torch.float32, "newton_schulz")


@pytest.mark.parametrize("steps", [0, 1, 2, 6])
def test_cpu_kernel_steps_and_coefficients(steps):
    x = _input((2, 19, 40), seed=steps)
    coefficients = (2.0, -1.5, 0.5)
    got = torch.ops.megakernels.newton_schulz_cpu(x, steps, *coefficients, 1e-7)
    want = newton_schulz_reference(x.double(), steps, coefficients)
    assert_close_to_reference(got, want, torch.float32, f"{steps} steps")


def test_cpu_kernel_is_the_same_at_any_thread_count():
    x = _input((3, 100, 70), seed=5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = newton_schulz(x)
        torch.set_num_threads(2)
        two = newton_schulz(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_leading_dims_batch_and_other_dtypes_on_the_cpu():
    x = _input((2, 3, 12, 20), seed=2)
    flat = newton_schulz(x.reshape(6, 12, 20)).reshape(x.shape)
    assert torch.equal(newton_schulz(x), flat)
    want = newton_schulz_reference(x.double())
    assert_close_to_reference(newton_schulz(x, dtype=torch.float64), want, torch.float64, "fp64 (plain iteration)")
    assert_close_to_reference(newton_schulz(x, dtype=torch.bfloat16), want, torch.bfloat16, "bf16", factor=4.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", TRITON_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_triton_kernels_under_the_interpreter(shape, dtype):
    from megakernels.triton import interpreting

    if not interpreting():
        pytest.skip("Triton kernels were compiled for the GPU (TRITON_INTERPRET unset): no interpreter run")
    x = _input(shape, seed=3)
    with megakernels.backend("cuda_emu"):
        got = newton_schulz(x, dtype=dtype)
    want = newton_schulz_reference(x.double())
    plain = newton_schulz_reference(x.to(dtype).float(), dtype=dtype)  # the unfused iteration in this dtype
    err = (got.double() - want).abs().max().item()
    assert got.dtype == dtype and err <= max(2e-5, 2 * (plain.double() - want).abs().max().item()), err


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_kernels_on_the_gpu(dtype):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    x = _input((3, 300, 520), seed=4)
    got = newton_schulz(x.cuda(), dtype=dtype)
    want = newton_schulz_reference(x.double())
    plain = newton_schulz_reference(x.cuda().to(dtype), dtype=dtype).cpu()
    err = (got.double().cpu() - want).abs().max().item()
    assert err <= max(2e-5, 2 * (plain.double() - want).abs().max().item()), err
    assert_close_to_reference(newton_schulz(x.mT.cuda(), dtype=dtype), want.mT, dtype, "tall", factor=4.0)


def test_opcheck_cpu_ops():
    x = _input((2, 9, 14))
    torch.library.opcheck(torch.ops.megakernels.newton_schulz, (x, 3, *COEFFICIENTS, 1e-7, False))
    torch.library.opcheck(torch.ops.megakernels.newton_schulz_cpu, (x, 3, *COEFFICIENTS, 1e-7))


def test_opcheck_triton_path_under_the_interpreter():
    from megakernels.triton import interpreting

    if not interpreting():
        pytest.skip("Triton kernels were compiled for the GPU (TRITON_INTERPRET unset): no interpreter run")
    x = _input((1, 16, 20))
    torch.library.opcheck(torch.ops.megakernels.newton_schulz, (x, 1, *COEFFICIENTS, 1e-7, True))


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(x=torch.zeros(5)), ValueError, "matrix or a batch"),
        (dict(x=torch.zeros(2, 3, dtype=torch.int32)), TypeError, "dtype"),
        (dict(steps=-1), ValueError, "steps"),
        (dict(steps=2.0), TypeError, "steps"),
        (dict(eps=0.0), ValueError, "eps"),
        (dict(coefficients=(1.0, 2.0)), ValueError, "coefficients"),
        (dict(dtype=torch.int8), TypeError, "dtype"),
    ],
)
def test_bad_input_is_named(kwargs, error, match):
    args = dict(x=torch.zeros(2, 3), steps=5, coefficients=COEFFICIENTS, eps=1e-7) | kwargs
    dtype = args.pop("dtype", None)
    with pytest.raises(error, match=match):
        newton_schulz(**args, dtype=dtype)


def test_cpu_kernel_refuses_what_it_does_not_take():
    with pytest.raises(TypeError, match="float32"):
        torch.ops.megakernels.newton_schulz_cpu(torch.zeros(1, 2, 2, dtype=torch.float64), 1, *COEFFICIENTS, 1e-7)
    with pytest.raises(ValueError, match="batch of matrices"):
        torch.ops.megakernels.newton_schulz_cpu(torch.zeros(2, 2), 1, *COEFFICIENTS, 1e-7)
    with pytest.raises(ValueError, match="eps"):
        torch.ops.megakernels.newton_schulz_cpu(torch.zeros(1, 2, 2), 1, *COEFFICIENTS, -1.0)
