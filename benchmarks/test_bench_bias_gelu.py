"""pytest-benchmark suite of bias_gelu: fused vs eager vs torch.compile, fwd and fwd+bwd, fp32 and bf16.

    pytest benchmarks/test_bench_bias_gelu.py                       # full timing
    pytest benchmarks/test_bench_bias_gelu.py --benchmark-disable   # quick check that everything runs (CI)

Never asserts on time (docs/design.md §6).
"""

from __future__ import annotations

import pytest

from megakernels_models.bench.bias_gelu import COMPOSITIONS, DEFAULT_DTYPES
from megakernels_models.bench.common import IMPLS
from megakernels_models.bench.norms import QUICK_SHAPES, SHAPES, suite_step


def shapes(config):
    return QUICK_SHAPES if config.getoption("benchmark_disable") else SHAPES


def pytest_generate_tests(metafunc):
    if "shape" in metafunc.fixturenames:
        metafunc.parametrize("shape", shapes(metafunc.config), ids=lambda s: f"{s[0]}x{s[1]}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("passes", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("dtype", DEFAULT_DTYPES)
@pytest.mark.parametrize("op", list(COMPOSITIONS))
def test_bias_gelu(benchmark, op, dtype, passes, impl, shape):
    fn = suite_step(COMPOSITIONS[op], impl, dtype, shape, passes != "fwd")
    benchmark.group = f"{op} {dtype} {shape[0]}x{shape[1]} {passes}"
    benchmark(fn)
