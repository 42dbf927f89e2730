"""Elementwise kernels of the MLP in the static report: SwiGLU forward and backward (csrc/swiglu) at LLaMA-sized
rows (16k tokens x 11008 and x 4096 features), bf16 and fp32. The looping kernel of csrc/swiglu walks each row in
16-byte packs: per pack the forward reads a gate and an up pack and writes one; the backward reads those and dy
and writes two.

RoPE (csrc/rope) and the MoE kernels are not in the report yet.
"""

from __future__ import annotations

import math

from megakernels_models.bench.static.analysis import Role
from megakernels_models.bench.static.registry import Entry, register
from megakernels_models.bench.static.streaming import DTYPES, Part, _entry, cuda, plan_rows

SWIGLU_SHAPES = [(16384, 11008), (16384, 4096)]  # (rows, f): x is [rows, 2f]


def _swiglu_parts(passname: str, dtype: str, rows: int, f: int) -> list[Part]:
    t, size = DTYPES[dtype]
    pack = 16 // size
    packs = f // pack
    group, block, grid = plan_rows(rows, packs, 16)
    n = rows * f
    if passname == "fwd":
        kern = cuda("swiglu", f"swiglu_fwd_kernel<{t}, {pack}>", block)
        return [Part(kern, [Role("swiglu", 2, stores=1, reads_dram=True)], pack, math.ceil(packs / group), grid, n,
                     3 * size, 3 * size)]
    kern = cuda("swiglu", f"swiglu_bwd_kernel<{t}, {pack}>", block)
    return [Part(kern, [Role("dswiglu", 3, stores=2, reads_dram=True)], pack, math.ceil(packs / group), grid, n,
                 5 * size, 5 * size)]


@register
def swiglu_entries() -> list[Entry]:
    return [_entry(f"swiglu.{p}", "swiglu", "row plan", f"{rows}x{f}", dtype,
                   lambda p=p, d=dtype, r=rows, f=f: _swiglu_parts(p, d, r, f))
            for p in ("fwd", "bwd") for dtype in DTYPES for rows, f in SWIGLU_SHAPES]
