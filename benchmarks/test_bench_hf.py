"""pytest-benchmark suite of HuggingFace transformers models patched by megakernels
(``megakernels bench --ops hf_train``): one training step of a GPT-2-small-shaped and a Llama-shaped model,
patched against unpatched (transformers' own modules), forward+backward and with the optimizer step (FusedAdamW
patched, torch.optim.AdamW unpatched).

    pytest benchmarks/test_bench_hf.py                       # full timing
    pytest benchmarks/test_bench_hf.py --benchmark-disable   # quick check that everything runs (CI)

Never asserts on time (docs/benchmarks.md).
"""

from __future__ import annotations

import pytest
import transformers  # noqa: F401  (the test extra's: imported, never skipped)

from megakernels.bench import hf


def pytest_generate_tests(metafunc):
    if "model" in metafunc.fixturenames:
        models = hf.QUICK_MODELS if metafunc.config.getoption("benchmark_disable") else hf.MODELS
        metafunc.parametrize("model", list(models.values()), ids=list(models))


@pytest.mark.parametrize("impl", ["megakernels", "transformers"])
@pytest.mark.parametrize("passes", hf.PASSES)
def test_hf_train(benchmark, model, passes, impl):
    plain, patched = hf.pair(model)
    m = patched if impl == "megakernels" else plain
    opt = hf.optimizer_for(m, impl == "megakernels") if passes == "step" else None
    benchmark.group = f"hf_train {model[0]} {passes}"
    benchmark(hf.step_fn(m, hf.batch(model), opt))
