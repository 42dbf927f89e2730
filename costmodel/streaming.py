"""The memory-bound kernels in the static report: norms, bias-GeLU, softmax (CUDA C++), cross-entropy (Triton) and
the optimizer kernels (CUDA C++), in bf16 and fp32 at hidden / row lengths 1k to 16k (32M elements), the
cross-entropy at 16384 x 50304 and 8192 x 131072, AdamW over 100M parameters.

A ``Part`` is one launch: which compiled kernel (a CUDA family's template instantiation by demangled name, or a
Triton launch), how the launcher shapes it (threads, blocks, packs per thread per row: the launch plan of the
.cu file, mirrored by ``plan_rows``, ``rows_plan``, ``softmax_rows_plan`` and ``column_plan``, each compared with
the C++ by tests/costmodel/test_launch_drift.py), its hot loops (``analysis.Role``) and the bytes it must move. An
entry is one pass (forward or backward) of one or more parts; its prediction is the sum of its parts' times.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from costmodel import analysis, compiled, model
from costmodel.analysis import Role
from costmodel.registry import Entry, register

DTYPES = {"bf16": ("__nv_bfloat16", 2), "fp32": ("float", 4)}
BENCH_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
M = model.H200


def row_shapes() -> list[tuple[int, int]]:
    """(rows, hidden) of the norms / bias-GeLU: `megakernels bench`'s GPU shapes, and hidden 16k."""
    from megakernels.bench.norms import GPU_SHAPES

    return list(GPU_SHAPES) + [(2048, 16384)]


@dataclasses.dataclass
class Part:
    kernel: Callable[[], compiled.Compiled]  # compiles (cached) on first call
    roles: list
    pack: int  # elements per pack of the streamed tensor
    packs_per_thread: float  # per row (or unit of work)
    grid: int
    elements: float  # elements of the whole launch (the unit the costs are per)
    dram_bytes: float  # per element, that must cross DRAM
    min_bytes: float  # per element, the op's minimum
    name: str = ""
    launches: int = 1  # launches the launcher splits this work into


