"""pytest-benchmark of one training step (fwd + bwd + AdamW) of megakernels' GPT (Llama) vs a plain eager PyTorch GPT
(Llama) of the same shape (megakernels_models/bench/eager_gpt.py): the CPU-sized GPTs and llama-tiny.

    pytest benchmarks/test_bench_e2e.py                       # full timing
    pytest benchmarks/test_bench_e2e.py --benchmark-disable   # quick check that everything runs (CI)

Never asserts on time (docs/benchmarks.md).
"""

from __future__ import annotations

import pytest
import torch

from megakernels.parallel.launch import single_process_world
from megakernels_models.bench.eager_gpt import CPU_PRESETS, FAMILIES, copy_weights

LLAMA = "llama-tiny"  # a trainer preset (l4 h256 a8 kv2 s256, f 704), micro-batch 8


@pytest.fixture(scope="module")
def world():
    with single_process_world(parallel=True):
        yield


@pytest.mark.parametrize("impl", ["megakernels", "eager"])
@pytest.mark.parametrize("name", [*CPU_PRESETS, LLAMA])
def test_train_step(benchmark, world, name, impl):
    from megakernels.optim import FusedAdamW
    from megakernels_models.models.config import ModelConfig, preset

    if name == LLAMA:
        cfg, mbs = preset(LLAMA, dropout=0.0, attention_dropout=0.0), 8
    else:
        cfg, mbs = CPU_PRESETS[name]
        cfg = ModelConfig(**cfg)
    if benchmark.disabled:  # a quick run: same code, small shapes
        cfg, mbs = cfg.replace(hidden_size=64, num_heads=4, num_kv_heads=min(4, cfg.num_kv_heads), seq_length=64), 2
    fused_cls, eager_cls = FAMILIES[cfg.model][:2]
    fused = fused_cls()(cfg, seed=1)
    ids = torch.randint(0, cfg.vocab_size, (mbs, cfg.seq_length))
    if impl == "megakernels":
        model, opt = fused, FusedAdamW(fused.parameters(), lr=1e-4)
        loss_fn = lambda: model(ids, labels=ids).mean()  # noqa: E731
    else:
        model = eager_cls(cfg)
        copy_weights(model, fused)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        loss_fn = lambda: model(ids, ids)  # noqa: E731

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn().backward()
        opt.step()

    benchmark.group = f"e2e {name}"
    benchmark(step)
