"""Bias-GeLU microbenchmark: the fused ``gelu(x + bias)`` vs PyTorch eager vs torch.compile of the same composition.

    megakernels bench --ops bias_gelu [--dtype float32,bfloat16] [--shapes rows,hidden;...] [--device cpu|cuda]
                      [--no-compile] [--quick] [--out DIR]

The measurement is the norms' (``megakernels.bench.norms.measure``: one table, GB/s and % of the copy
bandwidth, speed-ups vs eager and torch.compile, never asserting on time) over this composition; bytes that must
move: x read and y written forward; dy read, dx written and x read again backward. The pytest-benchmark suite
(benchmarks/test_bench_bias_gelu.py) times the same callables.
"""

from __future__ import annotations

import functools

import torch.nn.functional as F

from megakernels.bench import norms
from megakernels.bench.common import Request, run_measure
from megakernels.bench.norms import Composition
from megakernels.ops import bias_gelu

FAMILY = "bias_gelu"
COMPOSITIONS = {
    "bias_gelu": Composition(
        "bias_gelu",
        1,
        lambda x, b: bias_gelu(x, b, "tanh"),
        lambda x, b: F.gelu(x + b, approximate="tanh"),
    ),
}
OPS = tuple(COMPOSITIONS)
DEFAULT_DTYPES = norms.DEFAULT_DTYPES
default_shapes = norms.default_shapes
measure = functools.partial(norms.measure, compositions=COMPOSITIONS, family=FAMILY)


def run(request: Request) -> list[dict]:
    """``megakernels bench --ops bias_gelu`` (``common.Request``)."""
    return run_measure(measure, request, DEFAULT_DTYPES, default_shapes)
