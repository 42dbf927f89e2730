"""pytest-benchmark suite of bias_gelu: fused vs eager vs torch.compile, fwd and fwd+bwd, fp32 and bf16.

    pytest benchmarks/test_bench_bias_gelu.py                       # full timing
    pytest benchmarks/test_bench_bias_gelu.py --benchmark-disable   # quick check that everything runs (CI)

Never asserts on time (docs/benchmarks.md).
"""

from __future__ import annotations

import pytest

from megakernels.bench.bias_gelu import COMPOSITIONS, DEFAULT_DTYPES
from megakernels.bench.common import IMPLS, parametrize_shapes
from megakernels.bench.norms import QUICK_SHAPES, SHAPES, suite_step


def pytest_generate_tests(metafunc):
    parametrize_shapes(metafunc, QUICK_SHAPES, SHAPES)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("passes", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("dtype", DEFAULT_DTYPES)
@pytest.mark.parametrize("op", list(COMPOSITIONS))
def test_bias_gelu(benchmark, op, dtype, passes, impl, shape):
    fn = suite_step(COMPOSITIONS[op], impl, dtype, shape, passes != "fwd")
    benchmark.group = f"{op} {dtype} {shape[0]}x{shape[1]} {passes}"
    benchmark(fn)
