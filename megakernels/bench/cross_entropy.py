"""Cross-entropy microbenchmark: megakernels.ops.cross_entropy vs F.cross_entropy (+ Liger-Kernel when installed),
time and peak memory.

    megakernels bench --ops cross_entropy [--device cpu|cuda] [--dtype bfloat16,float32] [--shapes tokens,vocab;...]
                      [--quick] [--out DIR]

Shapes [tokens, vocab]: [16384, 50304] and [8192, 131072] on a GPU (GPT-2's padded vocab, a Llama-3-size one),
a quarter of the tokens on the CPU. The PyTorch baseline (``eager``) is what Megatron and nanoGPT write:
``F.cross_entropy(logits.float(), target)`` (the fp32 upcast of bf16 logits included). Two passes: ``fwd`` (the
training forward: logits that require grad) and ``fwd+bwd``. GB/s counts the bytes that must move: the logits
read once forward; read once and the gradient written once backward. Peak memory is the
largest amount of memory allocated during forward+backward beyond the logits and targets themselves (torch.cuda's
counter on a GPU; on the CPU the rise of a fresh process's peak resident set over the inputs). Never asserts
on time.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import torch.nn.functional as F

from megakernels.bench import ceilings as ceil
from megakernels.bench.common import DTYPES, Request, TablePrinter, median_seconds, result_row
from megakernels.bench.peers import Peers
from megakernels.ops import cross_entropy

FAMILY = "cross_entropy"
OPS = ("cross_entropy",)
GPU_SHAPES = [(16384, 50304), (8192, 131072)]
CPU_SHAPES = [(4096, 50304), (2048, 131072)]
QUICK_SHAPES = [(64, 1000)]
DEFAULT_DTYPES = ("bfloat16", "float32")

IMPLS = {
    "megakernels": lambda x, t: cross_entropy(x, t).mean(),
    "eager": lambda x, t: F.cross_entropy(x.float(), t),
}


def _proc_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def make_inputs(n, v, dtype, device):
    """Logits [n, v] (requires grad) and targets [n], seeded."""
    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn((n, v), generator=g, device=device) * 2).to(dtype).requires_grad_(True)
    t = torch.randint(0, v, (n,), generator=g, device=device)
    return x, t


def step(impl, x, t, fn=None):
    """Forward + backward of ``IMPLS[impl]`` (or ``fn``), the gradient dropped."""
    fn = fn or IMPLS[impl]

    def run():
        fn(x, t).backward()
        x.grad = None

    return run


def forward(impl, x, t, fn=None):
    """The training forward of ``IMPLS[impl]`` (or ``fn``: the logits require grad, so it keeps what its backward
    would need), the loss dropped."""
    fn = fn or IMPLS[impl]

    def run():
        fn(x, t)

    return run


PASSES = {"fwd": forward, "fwd+bwd": step}


def peak_bytes(impl, x, t, fn=None) -> int | None:
    """Memory allocated by one forward+backward beyond its inputs (None for a peer on the CPU, which a fresh
    process cannot rebuild)."""
    if x.device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(impl, x, t, fn)()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    if impl not in IMPLS:
        return None
    # CPU: in a fresh process, the peak resident set (VmHWM, reset through /proc/self/clear_refs once the inputs
    # exist) over the resident set at that point.
    code = (
        f"from megakernels.bench.cross_entropy import make_inputs, step, _proc_kib; import torch; "
        f"x, t = make_inputs({x.shape[0]}, {x.shape[1]}, {x.dtype}, 'cpu'); "
        f"open('/proc/self/clear_refs', 'w').write('5'); base = _proc_kib('VmRSS'); "
        f"step({impl!r}, x, t)(); print((_proc_kib('VmHWM') - base) * 1024)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    return int(out.stdout.split()[-1])


def default_shapes(device: str, quick: bool):
    return QUICK_SHAPES if quick else (GPU_SHAPES if device == "cuda" else CPU_SHAPES)


def measure(
    dtypes, shapes, *, device="cpu", min_run_time=0.3, ceilings=None, peers: Peers | None = None, log=print
) -> list[dict]:
    """Time and measure the peak memory of forward+backward for every (dtype, shape); returns the result rows,
    each printed through ``log`` as it is measured."""
    rows, table = [], TablePrinter(log)
    peers = peers or Peers(device, enabled=False)
    extra = peers.cross_entropy()
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        for n, v in shapes:
            x, t = make_inputs(n, v, dtype, device)
            fns = {**IMPLS, **extra}
            for pass_, make in PASSES.items():
                both = pass_ == "fwd+bwd"  # peak memory: of the training step
                times, peaks = {}, {}
                for impl, fn in fns.items():
                    try:
                        times[impl] = median_seconds(make(impl, x, t, fn), min_run_time)
                        if both:
                            peaks[impl] = peak_bytes(impl, x, t, fn)
                    except Exception as e:
                        if impl not in extra:
                            raise
                        peers.failed(impl, f"cross_entropy {pass_} {dtype_name} {n}x{v}", e)
                value, cname = ceil.for_unit(ceilings, "GB/s", dtype_name)
                peak_mib = {k: (b / 2**20 if b is not None else None) for k, b in peaks.items()}
                row = result_row(
                    "cross_entropy",
                    FAMILY,
                    dtype=dtype_name,
                    shape=f"{n}x{v}",
                    pass_=pass_,
                    size=v,
                    size_label="vocabulary",
                    unit="GB/s",
                    work=(3 if both else 1) * n * v * x.element_size(),
                    times=times,
                    ceiling=value,
                    ceiling_name=cname,
                    tokens=n,
                    vocab=v,
                    **({"peak_MiB": peak_mib} if both else {}),
                    rows=n,
                    extra_columns={f"{k} MiB": m for k, m in peak_mib.items()} if both else {},
                )
                rows.append(row)
                table(row)
    return rows


def run(request: Request) -> list[dict]:
    """``megakernels bench --ops cross_entropy`` (``common.Request``)."""
    return measure(
        request.dtypes_or(DEFAULT_DTYPES),
        request.shapes_or(default_shapes),
        device=request.device,
        min_run_time=request.min_run_time,
        ceilings=request.ceilings,
        peers=request.peers,
        log=request.log,
    )
