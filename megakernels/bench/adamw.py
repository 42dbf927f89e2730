"""AdamW step microbenchmark: megakernels FusedAdamW vs torch.optim.AdamW (foreach=True and fused=True) (+ apex).

    megakernels bench --ops adamw [--dtype float32] [--device cpu|cuda] [--quick] [--out DIR]
    megakernels bench --ops adamw_offload [--dtype bfloat16] [--device cpu|cuda] [--quick] [--out DIR]

``adamw_offload`` (``run_offload``): the optimizer step of ``--offload-optimizer`` per parameter. Ours is the C++
CPU AdamW on an offloaded ``ParallelOptimizer``'s host state (fp32 masters and moments, whatever the params'
dtype); the baselines are torch's AdamW (fused, foreach) on fp32 params on ``--device``; the extra columns give
ours and the whole offloaded ``ParallelOptimizer.step()`` (gradient copies to the host, norm, clipping, the host
AdamW, the copies back into the params) in ns per parameter. ``costs.HOST_ADAMW_NS_PER_PARAM``, the plan's
default, is what it measured on the development machine.

One optimizer step over a parameter set (e.g. 50 tensors of 1M params, or one of 100M), grads fixed, state
already initialised. Prints a table (median step time over calibrated repeats, effective GB/s and its fraction of
the copy bandwidth measured in the same run, speed-up vs each torch variant and apex FusedAdam when installed).
Never asserts on time.

Bytes that must move per element and step (fp32): read param, grad, exp_avg, exp_avg_sq and write param,
exp_avg, exp_avg_sq = 7 x 4 bytes; with master weights (16-bit params) read/write the fp32 master as well.
The pytest-benchmark suite (benchmarks/test_bench_adamw.py) times the same callables.
"""

from __future__ import annotations

import torch

from megakernels.bench import ceilings as ceil
from megakernels.bench.common import DTYPES, Request, TablePrinter, median_seconds, result_row
from megakernels.bench.peers import Peers
from megakernels.optim import FusedAdamW

FAMILY = "adamw"
OPS = ("adamw", "adamw_offload")
OFFLOAD_CONFIGS = {"16x1M": (16, 1 << 20), "64x1M": (64, 1 << 20)}
OFFLOAD_QUICK_CONFIGS = {"4x64K": (4, 1 << 16)}
OFFLOAD_DTYPES = ("bfloat16",)
CONFIGS = {"50x1M": (50, 1 << 20), "1x100M": (1, 100_000_000)}
QUICK_CONFIGS = {"8x64K": (8, 1 << 16)}
DEFAULT_DTYPES = ("float32",)
IMPLS = ("megakernels", "torch_foreach", "torch_fused")


def make_optimizer(impl: str, n_tensors: int, numel: int, dtype: torch.dtype, device: str = "cpu", factory=None):
    """Params with grads set and state initialised (one warm-up step), ready to time `opt.step()`.

    ``impl`` is one of ``IMPLS`` or a peer's name with its ``factory(params, lr, weight_decay)``.

    Raises:
        ValueError: an unknown ``impl`` without a factory.
    """
    g = torch.Generator().manual_seed(0)
    params = []
    for _ in range(n_tensors):
        p = torch.randn(numel, generator=g).to(dtype=dtype, device=device).requires_grad_(True)
        p.grad = torch.randn(numel, generator=g).to(dtype=dtype, device=device) * 1e-2
        params.append(p)
    if factory is not None:
        opt = factory(params, 1e-4, 0.01)
    elif impl == "megakernels":
        opt = FusedAdamW(params, lr=1e-4, weight_decay=0.01, master_weights=dtype != torch.float32)
    elif impl == "torch_foreach":
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=True)
    elif impl == "torch_fused":
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
    else:
        raise ValueError(
            f"make_optimizer: impl must be one of {', '.join(IMPLS)} (or a peer with a factory), got {impl!r}"
        )
    opt.step()
    return opt


def bytes_moved(n_tensors: int, numel: int, dtype: torch.dtype, master: bool) -> int:
    """Bytes one step must move over ``n_tensors x numel`` parameters (see the module docstring)."""
    elem = torch.finfo(dtype).bits // 8
    per = 3 * elem + 2 * 2 * elem  # param r/w, grad r, exp_avg r/w, exp_avg_sq r/w
    if master:
        per = 3 * elem + 4 * 4 + 2 * 4  # param w + grad r (16-bit), moments r/w fp32, master r/w fp32
    return n_tensors * numel * per


def default_configs(quick: bool) -> dict:
    return QUICK_CONFIGS if quick else CONFIGS


