"""The memory-bound kernels in the static report: norms, bias-GeLU, softmax (CUDA C++), cross-entropy (Triton) and
the optimizer kernels (CUDA C++), in bf16 and fp32 at hidden / row lengths 1k to 16k (32M elements), the
cross-entropy at 16384 x 50304 and 8192 x 131072, AdamW over 100M parameters.

A ``Part`` is one launch: which compiled kernel (a CUDA family's template instantiation by demangled name, or a
Triton launch), how the launcher shapes it (threads, blocks, packs per thread per row: the launch plan of the
.cu file, mirrored by ``plan_rows``), its hot loops (``analysis.Role``) and the bytes it must move. An entry is
one pass (forward or backward) of one or more parts; its prediction is the sum of its parts' times.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from megakernels_models.bench.static import analysis, compiled, model
from megakernels_models.bench.static.analysis import Role
from megakernels_models.bench.static.registry import Entry, register

DTYPES = {"bf16": ("__nv_bfloat16", 2), "fp32": ("float", 4)}
BENCH_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
M = model.H200


def row_shapes() -> list[tuple[int, int]]:
    """(rows, hidden) of the norms / bias-GeLU: `megakernels bench`'s GPU shapes, and hidden 16k."""
    from megakernels_models.bench.norms import GPU_SHAPES

    return list(GPU_SHAPES) + [(2048, 16384)]


@dataclasses.dataclass
class Part:
    kernel: Callable[[], compiled.Compiled]   # compiles (cached) on first call
    roles: list
    pack: int                 # elements per pack of the streamed tensor
    packs_per_thread: float   # per row (or unit of work)
    grid: int
    elements: float           # elements of the whole launch (the unit the costs are per)
    dram_bytes: float         # per element, that must cross DRAM
    min_bytes: float          # per element, the op's minimum
    name: str = ""
    launches: int = 1         # launches the launcher splits this work into


