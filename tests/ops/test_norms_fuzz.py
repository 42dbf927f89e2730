"""Property test: random shapes, dtypes, parameter dtypes and activations against the fp64 reference
(200 examples per op on the C++ CPU backend, 30 through the CUDA emulator, whose thread-per-CUDA-thread blocks
make each example ~100x dearer; the ctest suite also runs these kernels, at hidden sizes 1 to 4104)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.ops.cases import ALL_CASES
from tests.ops.rowwise_spec import check_forward_backward

DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64])
LEADING = st.lists(st.integers(min_value=0, max_value=5), min_size=0, max_size=3)


def fuzz(case, backend, examples):
    @settings(
        max_examples=examples, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(leading=LEADING, hidden=st.integers(min_value=1, max_value=700), dtype=DTYPES, fp32_params=st.booleans())
    def run(leading, hidden, dtype, fp32_params):
        param_dtype = torch.float32 if fp32_params and dtype in (torch.bfloat16, torch.float16) else dtype
        shape = (*leading, hidden) if leading else (1, hidden)
        check_forward_backward(case, backend, shape, dtype, param_dtype=param_dtype)

    run()


@pytest.mark.parametrize("case", ALL_CASES, ids=str)
def test_fuzz_against_reference(case, backend):
    fuzz(case, backend, 30 if backend.emulated else 200)
