"""pytest-benchmark suite of the softmax family: fused vs eager vs torch.compile, fwd and fwd+bwd, fp32 and bf16.

    pytest benchmarks/test_bench_softmax.py                       # full timing
    pytest benchmarks/test_bench_softmax.py --benchmark-disable   # quick check that everything runs (CI)

Never asserts on time (docs/benchmarks.md).
"""

from __future__ import annotations

import pytest

from megakernels.bench.common import DTYPES, IMPLS, implementation, parametrize_shapes
from megakernels.bench.softmax import COMPOSITIONS, DEFAULT_DTYPES, QUICK_SHAPES, SHAPES, make_inputs, step_fn


def pytest_generate_tests(metafunc):
    parametrize_shapes(metafunc, QUICK_SHAPES, SHAPES)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("passes", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("dtype", DEFAULT_DTYPES)
@pytest.mark.parametrize("op", list(COMPOSITIONS))
def test_softmax(benchmark, op, dtype, passes, impl, shape):
    comp = COMPOSITIONS[op]
    x, mask, dy = make_inputs(comp, shape, DTYPES[dtype], grad=passes != "fwd")
    fn = step_fn(implementation(comp, impl), x, mask, dy, backward=passes != "fwd")
    benchmark.group = f"softmax {op} {dtype} {'x'.join(map(str, shape))} {passes}"
    benchmark(fn)
