"""Elementwise kernels of the transformer layer in the static report.

- SwiGLU forward and backward (csrc/swiglu) at LLaMA-sized rows (16k tokens x 11008 and x 4096 features), bf16
  and fp32. The looping kernel of csrc/swiglu walks each row in 16-byte packs: per pack the forward reads a gate
  and an up pack and writes one; the backward reads those and dy and writes two.
- RoPE (csrc/rope), q and k in one launch, angles from theta (no cos/sin table), half-rotated layout: LLaMA-3 8B
  (32 q heads, 8 k heads, d 128) and LLaMA-2 7B (32 and 32) at 16k tokens. A lane owns one 16-byte pack of each
  half of a head row; its (cos, sin) are computed once per work item (a token and a slice of heads) and applied
  to every head of the slice, the hot loop (two heads per iteration). The forward and the inverse (backward) are
  the same kernel.

The MoE kernels are not in the report yet.
"""

from __future__ import annotations

import math

from costmodel import model
from costmodel.analysis import Role
from costmodel.registry import Entry, register
from costmodel.streaming import DTYPES, M, Part, _entry, cuda, plan_rows

SWIGLU_SHAPES = [(16384, 11008), (16384, 4096)]  # (rows, f): x is [rows, 2f]


def _swiglu_parts(passname: str, dtype: str, rows: int, f: int, m: model.Machine = M) -> list[Part]:
    t, size = DTYPES[dtype]
    pack = 16 // size
    packs = f // pack
    group, block, grid = plan_rows(rows, packs, 16, sms=m.sms)
    n = rows * f
    if passname == "fwd":
        kern = cuda("swiglu", f"swiglu_fwd_kernel<{t}, {pack}, (megakernels::swiglu::Act)0>", block, m.arch)
        return [
            Part(
                kern,
                [Role("swiglu", 2, stores=1, reads_dram=True)],
                pack,
                math.ceil(packs / group),
                grid,
                n,
                3 * size,
                3 * size,
            )
        ]
    kern = cuda("swiglu", f"swiglu_bwd_kernel<{t}, {pack}, (megakernels::swiglu::Act)0>", block, m.arch)
    return [
        Part(
            kern,
            [Role("dswiglu", 3, stores=2, reads_dram=True)],
            pack,
            math.ceil(packs / group),
            grid,
            n,
            5 * size,
            5 * size,
        )
    ]


@register
def swiglu_entries() -> list[Entry]:
    return [
        _entry(
            f"swiglu.{p}",
            "swiglu",
            "row plan",
            f"{rows}x{f}",
            dtype,
            lambda p=p, d=dtype, r=rows, f=f: _swiglu_parts(p, d, r, f),
        )
        for p in ("fwd", "bwd")
        for dtype in DTYPES
        for rows, f in SWIGLU_SHAPES
    ]


ROPE_SHAPES = [(16384, 32, 8, 128), (16384, 32, 32, 128)]  # (tokens, q heads, k heads, head dim)


def _rope_parts(dtype: str, tokens: int, hq: int, hk: int, d: int, m: model.Machine = M) -> list[Part]:
    """As csrc/rope/rope_cuda.cu's launch: 256-thread blocks of ``lanes`` (= packs per half row) lane groups,
    heads split into slices only as far as needed to fill the GPU, the grid capped at 8 blocks per SM."""
    t, size = DTYPES[dtype]
    pack = 16 // size
    lanes = min((d // 2) // pack, 256)
    slots = 256 // lanes
    want, have = m.sms * 2048, tokens * lanes * 2
    splits = 1 if have >= want else -(-want // have)
    hps = max(1, -(-max(hq, hk) // splits))
    slices = -(-hq // hps) + -(-hk // hps)
    grid = min(-(-tokens * slices // slots), m.sms * 8)
    kern = cuda("rope", f"rope_kernel<{t}, false, {pack}, true>", lanes * slots, m.arch)
    # A "pack" of the role is one rotation: a 16-byte pack from each half of the head row (2 * pack elements).
    per_lane = (hq + hk) / slices * ((d // 2) / pack / lanes)
    n = tokens * (hq + hk) * d
    return [Part(kern, [Role("rotate", 2, stores=2, reads_dram=True)], 2 * pack, per_lane, grid, n, 2 * size, 2 * size)]


@register
def rope_entries() -> list[Entry]:
    return [
        _entry(
            "rope.fwd",
            "rope",
            "theta, half",
            f"{tokens}x{hq}+{hk}x{d}",
            dtype,
            lambda d_=dtype, s=(tokens, hq, hk, d): _rope_parts(d_, *s),
        )
        for dtype in DTYPES
        for tokens, hq, hk, d in ROPE_SHAPES
    ]