def plan_rows(rows: int, packs: int, blocks_per_sm: int) -> tuple[int, int, int]:
    """(group threads, block threads, grid) as csrc/common/cuda_kernels.cuh's plan_rows: a warp per row up to 8
    packs per lane, else a block of 64..1024 threads with ~8 packs each; the grid capped per SM."""
    if packs <= 32 * 8:
        group, block = 32, 128
    else:
        threads = (packs // 8 + 31) // 32 * 32
        group = block = min(max(threads, 64), 1024)
    needed = -(-rows // (block // group))
    return group, block, max(1, min(needed, M.sms * blocks_per_sm))


def evaluate(parts: list[Part]) -> dict:
    """The JSON fields of a pass: the first part's resources and loops, every part's time, the pass's fraction of
    the copy bandwidth for its minimum bytes."""
    rows, total, min_bytes = [], 0.0, 0.0
    for p in parts:
        c = p.kernel()
        cost, details = analysis.stream_cost(c, p.roles, p.pack, p.packs_per_thread, p.dram_bytes, p.min_bytes,
                                             p.grid)
        pred = model.predict_stream(cost, p.elements, p.launches)
        total += pred["time_s"]
        min_bytes += p.min_bytes * p.elements
        rows.append((p, c, cost, details, pred))
    p, c, cost, details, pred = rows[0]
    launches = [{"kernel": q.name or cc.symbol, **cc.resources(), "blocks_per_sm": d["blocks_per_sm"],
                 "instructions_per_element": round(k.instructions, 2), "mufu_per_element": round(k.mufu, 3),
                 "l2_bytes_per_element": round(k.l2_bytes, 2), "in_flight_kib_per_sm": round(k.in_flight_per_sm / 1024, 1),
                 "predicted_time_us": pr["time_s"] * 1e6, "bound": pr["bound"], "loops": d["loops"],
                 "row_overhead_instructions": d["row_overhead_instructions"]}
                for q, cc, k, d, pr in rows]
    return {**c.resources(), "kernel": c.symbol, "elements": p.elements, "blocks_per_sm": details["blocks_per_sm"],
            "instructions_per_element": round(cost.instructions, 2), "mufu_per_element": round(cost.mufu, 3),
            "bytes_per_element": round(cost.l2_bytes, 2), "min_bytes_per_element": p.min_bytes,
            "in_flight_kib_per_sm": round(cost.in_flight_per_sm / 1024, 1), "bound": pred["bound"],
            "hot_loop_branches": sum(v["branches"] for v in details["loops"].values()),
            "predicted_time_us": total * 1e6, "predicted_fraction": min_bytes / total / M.dram_copy,
            "launches": launches}


def cuda(family: str, pattern: str, threads: int) -> Callable[[], compiled.Compiled]:
    return lambda: compiled.cuda_kernel(family, pattern, threads)


def _entry(name, family, config, shape, dtype, parts_fn) -> Entry:
    op, passname = name.split(".")
    bench = {"op": op, "pass": passname, "shape": shape, "dtype": BENCH_DTYPES[dtype], "variant": ""}
    return Entry(name, config, shape, dtype, lambda: evaluate(parts_fn()), family=family, bench=bench)


# ---- norms -----------------------------------------------------------------------------------------------------

def _norm_parts(op: str, passname: str, dtype: str, rows: int, hidden: int) -> list[Part]:
    t, size = DTYPES[dtype]
    pack = 16 // size
    packs = hidden // pack
    rms = op == "rms_norm"
    wp = 1  # parameter vector loads per pack (w dtype == x dtype)
    n = rows * hidden
    if passname == "fwd":
        group, block, grid = plan_rows(rows, packs, 16)
        kern = cuda("norms", f"norm_fwd_kernel<{t}, {t}, {pack}, {'true' if rms else 'false'}>", block)
        roles = [Role("stats", 1, reads_dram=True), Role("normalise", 1, params=2 * wp, stores=1)]
        return [Part(kern, roles, pack, math.ceil(packs / group), grid, n, 2 * size, 2 * size)]
    group, block, grid = plan_rows(rows, packs, 2)
    kern = cuda("norms", f"norm_bwd_kernel<{t}, {t}, {pack}, {'true' if rms else 'false'}>", block)
    roles = [Role("reduce", 2, params=2 * wp, reads_dram=True), Role("dx", 2, params=2 * wp, stores=1)]
    workers = grid * (block // group)
    col = [Part(cuda("norms", f"column_sum_kernel<{t}, float>", 256), [Role("sum", 1, min_width=4)], 1, workers,
                -(-hidden // 256), workers * hidden, 4, 0, name="column_sum") for _ in range(2)]
    return [Part(kern, roles, pack, math.ceil(packs / group), grid, n, 3 * size, 3 * size)] + col


def _bias_gelu_parts(passname: str, dtype: str, rows: int, hidden: int) -> list[Part]:
    t, size = DTYPES[dtype]
    pack = 16 // size
    n = rows * hidden
    if passname == "fwd":
        packs = n // pack
        grid = min(-(-packs // 256), M.sms * 32)
        kern = cuda("bias_gelu", f"bias_gelu_fwd_kernel<{t}, {t}, {pack}>", 256)
        return [Part(kern, [Role("gelu", 1, params=1, stores=1, reads_dram=True)], pack, packs / (grid * 256), grid,
                     n, 2 * size, 2 * size)]
    packs = hidden // pack
    group, block, grid = plan_rows(rows, packs, 2)
    kern = cuda("bias_gelu", f"bias_gelu_bwd_kernel<{t}, {t}, {pack}>", block)
    workers = grid * (block // group)
    col = Part(cuda("bias_gelu", f"column_sum_kernel<{t}, float>", 256), [Role("sum", 1, min_width=4)], 1, workers,
               -(-hidden // 256), workers * hidden, 4, 0, name="column_sum")
    return [Part(kern, [Role("dgelu", 2, params=1, stores=1, reads_dram=True)], pack, math.ceil(packs / group),
                 grid, n, 3 * size, 3 * size), col]


@register
def norm_entries() -> list[Entry]:
    out = []
    for op in ("layer_norm", "layer_norm_gelu", "rms_norm"):
        for passname in ("fwd", "bwd"):
            for dtype in DTYPES:
                for rows, hidden in row_shapes():
                    out.append(_entry(f"{op}.{passname}", "norms", "row plan", f"{rows}x{hidden}", dtype,
                                      lambda op=op, p=passname, d=dtype, r=rows, h=hidden: _norm_parts(op, p, d, r, h)))
    for passname in ("fwd", "bwd"):
        for dtype in DTYPES:
            for rows, hidden in row_shapes():
                out.append(_entry(f"bias_gelu.{passname}", "bias_gelu", "tanh", f"{rows}x{hidden}", dtype,
                                  lambda p=passname, d=dtype, r=rows, h=hidden: _bias_gelu_parts(p, d, r, h)))
    return out


# ---- softmax ---------------------------------------------------------------------------------------------------

def _causal_coverage(sq: int, sk: int) -> float:
    """Fraction of a [sq, sk] causal (bottom-right aligned) score matrix that is kept."""
    return sum(max(0, min(sk, i + sk - sq + 1)) for i in range(sq)) / (sq * sk)


def _softmax_parts(kind: str, passname: str, dtype: str, shape) -> list[Part]:
    t, size = DTYPES[dtype]
    pack = 16 // size
    b, h, sq, sk = shape
    rows = b * h * sq
    packs = sk // pack
    group, block, grid = plan_rows(rows, packs, 16)
    n = rows * sk
    causal = kind == "causal"
    kept = _causal_coverage(sq, sk) if causal else 1.0
    if passname == "fwd":
        mask = {"plain": "softmax::MaskKind)0", "masked": "softmax::MaskKind)1", "causal": "softmax::MaskKind)2"}[kind]
        kern = cuda("softmax", f"softmax_fwd_kernel<{t}, {pack}, (megakernels::{mask}>", block)
        extra = 1 if kind == "masked" and pack >= 8 else 0  # the mask pack (one byte per element) is a vector load
        roles = [Role("max_sum", 1 + extra, reads_dram=True, coverage=kept),
                 Role("write", 1 + extra, stores=1, coverage=kept)]
        mbytes = (kept + 1) * size + (1 if kind == "masked" else 0)
        return [Part(kern, roles, pack, math.ceil(packs / group), grid, n, mbytes, mbytes)]
    kern = cuda("softmax", f"softmax_bwd_kernel<{t}, {pack}, {'true' if causal else 'false'}>", block)
    roles = [Role("dot", 2, reads_dram=True, coverage=kept), Role("dx", 2, stores=1, coverage=kept)]
    mbytes = (2 * kept + 1) * size
    return [Part(kern, roles, pack, math.ceil(packs / group), grid, n, mbytes, mbytes)]


@register
def softmax_entries() -> list[Entry]:
    from megakernels_models.bench.softmax import GPU_SHAPES

    out = []
    for kind, op in (("plain", "scaled_softmax"), ("masked", "scaled_masked_softmax"),
                     ("causal", "scaled_causal_softmax")):
        for passname in ("fwd", "bwd"):
            if kind == "masked" and passname == "bwd":
                continue  # the masked backward is the plain one
            for dtype in DTYPES:
                for shape in GPU_SHAPES:
                    out.append(_entry(f"{op}.{passname}", "softmax", "row plan", "x".join(map(str, shape)), dtype,
                                      lambda k=kind, p=passname, d=dtype, s=shape: _softmax_parts(k, p, d, s)))
    return out


# ---- cross-entropy (Triton) ------------------------------------------------------------------------------------

def _ce_parts(passname: str, n: int, v: int) -> list[Part]:
    from megakernels.triton import cross_entropy as ce

    x = torch.empty(n, v, dtype=torch.bfloat16, device="meta")
    tgt = torch.empty(n, dtype=torch.int64, device="meta")
    f32 = torch.empty(n, 4, dtype=torch.float32, device="meta")
    if passname == "fwd":
        launch = ce.stats_launch(x, tgt, f32, 0, v, 90)
        roles = [Role("stats", 1, reads_dram=True)]
        mbytes = 2
    else:
        launch = ce.grad_launch(x, tgt, f32, f32, 0, v, -100, 0.9, 0.1 / v, x, 90)
        roles = [Role("grad", 1, stores=1, reads_dram=True)]
        mbytes = 4
    block = launch.kwargs["BLOCK_V"]
    threads = launch.num_warps * 32
    packs = -(-v // block) * block / threads / 8
    return [Part(lambda: compiled.triton_kernel(launch), roles, 8, packs, n, n * v, mbytes, mbytes)]


@register
def cross_entropy_entries() -> list[Entry]:
    from megakernels_models.bench.cross_entropy import GPU_SHAPES as CE_SHAPES

    return [_entry(f"cross_entropy.{p}", "cross_entropy", "row per program", f"{n}x{v}", "bf16",
                   lambda p=p, n=n, v=v: _ce_parts(p, n, v))
            for n, v in CE_SHAPES for p in ("fwd", "bwd")]


# ---- optimizer -------------------------------------------------------------------------------------------------

PARAMS, PARAMS_CONFIG = 100_000_000, "1x100M"  # megakernels bench's adamw config of one 100M tensor
CHUNK = 65536
CHUNKS_PER_LAUNCH = 256


def _optim_parts(kernel: str, dtype: str) -> list[Part]:
    t, size = DTYPES[dtype]
    chunks = -(-PARAMS // CHUNK)
    grid, launches = min(chunks, CHUNKS_PER_LAUNCH), -(-chunks // CHUNKS_PER_LAUNCH)
    if kernel == "adamw":
        if dtype == "fp32":
            kern = cuda("optim/adamw_cuda.cu", "adamw_kernel<float, float, false>", 256)
            roles = [Role("update", 4, stores=3, reads_dram=True)]
        else:  # master fp32 copy; nvcc splits the master and 16-bit param stores into scalars (2 vector stores)
            kern = cuda("optim/adamw_cuda.cu", f"adamw_kernel<{t}, float, true>", 256)
            roles = [Role("update", 4, stores=2, reads_dram=True)]
        return [Part(kern, roles, 4, CHUNK / 4 / 256, grid, PARAMS, 28, 28, launches=launches)]
    name = {"nonfinite": "nonfinite_kernel", "sumsq": "sumsq_kernel"}[kernel]
    kern = cuda("optim/adamw_cuda.cu", f"{name}<{t}>", 256)
    return [Part(kern, [Role("read", 1, reads_dram=True, min_width=1)], 1, CHUNK / 256, grid, PARAMS, size, size,
                 launches=launches)]


@register
def optim_entries() -> list[Entry]:
    out = []
    for kernel, name in (("adamw", "adamw.update"), ("nonfinite", "adamw.nonfinite_check"), ("sumsq", "adamw.l2norm")):
        for dtype in DTYPES:
            cfg = f"{CHUNK // 1024}Ki x{CHUNKS_PER_LAUNCH}/launch"
            out.append(_entry(name, "optim", cfg, PARAMS_CONFIG, dtype,
                              lambda k=kernel, d=dtype: _optim_parts(k, d)))
    return out
