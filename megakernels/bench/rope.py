"""Rotary-embedding microbenchmark: fused_rope vs PyTorch eager vs torch.compile of the same composition, run by
``megakernels bench --ops rope``.

The composition is HuggingFace Llama's: ``q * cos + rotate_half(q) * sin`` (and the same for k), in two variants:

- ``angles``: cos/sin are derived from the positions inside the timed step (eager: ``positions * inv_freq``,
  ``cat``, ``cos``, ``sin``, cast; ours: in the kernel, nothing in memory);
- ``table``: cos/sin are precomputed, as HF does once per model forward for all layers (eager: ``[1, s, 1, d]``
  tensors in the input dtype; ours: the fp32 ``cos_sin`` table).

Shapes are Llama-3-8B's attention (32 query heads, 8 kv heads, head dim 128) at a few thousand tokens. Bytes that
must move: q and k read and written forward, their gradients read and written backward (the table is noise).
Never asserts on time; the pytest-benchmark suite (benchmarks/test_bench_llama.py) times the same callables.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from megakernels.bench import ceilings as ceil
from megakernels.bench.common import DTYPES, OURS, Request, TablePrinter, median_seconds, result_row, run_measure
from megakernels.ops import fused_rope, rope_cos_sin_table

FAMILY = "rope"
THETA = 500000.0
# (batch, seq, heads_q, heads_kv, head_dim)
SHAPES = [(1, 2048, 32, 8, 128), (2, 2048, 32, 8, 128)]
GPU_SHAPES = [(8, 4096, 32, 8, 128), (1, 32768, 32, 8, 128)]
QUICK_SHAPES = [(1, 128, 4, 2, 64)]
DEFAULT_DTYPES = ("float32", "bfloat16")


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), -1)


def _apply(q, k, cos, sin):
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _eager_angles(q, k, ctx):
    freqs = ctx["positions"].float()[:, None] * ctx["inv_freq"][None, :]
    emb = torch.cat((freqs, freqs), -1)
    return _apply(q, k, emb.cos().to(q.dtype)[None, :, None, :], emb.sin().to(q.dtype)[None, :, None, :])


@dataclasses.dataclass(frozen=True)
class Composition:
    """One variant: the fused call and the eager composition, both ``(q, k, ctx) -> (q_rot, k_rot)``."""

    variant: str
    fused: Callable
    eager: Callable


COMPOSITIONS = {
    "angles": Composition("angles", lambda q, k, ctx: fused_rope(q, k, ctx["positions"], theta=THETA), _eager_angles),
    "table": Composition(
        "table",
        lambda q, k, ctx: fused_rope(q, k, ctx["positions"], cos_sin=ctx["cos_sin"]),
        lambda q, k, ctx: _apply(q, k, ctx["cos"], ctx["sin"]),
    ),
}


def make_inputs(shape, dtype, grad=False, device="cpu"):
    """(q, k, ctx, (dq, dk)): seeded q ``[b, s, hq, d]`` and k ``[b, s, hk, d]`` in ``dtype``, the gradients, and
    ``ctx`` with the positions, HF's fp32 ``inv_freq``, its cos/sin ``[1, s, 1, d]`` in ``dtype`` and our table."""
    b, s, hq, hk, d = shape
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn((b, s, hq, d), generator=g, device=device).to(dtype).requires_grad_(grad)
    k = torch.randn((b, s, hk, d), generator=g, device=device).to(dtype).requires_grad_(grad)
    grads = (
        torch.randn(q.shape, generator=g, device=device).to(dtype),
        torch.randn(k.shape, generator=g, device=device).to(dtype),
    )
    positions = torch.arange(s, device=device)
    inv_freq = 1.0 / (THETA ** (torch.arange(0, d, 2, device=device).float() / d))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), -1)
    ctx = {
        "positions": positions,
        "inv_freq": inv_freq,
        "cos": emb.cos().to(dtype)[None, :, None, :],
        "sin": emb.sin().to(dtype)[None, :, None, :],
        "cos_sin": rope_cos_sin_table(s, d, THETA, device),
    }
    return q, k, ctx, grads


def step_fn(fn: Callable, q, k, ctx, grads, backward: bool) -> Callable[[], None]:
    """A zero-argument callable running ``fn`` forward (and backward, the grads dropped each call)."""
    if not backward:

        def fwd():
            with torch.no_grad():
                fn(q, k, ctx)

        return fwd

    def fwd_bwd():
        torch.autograd.backward(fn(q, k, ctx), grads, inputs=[q, k])
        q.grad = k.grad = None

    return fwd_bwd


def bytes_moved(shape, dtype, backward: bool) -> int:
    """q and k read and written (forward); their gradients read and written again (backward)."""
    b, s, hq, hk, d = shape
    n = b * s * (hq + hk) * d * (torch.finfo(dtype).bits // 8)
    return 2 * n * (2 if backward else 1)


def default_shapes(device: str, quick: bool):
    return QUICK_SHAPES if quick else (GPU_SHAPES if device == "cuda" else SHAPES)


def measure(
    ops, dtypes, shapes, *, device="cpu", with_compile=True, min_run_time=0.3, ceilings=None, log=print, peers=None
) -> list[dict]:
    """Measure both variants at every (dtype, shape, fwd / fwd+bwd). ``ops`` is ``["rope"]`` (the bench CLI's
    uniform signature); no peer ships this op, so ``peers`` is unused. Returns the result rows."""
    rows, table = [], TablePrinter(log)
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        for shape in shapes:
            for comp in COMPOSITIONS.values():
                for backward in (False, True):
                    q, k, ctx, grads = make_inputs(shape, dtype, grad=backward, device=device)
                    times = {
                        OURS: median_seconds(step_fn(comp.fused, q, k, ctx, grads, backward), min_run_time),
                        "eager": median_seconds(step_fn(comp.eager, q, k, ctx, grads, backward), min_run_time),
                    }
                    if with_compile:
                        torch._dynamo.reset()
                        compiled = torch.compile(comp.eager, dynamic=False)
                        times["compile"] = median_seconds(step_fn(compiled, q, k, ctx, grads, backward), min_run_time)
                    value, cname = ceil.for_unit(ceilings, "GB/s", dtype_name)
                    b, s, hq, hk, d = shape
                    row = result_row(
                        "rope",
                        FAMILY,
                        dtype=dtype_name,
                        shape=f"{b}x{s}x{hq}+{hk}x{d}",
                        pass_="fwd+bwd" if backward else "fwd",
                        variant=comp.variant,
                        size=b * s,
                        size_label="tokens",
                        unit="GB/s",
                        work=bytes_moved(shape, dtype, backward),
                        times=times,
                        ceiling=value,
                        ceiling_name=cname,
                        dims=list(shape),
                    )
                    rows.append(row)
                    table(row)
    return rows


def run(request: Request) -> list[dict]:
    """``megakernels bench`` for this family (``common.Request``)."""
    return run_measure(measure, request, DEFAULT_DTYPES, default_shapes)