def measure(
    configs: dict,
    dtypes,
    *,
    device="cpu",
    min_run_time=0.5,
    ceilings=None,
    peers: Peers | None = None,
    log=print,
    impls=IMPLS,
) -> list[dict]:
    """Time one step of every implementation for each config ``{name: (tensors, numel)}`` and dtype; returns the
    result rows, each printed through ``log`` as it is measured."""
    rows, table = [], TablePrinter(log)
    extra = (peers or Peers(device, enabled=False)).adamw()
    for cname, (n, numel) in configs.items():
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            times = {}
            for impl in (*impls, *extra):
                try:
                    opt = make_optimizer(impl, n, numel, dtype, device, factory=extra.get(impl))
                    times[impl] = median_seconds(opt.step, min_run_time)
                except Exception as e:
                    if impl not in extra:
                        raise
                    peers.failed(impl, f"adamw {dtype_name} {cname}", e)
                opt = None  # free this implementation's state before the next one allocates its own
            master = dtype != torch.float32
            value, name = ceil.for_unit(ceilings, "GB/s", dtype_name)
            row = result_row(
                "adamw",
                FAMILY,
                dtype=dtype_name,
                shape=cname,
                pass_="step",
                size=n * numel,
                size_label="parameters",
                unit="GB/s",
                work=bytes_moved(n, numel, dtype, master),
                times=times,
                ceiling=value,
                ceiling_name=name,
                tensors=n,
                numel=numel,
                master_weights=master,
            )
            rows.append(row)
            table(row)
    return rows


def make_offloaded(n_tensors: int, numel: int, dtype: torch.dtype, device: str = "cpu"):
    """A ``ParallelOptimizer(offload=True)`` over ``n_tensors`` params of ``numel`` (fp32 or bf16) whose fp32
    ``main_grad`` is set, after one step (state initialised).

    Raises:
        ValueError: a dtype other than float32 and bfloat16.
    """
    from megakernels.parallel.optimizer import ParallelOptimizer

    precision = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype)
    if precision is None:
        raise ValueError(f"adamw_offload: dtype must be float32 or bfloat16, got {dtype}")
    g = torch.Generator().manual_seed(0)
    params = []
    for _ in range(n_tensors):
        p = torch.randn(numel, generator=g).to(dtype=dtype, device=device).requires_grad_(True)
        p.main_grad = (torch.randn(numel, generator=g) * 1e-2).to(device)
        params.append(p)
    opt = ParallelOptimizer(params, lr=1e-4, weight_decay=0.01, precision=precision, clip_grad=1.0, offload=True)
    opt.step()
    return opt


def run_offload(configs: dict, dtypes, *, device="cpu", min_run_time=0.5, ceilings=None, log=print) -> list[dict]:
    """Time the offloaded optimizer step (see the module docstring) for each config ``{name: (tensors, numel)}``
    and params dtype; returns the result rows, each printed through ``log`` as it is measured."""
    rows, table = [], TablePrinter(log)
    for cname, (n, numel) in configs.items():
        for dtype_name in dtypes:
            opt = make_offloaded(n, numel, DTYPES[dtype_name], device)
            times = {"megakernels": median_seconds(opt._adam.step, min_run_time)}
            whole = median_seconds(opt.step, min_run_time)
            opt = None
            for impl in ("torch_fused", "torch_foreach"):
                times[impl] = median_seconds(make_optimizer(impl, n, numel, torch.float32, device).step, min_run_time)
            per = 1e9 / (n * numel)
            value, name = ceil.for_unit(ceilings, "GB/s", "float32")
            row = result_row(
                "adamw_offload",
                FAMILY,
                dtype=dtype_name,
                shape=cname,
                pass_="step",
                size=n * numel,
                size_label="parameters",
                unit="GB/s",
                work=bytes_moved(n, numel, torch.float32, False),
                times=times,
                ceiling=value,
                ceiling_name=name,
                tensors=n,
                numel=numel,
                extra_columns={"ns/param": times["megakernels"] * per, "step ns/param": whole * per},
            )
            rows.append(row)
            table(row)
    return rows


def run(request: Request) -> list[dict]:
    """``megakernels bench --ops adamw,adamw_offload`` (``common.Request``; at least a second of repeats a
    measurement, a twentieth in a quick run: a step is milliseconds)."""
    t = max(request.min_run_time, 0.05 if request.quick else 1.0)
    rows = []
    if "adamw" in request.ops:
        rows += measure(
            default_configs(request.quick),
            request.dtypes_or(DEFAULT_DTYPES),
            device=request.device,
            min_run_time=t,
            ceilings=request.ceilings,
            peers=request.peers,
            log=request.log,
        )
    if "adamw_offload" in request.ops:
        rows += run_offload(
            OFFLOAD_QUICK_CONFIGS if request.quick else OFFLOAD_CONFIGS,
            request.dtypes_or(OFFLOAD_DTYPES),
            device=request.device,
            min_run_time=t,
            ceilings=request.ceilings,
            log=request.log,
        )
    return rows
