"""pytest-benchmark suite of cross_entropy vs F.cross_entropy (eager) (forward + backward).

    pytest benchmarks/test_bench_cross_entropy.py --benchmark-disable   # quick check that everything runs (CI)

Never asserts on time (docs/benchmarks.md).
"""

import pytest
import torch

from megakernels.bench.common import DTYPES
from megakernels.bench.cross_entropy import CPU_SHAPES, DEFAULT_DTYPES, IMPLS, QUICK_SHAPES, make_inputs, step


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("dtype", DEFAULT_DTYPES)
def test_cross_entropy(benchmark, request, impl, dtype):
    n, v = (QUICK_SHAPES if request.config.getoption("benchmark_disable") else CPU_SHAPES)[0]
    x, t = make_inputs(n, v, DTYPES[dtype], "cpu")
    benchmark.group = f"cross_entropy {dtype} {n}x{v}"
    benchmark(step(impl, x, t))
    assert torch.isfinite(IMPLS[impl](x, t))
