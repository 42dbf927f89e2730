"""pytest-benchmark suite of flash_attention vs torch SDPA (fwd and fwd+bwd, causal and not).

    pytest benchmarks/test_bench_attention.py                       # full timing
    pytest benchmarks/test_bench_attention.py --benchmark-disable   # quick check that everything runs (CI)

Never asserts on time (docs/design.md §6).
"""

import pytest
import torch

from megakernels.bench.attention import make_inputs, shape_for, steps


def _seqlen(config):
    return 128 if config.getoption("benchmark_disable") else 2048


@pytest.mark.parametrize("impl", ["flash", "sdpa"])
@pytest.mark.parametrize("passes", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention(benchmark, request, impl, passes, causal):
    s, d = _seqlen(request.config), 64
    b, h = shape_for(s, d, "cpu")
    q, k, v, do = make_inputs(b, h, s, d, torch.float32, "cpu", passes != "fwd")
    benchmark.group = f"attention d{d} s{s} {'causal' if causal else 'full'} {passes}"
    benchmark(steps(q, k, v, do, causal, passes != "fwd")[impl])
