"""Muon microbenchmarks: the Newton-Schulz kernel against the plain ``torch.mm`` iteration, and the optimizer step
against FusedAdamW, per parameter.

    megakernels bench --ops muon [--dtype float32] [--device cpu|cuda] [--quick] [--out DIR]

- ``newton_schulz`` (pass): ``megakernels.ops.muon.newton_schulz`` (the C++ kernel on the CPU, Triton on CUDA: the
  symmetric products' lower triangle, the polynomial folded into the epilogues) against
  ``newton_schulz_reference`` (``torch`` matrix products, what torch.optim.Muon and most implementations run), 5
  iterations on a batch of same-shaped matrices. The rate counts the plain iteration's FLOPs for both
  (``4 m² n + 2 m³`` an iteration, m <= n): the kernel executes about 2/3 of them for a square matrix, so its rate
  is an effective one, and its fraction of the measured GEMM rate can exceed what its own products reach.
- ``step`` (pass): one ``megakernels.optim.Muon`` step on a set of matrices (momentum, Newton-Schulz per matrix,
  the update), against ``FusedAdamW`` on the same parameters and ``torch.optim.Muon`` (its Newton-Schulz in bf16,
  one matrix at a time); the rate counts the bytes AdamW must move (as ``bench adamw``: the same work for every
  implementation, so the rates compare), and ``ns/param`` is each one's time per parameter.

Medians over calibrated repeats; never asserts on time.
"""

from __future__ import annotations

import torch

from megakernels.bench import ceilings as ceil
from megakernels.bench.adamw import bytes_moved
from megakernels.bench.common import DTYPES, OURS, Request, TablePrinter, median_seconds, result_row
from megakernels.ops.muon import newton_schulz, newton_schulz_reference
from megakernels.optim import FusedAdamW, Muon

FAMILY = "muon"
OPS = ("muon",)
STEPS = 5
# name: (batch, m, n) of the Newton-Schulz pass; the step's parameter sets are that many [m, n] matrices
CONFIGS = {"8x512x512": (8, 512, 512), "4x256x1024": (4, 256, 1024), "1x1024x2048": (1, 1024, 2048)}
QUICK_CONFIGS = {"2x48x80": (2, 48, 80)}
DEFAULT_DTYPES = ("float32",)


def plain_flops(batch: int, m: int, n: int, steps: int = STEPS) -> float:
    """FLOPs of the plain iteration: per matrix and iteration ``X Xᵀ`` (2 m² n), ``A A`` (2 m³), ``B X`` (2 m² n)
    with m the smaller side."""
    m, n = min(m, n), max(m, n)
    return batch * steps * (4.0 * m * m * n + 2.0 * m * m * m)


def _matrices(batch: int, m: int, n: int, dtype, device, grads: bool):
    g = torch.Generator().manual_seed(0)
    params = []
    for _ in range(batch):
        p = torch.randn(m, n, generator=g).to(dtype=dtype, device=device).requires_grad_(True)
        if grads:
            p.grad = (torch.randn(m, n, generator=g) * 1e-2).to(dtype=dtype, device=device)
        params.append(p)
    return params


def optimizer(impl: str, params, device: str):
    """The optimizer ``impl`` (megakernels Muon, fused_adamw, torch_muon) over ``params``, after one step."""
    if impl == OURS:
        opt = Muon(params, lr=1e-3, weight_decay=0.1, ns_dtype="auto")
    elif impl == "fused_adamw":
        opt = FusedAdamW(params, lr=1e-3, weight_decay=0.1, master_weights=params[0].dtype != torch.float32)
    elif impl == "torch_muon":
        opt = torch.optim.Muon(params, lr=1e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    else:
        raise ValueError(f"muon bench: impl must be megakernels, fused_adamw or torch_muon, got {impl!r}")
    opt.step()
    return opt


def measure(configs: dict, dtypes, *, device="cpu", min_run_time=0.5, ceilings=None, log=print) -> list[dict]:
    """Both passes (module docstring) for each config ``{name: (batch, m, n)}`` and dtype; returns the rows,
    each printed through ``log`` as it is measured."""
    rows, ns_table, step_table = [], TablePrinter(log), TablePrinter(log)
    for cname, (batch, m, n) in configs.items():
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            x = torch.randn(batch, m, n, generator=torch.Generator().manual_seed(1)).to(dtype=dtype, device=device)
            times = {
                OURS: median_seconds(lambda: newton_schulz(x, STEPS), min_run_time),
                "torch_mm": median_seconds(lambda: newton_schulz_reference(x, STEPS), min_run_time),
            }
            same = dict(dtype=dtype_name, shape=cname, size=batch * m * n)  # both passes' rows
            value, name = ceil.for_unit(ceilings, "TFLOP/s", dtype_name)
            row = result_row(
                "muon",
                FAMILY,
                **same,
                pass_="newton_schulz",
                size_label="elements",
                unit="TFLOP/s",
                work=plain_flops(batch, m, n),
                times=times,
                ceiling=value,
                ceiling_name=name,
                batch=batch,
                rows=m,
                cols=n,
                steps=STEPS,
            )
            rows.append(row)
            ns_table(row)
            times = {}
            for impl in (OURS, "fused_adamw", "torch_muon"):
                opt = optimizer(impl, _matrices(batch, m, n, dtype, device, grads=True), device)
                times[impl] = median_seconds(opt.step, min_run_time)
                opt = None  # free one optimizer's state before the next allocates its own
            per = 1e9 / (batch * m * n)
            value, name = ceil.for_unit(ceilings, "GB/s", dtype_name)
            row = result_row(
                "muon",
                FAMILY,
                **same,
                pass_="step",
                size_label="parameters",
                unit="GB/s",
                work=bytes_moved(batch, m * n, dtype, dtype != torch.float32),
                times=times,
                ceiling=value,
                ceiling_name=name,
                extra_columns={f"{k} ns/param": t * per for k, t in times.items()},
            )
            rows.append(row)
            step_table(row)
    return rows


def run(request: Request) -> list[dict]:
    """``megakernels bench --ops muon`` (``common.Request``; at least a second of repeats a measurement, a
    twentieth in a quick run)."""
    return measure(
        QUICK_CONFIGS if request.quick else CONFIGS,
        request.dtypes_or(DEFAULT_DTYPES),
        device=request.device,
        min_run_time=max(request.min_run_time, 0.05 if request.quick else 1.0),
        ceilings=request.ceilings,
        log=request.log,
    )
