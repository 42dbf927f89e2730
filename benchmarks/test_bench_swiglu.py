"""pytest-benchmark suite of fused SwiGLU: fused vs eager vs torch.compile of ``silu(gate) * up``, fwd and fwd+bwd,
fp32 and bf16.

    pytest benchmarks/test_bench_swiglu.py                       # full timing
    pytest benchmarks/test_bench_swiglu.py --benchmark-disable   # quick check that everything runs (CI)

Never asserts on time (docs/design.md §6).
"""

from __future__ import annotations

import pytest

from megakernels_models.bench.common import DTYPES, IMPLS, implementation
from megakernels_models.bench.swiglu import COMPOSITION, DEFAULT_DTYPES, QUICK_SHAPES, SHAPES, make_inputs, step_fn


def pytest_generate_tests(metafunc):
    if "shape" in metafunc.fixturenames:
        shapes = QUICK_SHAPES if metafunc.config.getoption("benchmark_disable") else SHAPES
        metafunc.parametrize("shape", shapes, ids=lambda s: f"{s[0]}x{2 * s[1]}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("passes", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("dtype", DEFAULT_DTYPES)
def test_swiglu(benchmark, dtype, passes, impl, shape):
    x, dy = make_inputs(shape, DTYPES[dtype], grad=passes != "fwd")
    fn = step_fn(implementation(COMPOSITION, impl), x, dy, backward=passes != "fwd")
    benchmark.group = f"swiglu {dtype} {shape[0]}x{2 * shape[1]} {passes}"
    benchmark(fn)
