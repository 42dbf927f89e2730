"""FlashAttention microbenchmark: megakernels.ops.flash_attention vs torch's scaled_dot_product_attention (+ the
flash-attn package when installed).

    megakernels bench --ops flash_attention [--device cpu|cuda] [--dtype bfloat16,float16] [--head-dims 64,128]
                      [--seqlens 512,1024,...] [--quick] [--out DIR]

TFLOP/s are counted as flash-attn does: forward ``4 * b * h * s^2 * d`` (halved when causal), backward 2.5x the
forward; the fwd+bwd rows also carry the backward's own rate (``bwd_TFLOPs``, from the fwd+bwd time minus the fwd
time of the same run), which docs/benchmarks.md's backward target is about. Each (head dim, seqlen) keeps
``b * s = 16k``
tokens and ``h * d = 2048`` on a GPU (flash-attn's sweep), smaller on the CPU. SDPA gets the same data in its own
``[b, h, s, d]`` layout, so no transpose is timed. The ceiling is the GEMM rate in the same dtype, measured in the
same run. On the CPU this compares the blocked CPU path with SDPA's CPU kernel. Never asserts on time.

Packed documents (variant ``d<d> causal 16 docs``, at s = 8192 when swept, else the longest sequence): every
sequence is 16 documents (``flash_attention(documents=...)``), timed beside the same tokens as one document ("one
document"); FLOPs count the documents' own scores, so the speed-up over "one document" is what skipping other
documents' keys buys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megakernels.bench import ceilings as ceil
from megakernels.bench.common import DTYPES, OURS, Request, TablePrinter, median_seconds, result_row
from megakernels.bench.peers import Peers
from megakernels.ops import flash_attention

FAMILY = "attention"
OPS = ("flash_attention",)
GPU_SEQLENS = [512, 1024, 2048, 4096, 8192, 16384]
PACKED_DOCUMENTS = 16  # documents per sequence of the packed case
CPU_SEQLENS = [512, 1024, 2048, 4096]


def default_dtypes(device: str) -> tuple[str, ...]:
    return ("bfloat16", "float16") if device == "cuda" else ("float32",)


def shape_for(seqlen: int, head_dim: int, device: str) -> tuple[int, int]:
    """(batch, heads) for a sweep point: 16k tokens x 2048 model width on a GPU; 4k tokens x 512 on the CPU."""
    tokens, width = (16384, 2048) if device == "cuda" else (4096, 512)
    return max(1, tokens // seqlen), max(1, width // head_dim)


def flops(b, h, s, d, causal, backward) -> float:
    """FLOPs of attention forward (``4 b h s^2 d``, halved when causal), times 3.5 with the backward."""
    f = 4.0 * b * h * s * s * d / (2 if causal else 1)
    return f * (3.5 if backward else 1.0)  # fwd + bwd = 1 + 2.5


def make_inputs(b, h, s, d, dtype, device, grad):
    """q, k, v, do of shape [b, s, h, d], seeded."""
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn((b, s, h, d), generator=g, device=device, dtype=dtype) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(grad)
    return q, k, v, do


def steps(q, k, v, do, causal, backward, peers: dict | None = None):
    """Zero-argument callables {impl: step} for flash_attention, SDPA and any peers ``{name: fn(q, k, v, causal)}``
    (peers take our ``[b, s, h, d]`` layout)."""
    qt, kt, vt, dot = (t.detach().transpose(1, 2).contiguous().requires_grad_(t.requires_grad) for t in (q, k, v, do))

    def ours():
        out = flash_attention(q, k, v, causal=causal)
        if backward:
            torch.autograd.backward(out, do, inputs=[q, k, v])

    def sdpa():
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        if backward:
            torch.autograd.backward(out, dot, inputs=[qt, kt, vt])

    def peer(fn):
        def run():
            out = fn(q, k, v, causal)
            if backward:
                torch.autograd.backward(out, do, inputs=[q, k, v])

        return run

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn()

        return run

    out = {"flash": ours, "sdpa": sdpa, **{name: peer(fn) for name, fn in (peers or {}).items()}}
    return out if backward else {name: no_grad(fn) for name, fn in out.items()}


def measure(
    dtypes, head_dims, seqlens, *, device="cpu", min_run_time=0.3, ceilings=None, peers: Peers | None = None, log=print
) -> list[dict]:
    """Measure every (dtype, head dim, seqlen, causal or not, fwd / fwd+bwd); returns the result rows, each printed
    through ``log`` as it is measured."""
    rows, table = [], TablePrinter(log)
    peers = peers or Peers(device, enabled=False)
    for dtype_name in dtypes:
        extra = peers.attention(DTYPES[dtype_name])
        for d in head_dims:
            for s in seqlens:
                b, h = shape_for(s, d, device)
                for causal in (False, True):
                    fwd_times = {}
                    for backward in (False, True):
                        q, k, v, do = make_inputs(b, h, s, d, DTYPES[dtype_name], device, backward)
                        times = {}
                        for name, fn in steps(q, k, v, do, causal, backward, extra).items():
                            try:
                                times[OURS if name == "flash" else name] = median_seconds(fn, min_run_time)
                            except Exception as e:
                                if name not in extra:
                                    raise
                                peers.failed(name, f"attention {dtype_name} d{d} s{s}", e)
                        f = flops(b, h, s, d, causal, backward)
                        fields = {}
                        if backward:  # the backward's own rate: 2.5x the forward's FLOPs over (fwd+bwd - fwd)
                            fb = flops(b, h, s, d, causal, False) * 2.5
                            fields["bwd_TFLOPs"] = {
                                k: fb / (t - fwd_times[k]) / 1e12
                                for k, t in times.items()
                                if k in fwd_times and t > fwd_times[k]
                            }
                        variant = f"d{d} {'causal' if causal else 'full'}"
                        row = _row(dtype_name, (b, h, s, d), backward, f, times, ceilings, variant, causal, **fields)
                        fwd_times = times
                        rows.append(row)
                        table(row)
            s = 8192 if 8192 in seqlens else max(seqlens)  # the static report's packed case where measured
            if s % PACKED_DOCUMENTS == 0 and s // PACKED_DOCUMENTS >= 32:
                for row in packed_rows(dtype_name, d, s, device, min_run_time, ceilings):
                    rows.append(row)
                    table(row)
    return rows


def packed_rows(dtype_name, d, s, device, min_run_time, ceilings) -> list[dict]:
    """Causal attention over sequences of ``PACKED_DOCUMENTS`` equal documents (fwd, fwd+bwd) beside the same
    tokens as one document: rows whose work is the documents' FLOPs."""
    b, h = shape_for(s, d, device)
    n = PACKED_DOCUMENTS
    docs = torch.arange(n, device=device).repeat_interleave(s // n).expand(b, s)
    rows, fwd_time = [], None
    for backward in (False, True):
        q, k, v, do = make_inputs(b, h, s, d, DTYPES[dtype_name], device, backward)

        def step(documents):
            def run():
                with torch.set_grad_enabled(backward):
                    out = flash_attention(q, k, v, causal=True, documents=documents)
                    if backward:
                        torch.autograd.backward(out, do, inputs=[q, k, v])

            return run

        times = {
            OURS: median_seconds(step(docs), min_run_time),
            "one document": median_seconds(step(None), min_run_time),
        }
        fields = {}
        if backward and times[OURS] > fwd_time:  # the backward's own rate, as the other rows carry it
            fields["bwd_TFLOPs"] = {
                OURS: n * flops(b, h, s // n, d, True, False) * 2.5 / (times[OURS] - fwd_time) / 1e12
            }
        fwd_time = times[OURS]
        work = n * flops(b, h, s // n, d, True, backward)
        rows.append(
            _row(
                dtype_name,
                (b, h, s, d),
                backward,
                work,
                times,
                ceilings,
                f"d{d} causal {n} docs",
                True,
                documents=n,
                **fields,
            )
        )
    return rows


def _row(dtype_name, shape, backward, work, times, ceilings, variant, causal, **extra) -> dict:
    """One result row of attention over ``shape`` = (b, h, s, d): TFLOP/s against the dtype's GEMM ceiling."""
    b, h, s, d = shape
    value, cname = ceil.for_unit(ceilings, "TFLOP/s", dtype_name)
    return result_row(
        "flash_attention",
        FAMILY,
        dtype=dtype_name,
        shape=f"{b}x{h}x{s}x{d}",
        pass_="fwd+bwd" if backward else "fwd",
        size=s,
        size_label="sequence length",
        unit="TFLOP/s",
        work=work,
        times=times,
        ceiling=value,
        ceiling_name=cname,
        variant=variant,
        batch=b,
        heads=h,
        seqlen=s,
        head_dim=d,
        causal=causal,
        **extra,
    )


def run(request: Request) -> list[dict]:
    """``megakernels bench --ops flash_attention`` (``common.Request``: head dims and sequence lengths default to
    64,128 and this device's lengths; a quick run one small shape)."""
    head_dims, seqlens = (
        ([64], [128]) if request.quick else ([64, 128], GPU_SEQLENS if request.device == "cuda" else CPU_SEQLENS)
    )
    return measure(
        request.dtypes_or(default_dtypes(request.device)),
        list(request.head_dims or head_dims),
        list(request.seqlens or seqlens),
        device=request.device,
        min_run_time=request.min_run_time,
        ceilings=request.ceilings,
        peers=request.peers,
        log=request.log,
    )
