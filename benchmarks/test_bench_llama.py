"""pytest-benchmark suite of the Llama-style ops (``megakernels bench --ops llama``): fused RoPE (both variants: cos/sin
from positions, or a precomputed table) and fused SwiGLU, each against eager and torch.compile of the same
composition, fwd and fwd+bwd, fp32 and bf16.

    pytest benchmarks/test_bench_llama.py                       # full timing
    pytest benchmarks/test_bench_llama.py --benchmark-disable   # quick check that everything runs (CI)

Never asserts on time (docs/benchmarks.md).
"""

from __future__ import annotations

import pytest

from megakernels.bench import rope, swiglu
from megakernels.bench.common import DTYPES, IMPLS, implementation

MODULES = {"test_rope": rope, "test_swiglu": swiglu}


def pytest_generate_tests(metafunc):
    if "shape" in metafunc.fixturenames:
        mod = MODULES[metafunc.function.__name__]
        shapes = mod.QUICK_SHAPES if metafunc.config.getoption("benchmark_disable") else mod.SHAPES
        metafunc.parametrize("shape", shapes, ids=lambda s: "x".join(map(str, s)))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("passes", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("dtype", rope.DEFAULT_DTYPES)
@pytest.mark.parametrize("variant", list(rope.COMPOSITIONS))
def test_rope(benchmark, variant, dtype, passes, impl, shape):
    q, k, ctx, grads = rope.make_inputs(shape, DTYPES[dtype], grad=passes != "fwd")
    fn = rope.step_fn(implementation(rope.COMPOSITIONS[variant], impl), q, k, ctx, grads, backward=passes != "fwd")
    benchmark.group = f"rope {variant} {dtype} {'x'.join(map(str, shape))} {passes}"
    benchmark(fn)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("passes", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("dtype", swiglu.DEFAULT_DTYPES)
def test_swiglu(benchmark, dtype, passes, impl, shape):
    x, dy = swiglu.make_inputs(shape, DTYPES[dtype], grad=passes != "fwd")
    fn = swiglu.step_fn(implementation(swiglu.COMPOSITION, impl), x, dy, backward=passes != "fwd")
    benchmark.group = f"swiglu {dtype} {shape[0]}x{2 * shape[1]} {passes}"
    benchmark(fn)
