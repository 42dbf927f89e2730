"""pytest-benchmark suite of the mixture-of-experts grouped GEMM (``megakernels bench --ops grouped_gemm``):
``megakernels.ops.grouped_gemm`` against a loop of per-expert matmuls and ``torch._grouped_mm`` (where the installed
torch runs it), fwd and fwd+bwd, fp32 and bf16, at top-2 routing over 8 experts. The all-to-all dispatch spawns
processes and is measured by ``megakernels bench --ops moe_dispatch`` only.

    pytest benchmarks/test_bench_moe.py                       # full timing
    pytest benchmarks/test_bench_moe.py --benchmark-disable   # quick check that everything runs (CI)

Never asserts on time (docs/benchmarks.md).
"""

from __future__ import annotations

import pytest

from megakernels.bench import moe
from megakernels.bench.common import DTYPES


def pytest_generate_tests(metafunc):
    if "shape" in metafunc.fixturenames:
        shapes = moe.QUICK_SHAPES if metafunc.config.getoption("benchmark_disable") else moe.SHAPES
        metafunc.parametrize("shape", shapes, ids=lambda s: "x".join(map(str, s)))


@pytest.mark.parametrize("impl", list(moe.IMPLEMENTATIONS))
@pytest.mark.parametrize("passes", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("dtype", moe.DEFAULT_DTYPES)
def test_grouped_gemm(benchmark, dtype, passes, impl, shape):
    why = moe.available(impl, DTYPES[dtype], "cpu")
    if why:
        pytest.skip(why)
    x, w, sizes, dy = moe.make_inputs(shape, DTYPES[dtype], grad=passes != "fwd")
    benchmark.group = f"grouped_gemm {dtype} {'x'.join(map(str, shape))} {passes}"
    benchmark(moe.step_fn(moe.IMPLEMENTATIONS[impl], x, w, sizes, dy, backward=passes != "fwd"))