def plan_rows(
    rows: int, packs: int, blocks_per_sm: int, max_threads: int = 1024, sms: int = M.sms
) -> tuple[int, int, int]:
    """(group threads, block threads, grid) as csrc/common/cuda_kernels.cuh's plan_rows: a warp per row up to 8
    packs per lane, else a block of 64..``max_threads`` threads with ~8 packs each; the grid capped at
    ``blocks_per_sm`` per SM. A mirror of the C++: tests/costmodel/test_launch_drift.py compares the two."""
    if packs <= 32 * 8:
        group, block = 32, 128
    else:
        threads = (packs // 8 + 31) // 32 * 32
        group = block = min(max(threads, 64), max_threads)
    needed = -(-rows // (block // group))
    return group, block, max(1, min(needed, sms * blocks_per_sm))


def evaluate(parts: list[Part]) -> dict:
    """The JSON fields of a pass: the first part's resources and loops, every part's time, the pass's fraction of
    the copy bandwidth for its minimum bytes."""
    rows, total, min_bytes = [], 0.0, 0.0
    for p in parts:
        c = p.kernel()
        cost, details = analysis.stream_cost(c, p.roles, p.pack, p.packs_per_thread, p.dram_bytes, p.min_bytes, p.grid)
        pred = model.predict_stream(cost, p.elements, p.launches)
        total += pred["time_s"]
        min_bytes += p.min_bytes * p.elements
        rows.append((p, c, cost, details, pred))
    p, c, cost, details, pred = rows[0]
    launches = [
        {
            "kernel": q.name or cc.symbol,
            **cc.resources(),
            "blocks_per_sm": d["blocks_per_sm"],
            "instructions_per_element": round(k.instructions, 2),
            "mufu_per_element": round(k.mufu, 3),
            "l2_bytes_per_element": round(k.l2_bytes, 2),
            "in_flight_kib_per_sm": round(k.in_flight_per_sm / 1024, 1),
            "predicted_time_us": pr["time_s"] * 1e6,
            "bound": pr["bound"],
            "loops": d["loops"],
            "row_overhead_instructions": d["row_overhead_instructions"],
        }
        for q, cc, k, d, pr in rows
    ]
    return {
        **c.resources(),
        "kernel": c.symbol,
        "elements": p.elements,
        "blocks_per_sm": details["blocks_per_sm"],
        "instructions_per_element": round(cost.instructions, 2),
        "mufu_per_element": round(cost.mufu, 3),
        "bytes_per_element": round(cost.l2_bytes, 2),
        "min_bytes_per_element": p.min_bytes,
        "in_flight_kib_per_sm": round(cost.in_flight_per_sm / 1024, 1),
        "bound": pred["bound"],
        "hot_loop_branches": sum(v["branches"] for v in details["loops"].values()),
        "predicted_time_us": total * 1e6,
        "predicted_fraction": min_bytes / total / M.dram_copy,
        "launches": launches,
    }


def cuda(family: str, pattern: str, threads: int, arch: int = 90) -> Callable[[], compiled.Compiled]:
    return lambda: compiled.cuda_kernel(family, pattern, threads, arch)


def price_parts(parts: list[Part], m: model.Machine = M) -> list[dict]:
    """Each part's predicted time on ``m`` (its kernel compiled for ``m.arch`` by the part's builder): kernel
    name, ``time_s``, ``bound`` and the resource ``times_s``."""
    out = []
    for p in parts:
        c = p.kernel()
        cost, _ = analysis.stream_cost(c, p.roles, p.pack, p.packs_per_thread, p.dram_bytes, p.min_bytes, p.grid, m)
        pred = model.predict_stream(cost, p.elements, p.launches, m)
        out.append(
            {"kernel": p.name or c.symbol, "time_s": pred["time_s"], "bound": pred["bound"], "times_s": pred["times_s"]}
        )
    return out


def _entry(name, family, config, shape, dtype, parts_fn) -> Entry:
    op, passname = name.split(".")
    bench = {"op": op, "pass": passname, "shape": shape, "dtype": BENCH_DTYPES[dtype], "variant": ""}
    return Entry(name, config, shape, dtype, lambda: evaluate(parts_fn()), family=family, bench=bench)


# ---- norms -----------------------------------------------------------------------------------------------------


def rows_plan(
    rows: int, hidden: int, pack: int, packs_per_thread: int, accumulators: int, sms: int = M.sms, smem: int = M.smem
) -> tuple[int, int, int]:
    """(group threads, groups per block, grid) as csrc/norms/norms_rows.cuh's rows_plan: a row over G threads of
    ``packs_per_thread`` packs each, 256-thread blocks of row groups, resident blocks per SM for 2048 threads
    (forward) or 2 (backward), fewer where shared memory allows fewer. A mirror of the C++:
    tests/costmodel/test_launch_drift.py compares the two."""
    threads = -(-(hidden // pack) // packs_per_thread)
    group = -(-threads // 32) * 32
    groups = 1 if group >= 256 else 256 // group
    block = group * groups
    per_sm = 2 if accumulators else 2048 // block
    smem_per_sm, smem = smem, groups * accumulators * hidden * 4
    if smem:
        per_sm = min(per_sm, smem_per_sm // (smem + 2048))  # 228 KiB per SM, as norms_rows.cuh
    return group, groups, max(1, min(-(-rows // groups), sms * max(1, per_sm)))


ACTS = {"layer_norm": 0, "layer_norm_gelu": 1, "rms_norm": 0}


def column_sum_part(family: str, t: str, parts: int, cols: int, arch: int = 90) -> Part:
    """csrc/common/cuda_kernels.cuh's column_sum_kernel over [parts, cols] fp32 partials (float4 columns): 32
    column packs x 32 part-lanes per 1024-thread block. Its bytes are extra to the op's minimum."""
    kern = cuda(family, f"column_sum_kernel<{t}, float, 4>", 1024, arch)
    return Part(
        kern, [Role("sum", 1, reads_dram=True)], 4, parts / 32, -(-cols // 128), parts * cols, 4, 0, name="column_sum"
    )


def _norm_parts(op: str, passname: str, dtype: str, rows: int, hidden: int, m: model.Machine = M) -> list[Part]:
    """The row-resident kernels (the path of aligned rows up to 16k elements with their parameters), launched on
    ``m`` (its SM count and shared memory shape the plan; compiled for its arch)."""
    t, size = DTYPES[dtype]
    pack = 16 // size
    ppt = 32 // pack  # 32 elements per thread
    rms = op == "rms_norm"
    act = f"(megakernels::Activation){ACTS[op]}"
    n = rows * hidden
    k = 1 if rms else 2
    if passname == "fwd":
        group, groups, grid = rows_plan(rows, hidden, pack, ppt, 0, m.sms, m.smem)
        kern = cuda(
            "norms",
            f"norm_fwd_rows_kernel<{t}, {t}, {pack}, {ppt}, {act}, {'true' if rms else 'false'}>",
            group * groups,
            m.arch,
        )
        roles = [Role("row", 1, params=k, stores=1, reads_dram=True)]
        return [Part(kern, roles, pack, ppt, grid, n, 2 * size, 2 * size)]
    acc = k + (1 if size == 4 else 0)  # fp32: dz row in smem
    group, groups, grid = rows_plan(rows, hidden, pack, ppt, acc, m.sms, m.smem)
    kern = cuda(
        "norms",
        f"norm_bwd_rows_kernel<{t}, {t}, {pack}, {ppt}, {act}, {'true' if rms else 'false'}>",
        group * groups,
        m.arch,
    )
    if size == 2:  # one fully unrolled row pass: x and dy; w twice (dz * w, then dx), b for the activation
        roles = [Role("row", 2, params=2 + (1 if ACTS[op] else 0), stores=1, reads_dram=True)]
    else:  # fp32: a reduce loop and a dx loop (two packs per iteration each), x re-read in the second
        roles = [
            Role("reduce", 2, params=1 + (1 if ACTS[op] else 0), reads_dram=True),
            Role("dx", 1, params=1, stores=1),
        ]
    col = column_sum_part("norms", t, grid, k * hidden, m.arch)
    return [Part(kern, roles, pack, ppt, grid, n, 3 * size, 3 * size), col]


def column_plan(rows: int, packs: int, sms: int = M.sms) -> tuple[int, int, int, int]:
    """(threads along the row, threads along rows, grid x, grid y) as csrc/bias_gelu/bias_gelu_cuda.cu's
    column_plan: 256-thread blocks, ~4 resident blocks per SM, rows walked beyond that. A mirror of the C++:
    tests/costmodel/test_launch_drift.py compares the two."""
    tx = 256 if packs >= 256 else -(-packs // 32) * 32
    ty = 256 // tx
    gx = -(-packs // tx)
    gy = max(1, min(-(-(sms * 4) // gx), -(-rows // ty)))
    return tx, ty, gx, gy


def _bias_gelu_parts(passname: str, dtype: str, rows: int, hidden: int) -> list[Part]:
    """The column-tiled kernels (tanh GeLU, Megatron's default), each thread walking rows of its column pack."""
    t, size = DTYPES[dtype]
    pack = 16 // size
    n = rows * hidden
    tx, ty, gx, gy = column_plan(rows, hidden // pack)
    walkers = gy * ty
    grid = gx * gy
    if passname == "fwd":
        kern = cuda("bias_gelu", f"bias_gelu_fwd_kernel<{t}, {t}, {pack}, (megakernels::Activation)2>", tx * ty)
        return [
            Part(kern, [Role("gelu", 1, stores=1, reads_dram=True)], pack, rows / walkers, grid, n, 2 * size, 2 * size)
        ]
    kern = cuda("bias_gelu", f"bias_gelu_bwd_kernel<{t}, {t}, {pack}, (megakernels::Activation)2>", tx * ty)
    return [
        Part(kern, [Role("dgelu", 2, stores=1, reads_dram=True)], pack, rows / walkers, grid, n, 3 * size, 3 * size),
        column_sum_part("bias_gelu", t, walkers, hidden),
    ]


@register
def norm_entries() -> list[Entry]:
    out = []
    for op in ("layer_norm", "layer_norm_gelu", "rms_norm"):
        for passname in ("fwd", "bwd"):
            for dtype in DTYPES:
                for rows, hidden in row_shapes():
                    out.append(
                        _entry(
                            f"{op}.{passname}",
                            "norms",
                            "row plan",
                            f"{rows}x{hidden}",
                            dtype,
                            lambda op=op, p=passname, d=dtype, r=rows, h=hidden: _norm_parts(op, p, d, r, h),
                        )
                    )
    for passname in ("fwd", "bwd"):
        for dtype in DTYPES:
            for rows, hidden in row_shapes():
                out.append(
                    _entry(
                        f"bias_gelu.{passname}",
                        "bias_gelu",
                        "tanh",
                        f"{rows}x{hidden}",
                        dtype,
                        lambda p=passname, d=dtype, r=rows, h=hidden: _bias_gelu_parts(p, d, r, h),
                    )
                )
    return out


# ---- softmax ---------------------------------------------------------------------------------------------------


def _causal_coverage(sq: int, sk: int) -> float:
    """Fraction of a [sq, sk] causal (bottom-right aligned) score matrix that is kept."""
    return sum(max(0, min(sk, i + sk - sq + 1)) for i in range(sq)) / (sq * sk)


# The causal kernels load a pack that straddles the diagonal as its 8-byte words before it (load_raw_prefix), a
# path one pack per row takes: only the 16-byte loads are the pack's loads (the prefix's instructions still count).
CAUSAL_WIDTH = 16


def softmax_rows_plan(rows: int, sk: int, sms: int = M.sms) -> tuple[int, int, int]:
    """(group threads, block threads, grid) as csrc/softmax/softmax_rows.cuh's softmax_rows_plan: 32 elements a
    thread, rows over whole warps, 256-thread blocks of row groups, 2048 threads an SM. A mirror of the C++:
    tests/costmodel/test_launch_drift.py compares the two."""
    threads = -(-sk // 32)  # kRowElems elements a thread
    group = -(-threads // 32) * 32
    block = group * (1 if group >= 256 else 256 // group)
    return group, block, max(1, min(-(-rows // (block // group)), sms * (2048 // block)))


def _softmax_parts(kind: str, passname: str, dtype: str, shape) -> list[Part]:
    """The row-resident kernels (rows up to 16k elements; the 64k shape takes the looping kernels)."""
    t, size = DTYPES[dtype]
    pack = 16 // size
    b, h, sq, sk = shape
    rows = b * h * sq
    n = rows * sk
    causal = kind == "causal"
    kept = _causal_coverage(sq, sk) if causal else 1.0
    if sk > 16384:
        return _softmax_loop_parts(kind, passname, dtype, shape)
    group, block, grid = softmax_rows_plan(rows, sk)
    ppt = 32 // pack
    if passname == "fwd":
        mask = {"plain": "softmax::MaskKind)0", "masked": "softmax::MaskKind)1", "causal": "softmax::MaskKind)2"}[kind]
        kern = cuda("softmax", f"softmax_fwd_rows_kernel<{t}, {pack}, (megakernels::{mask}>", block)
        loads = 1 + (1 if kind == "masked" else 0)  # the mask word of a pack: 8 bytes (bf16) / 4 (fp32)
        roles = [
            Role(
                "row",
                loads,
                stores=1,
                reads_dram=True,
                min_width=4 if kind == "masked" else CAUSAL_WIDTH if causal else 8,
            )
        ]
        mbytes = (kept + 1) * size + (1 if kind == "masked" else 0)
        return [Part(kern, roles, pack, ppt, grid, n, mbytes, mbytes)]
    kern = cuda("softmax", f"softmax_bwd_rows_kernel<{t}, {pack}, {'true' if causal else 'false'}>", block)
    mbytes = (2 * kept + 1) * size
    return [
        Part(
            kern,
            [Role("row", 2, stores=1, reads_dram=True, min_width=CAUSAL_WIDTH if causal else 8)],
            pack,
            ppt,
            grid,
            n,
            mbytes,
            mbytes,
        )
    ]


def _softmax_loop_parts(kind: str, passname: str, dtype: str, shape) -> list[Part]:
    t, size = DTYPES[dtype]
    pack = 16 // size
    b, h, sq, sk = shape
    rows = b * h * sq
    packs = sk // pack
    group, block, grid = plan_rows(rows, packs, 16, 512)  # kMaxLoopThreads of softmax_cuda.cu
    n = rows * sk
    causal = kind == "causal"
    kept = _causal_coverage(sq, sk) if causal else 1.0
    if passname == "fwd":
        mask = {"plain": "softmax::MaskKind)0", "masked": "softmax::MaskKind)1", "causal": "softmax::MaskKind)2"}[kind]
        kern = cuda("softmax", f"softmax_fwd_kernel<{t}, {pack}, (megakernels::{mask}>", block)
        extra = 1 if kind == "masked" and pack >= 8 else 0  # the mask pack (one byte per element) is a vector load
        w = CAUSAL_WIDTH if causal else 8
        roles = [
            Role("max_sum", 1 + extra, reads_dram=True, coverage=kept, min_width=w),
            Role("write", 1 + extra, stores=1, coverage=kept, min_width=w),
        ]
        mbytes = (kept + 1) * size + (1 if kind == "masked" else 0)
        return [Part(kern, roles, pack, math.ceil(packs / group), grid, n, mbytes, mbytes)]
    kern = cuda("softmax", f"softmax_bwd_kernel<{t}, {pack}, {'true' if causal else 'false'}>", block)
    w = CAUSAL_WIDTH if causal else 8
    roles = [
        Role("dot", 2, reads_dram=True, coverage=kept, min_width=w),
        Role("dx", 2, stores=1, coverage=kept, min_width=w),
    ]
    mbytes = (2 * kept + 1) * size
    return [Part(kern, roles, pack, math.ceil(packs / group), grid, n, mbytes, mbytes)]


@register
def softmax_entries() -> list[Entry]:
    from megakernels.bench.softmax import GPU_SHAPES

    out = []
    for kind, op in (
        ("plain", "scaled_softmax"),
        ("masked", "scaled_masked_softmax"),
        ("causal", "scaled_causal_softmax"),
    ):
        for passname in ("fwd", "bwd"):
            if kind == "masked" and passname == "bwd":
                continue  # the masked backward is the plain one
            for dtype in DTYPES:
                for shape in GPU_SHAPES:
                    out.append(
                        _entry(
                            f"{op}.{passname}",
                            "softmax",
                            "row plan",
                            "x".join(map(str, shape)),
                            dtype,
                            lambda k=kind, p=passname, d=dtype, s=shape: _softmax_parts(k, p, d, s),
                        )
                    )
    return out


# ---- cross-entropy (Triton) ------------------------------------------------------------------------------------


def _ce_parts(
    passname: str, n: int, v: int, m: model.Machine = M, dtype: str = "bf16", softcap: float = 0.0
) -> list[Part]:
    from megakernels.triton import cross_entropy as ce

    size = DTYPES[dtype][1]
    pack = 16 // size
    x = torch.empty(n, v, dtype=getattr(torch, BENCH_DTYPES[dtype]), device="meta")
    tgt = torch.empty(n, dtype=torch.int64, device="meta")
    f32 = torch.empty(n, 4, dtype=torch.float32, device="meta")
    if passname == "fwd":
        launch = ce.stats_launch(x, tgt, f32, 0, v, m.arch, softcap)
        roles = [Role("stats", 1, reads_dram=True)]
        mbytes = size
    else:
        launch = ce.grad_launch(x, tgt, f32, f32, 0, v, -100, 1.0, 0.0, x, m.arch, softcap)  # no label smoothing
        roles = [Role("grad", 1, stores=1, reads_dram=True)]
        mbytes = 2 * size
    threads = launch.num_warps * 32
    packs = v / threads / pack  # the tail chunk runs the masked loop, not modelled apart
    return [Part(lambda: compiled.triton_kernel(launch, m.arch), roles, pack, packs, n, n * v, mbytes, mbytes)]


@register
def cross_entropy_entries() -> list[Entry]:
    from megakernels.bench.cross_entropy import GPU_SHAPES as CE_SHAPES

    return [
        _entry(
            f"cross_entropy.{p}",
            "cross_entropy",
            "row per program",
            f"{n}x{v}",
            "bf16",
            lambda p=p, n=n, v=v: _ce_parts(p, n, v),
        )
        for n, v in CE_SHAPES
        for p in ("fwd", "bwd")
    ]


# ---- optimizer -------------------------------------------------------------------------------------------------

PARAMS, PARAMS_CONFIG = 100_000_000, "1x100M"  # megakernels bench's adamw config of one 100M tensor
# csrc/optim: kDefaultChunk (optim.h) and kBlock (adamw_cuda.cu), one block of kBlock threads per chunk
# (tests/costmodel/test_launch_drift.py reads them from the sources)
CHUNK, OPTIM_BLOCK = 65536, 256


def _optim_parts(kernel: str, dtype: str) -> list[Part]:
    """One launch per table of tensors, every chunk of them (no cap on the grid); packs of 4 elements."""
    t, size = DTYPES[dtype]
    grid = -(-PARAMS // CHUNK)
    if kernel == "adamw":
        if dtype == "fp32":
            kern = cuda("optim/adamw_cuda.cu", "adamw_kernel<float, float, float, false>", OPTIM_BLOCK)
            roles = [Role("update", 4, stores=3, reads_dram=True)]
        else:  # fp32 master weights and moments: master, grad, m, v read; m, v, master, param written (16-bit
            # grads, as FusedAdamW(master_weights=True) steps a model; the trainer's fp32 grads read 2 bytes more)
            kern = cuda("optim/adamw_cuda.cu", f"adamw_kernel<{t}, {t}, float, true>", OPTIM_BLOCK)
            roles = [Role("update", 4, stores=4, reads_dram=True)]
        return [Part(kern, roles, 4, CHUNK / 4 / OPTIM_BLOCK, grid, PARAMS, 28, 28)]
    name = {"nonfinite": "nonfinite_kernel", "sumsq": "sumsq_kernel"}[kernel]
    kern = cuda("optim/adamw_cuda.cu", f"{name}<{t}>", OPTIM_BLOCK)
    return [
        Part(
            kern, [Role("read", 1, reads_dram=True, min_width=8)], 4, CHUNK / 4 / OPTIM_BLOCK, grid, PARAMS, size, size
        )
    ]


@register
def optim_entries() -> list[Entry]:
    out = []
    for kernel, name in (("adamw", "adamw.update"), ("nonfinite", "adamw.nonfinite_check"), ("sumsq", "adamw.l2norm")):
        for dtype in DTYPES:
            cfg = f"{CHUNK // 1024}Ki chunks"
            out.append(_entry(name, "optim", cfg, PARAMS_CONFIG, dtype, lambda k=kernel, d=dtype: _optim_parts(k, d)))
    return out
