"""pytest-benchmark suite of flash_attention vs torch SDPA (fwd and fwd+bwd, causal and not).

    pytest benchmarks/test_bench_attention.py                       # full timing
    pytest benchmarks/test_bench_attention.py --benchmark-disable   # quick check that everything runs (CI)

Never asserts on time (docs/benchmarks.md).
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


def test_dropout_script_runs_and_records_every_row(tmp_path):
    """benchmarks/attention_dropout_cpu.py at --quick: one row per dtype and head dim, every time measured."""
    import json

    from benchmarks import attention_dropout_cpu

    assert attention_dropout_cpu.main(["--quick", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "attention_dropout_cpu.json").read_text())["results"]
    assert [(r["dtype"], r["shape"]) for r in rows] == [
        ("float32", "1x8x256x64"),
        ("float32", "1x4x256x128"),
        ("bfloat16", "1x8x256x64"),
        ("bfloat16", "1x4x256x128"),
    ]
    assert all(r[k] > 0 for r in rows for k in ("kernel_ms", "pytorch_path_ms", "sdpa_ms"))
