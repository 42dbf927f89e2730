"""pytest-benchmark suite of the AdamW step: megakernels FusedAdamW vs torch.optim.AdamW foreach / fused.

    pytest benchmarks/test_bench_adamw.py                       # full timing (50 x 1M and 1 x 100M params)
    pytest benchmarks/test_bench_adamw.py --benchmark-disable   # quick check that everything runs (CI)

Never asserts on time (docs/benchmarks.md).
"""

from __future__ import annotations

import pytest

from megakernels.bench.adamw import CONFIGS, IMPLS, QUICK_CONFIGS, make_optimizer
from megakernels.bench.common import DTYPES


def configs(config):
    return QUICK_CONFIGS if config.getoption("benchmark_disable") else CONFIGS


def pytest_generate_tests(metafunc):
    if "config" in metafunc.fixturenames:
        cs = configs(metafunc.config)
        metafunc.parametrize("config", list(cs.values()), ids=list(cs))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", ["float32"])
def test_adamw_step(benchmark, impl, dtype, config):
    n, numel = config
    opt = make_optimizer(impl, n, numel, DTYPES[dtype])
    benchmark.group = f"adamw {dtype} {n}x{numel}"
    benchmark(opt.step)
