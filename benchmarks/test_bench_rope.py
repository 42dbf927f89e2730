"""pytest-benchmark suite of fused RoPE: fused vs eager vs torch.compile of HF Llama's composition, both variants
(cos/sin from positions, or a precomputed table), fwd and fwd+bwd, fp32 and bf16.

    pytest benchmarks/test_bench_rope.py                       # full timing
    pytest benchmarks/test_bench_rope.py --benchmark-disable   # quick check that everything runs (CI)

Never asserts on time (docs/design.md §6).
"""

from __future__ import annotations

import pytest

from megakernels_models.bench.common import DTYPES, IMPLS, implementation
from megakernels_models.bench.rope import COMPOSITIONS, DEFAULT_DTYPES, QUICK_SHAPES, SHAPES, make_inputs, step_fn


def pytest_generate_tests(metafunc):
    if "shape" in metafunc.fixturenames:
        shapes = QUICK_SHAPES if metafunc.config.getoption("benchmark_disable") else SHAPES
        metafunc.parametrize("shape", shapes, ids=lambda s: "x".join(map(str, s)))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("passes", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("dtype", DEFAULT_DTYPES)
@pytest.mark.parametrize("variant", list(COMPOSITIONS))
def test_rope(benchmark, variant, dtype, passes, impl, shape):
    q, k, ctx, grads = make_inputs(shape, DTYPES[dtype], grad=passes != "fwd")
    fn = step_fn(implementation(COMPOSITIONS[variant], impl), q, k, ctx, grads, backward=passes != "fwd")
    benchmark.group = f"rope {variant} {dtype} {'x'.join(map(str, shape))} {passes}"
    benchmark(fn)
