"""From a compiled kernel's loops to the per-element (streaming) or per-iteration (tiled MMA) costs of the model.

Streaming kernels walk a row (or a chunk) in packs: each thread takes a pack of ``pack`` elements per step, one
vector load of each streamed tensor. A kernel states its hot loops as *roles* in program order — the vector loads
(streamed tensors, and parameters that every row re-reads from L1) and vector stores one pack costs in that loop.
Each innermost SASS loop is matched to a role by those counts; the ratio is how many packs the compiler unrolled
into one iteration (a remainder loop, if any, handles the rest). What a kernel does once per row (reductions,
statistics, the row's setup) is the enclosing loop's own code, spread over the row's elements. A role that
matches no loop is an error, never a guess.
"""

from __future__ import annotations

import dataclasses
import math

from costmodel import model
from costmodel.compiled import Compiled

VECTOR_BYTES = 8  # accesses at least this wide are pack accesses; narrower ones are scalar traffic
PARAM_BYTES = 16  # width of one parameter vector load


@dataclasses.dataclass(frozen=True)
class Role:
    name: str
    loads: int  # vector loads of streamed tensors per pack
    params: int = 0  # vector loads of parameters per pack
    stores: int = 0  # vector stores per pack
    reads_dram: bool = False  # this loop's loads come from DRAM (they set the bytes in flight)
    coverage: float = 1.0  # fraction of the row's packs this loop visits (a causal prefix: about half)
    min_width: int = VECTOR_BYTES  # narrowest access that counts as one of the pack's loads/stores

    @property
    def vector_loads(self) -> int:
        return self.loads + self.params


@dataclasses.dataclass
class Matched:
    role: Role
    loop: object
    unroll: int
    remainder: object | None = None


def _unroll(role: Role, loop) -> int:
    c = loop.counts
    vl, vs = c.vector_loads(role.min_width), c.vector_stores(role.min_width)
    if role.stores == 0:
        return vl // role.vector_loads if vs == 0 and vl and vl % role.vector_loads == 0 else 0
    if vs and vs % role.stores == 0 and vl == vs // role.stores * role.vector_loads:
        return vs // role.stores
    return 0


def match_roles(c: Compiled, roles: list[Role]) -> list[Matched]:
    """Each role's main loop (the most unrolled match) and remainder loop, matching innermost loops with vector
    accesses in address order to the roles in program order.

    Raises:
        ValueError: a role without a loop (the kernel changed shape: update its roles)."""
    loops = [lp for lp in c.fn.innermost_loops() if lp.counts.vector_loads(1) or lp.counts.vector_stores(1)]
    found: list[list] = [[] for _ in roles]
    i = 0
    for lp in loops:
        for j in range(i, len(roles)):
            u = _unroll(roles[j], lp)
            if u:
                found[j].append((u, lp))
                i = j
                break
    out = []
    for role, hits in zip(roles, found):
        if not hits:
            raise ValueError(
                f"{c.symbol}: no loop matches role {role.name!r} ({role.vector_loads} vector loads, "
                f"{role.stores} stores per pack); loops: "
                + ", ".join(f"{dict(lp.counts.global_loads)}L/{dict(lp.counts.global_stores)}S" for lp in loops)
            )
        u, main = max(hits, key=lambda h: h[0])
        rem = next((lp for v, lp in hits if v == 1), None) if u > 1 else None
        out.append(Matched(role, main, u, rem))
    return out


def stream_cost(
    c: Compiled,
    roles: list[Role],
    pack: int,
    packs_per_thread: float,
    dram_bytes: float,
    min_bytes: float,
    grid_blocks: int,
    m: model.Machine = model.H200,
) -> tuple[model.StreamCost, dict]:
    """Per-element costs of a streaming kernel whose threads each handle ``packs_per_thread`` packs of ``pack``
    elements per row (or per unit of work: a chunk, a grid-stride sweep), launched as ``grid_blocks`` blocks."""
    matched = match_roles(c, roles)
    p = max(packs_per_thread, 1e-9)
    instr = mufu = l2 = 0.0
    in_flight = 0.0
    dram_role = next((mt.role for mt in matched if mt.role.reads_dram), matched[0].role)
    for mt in matched:
        body = mt.loop.counts
        pr = p * mt.role.coverage
        if mt.remainder is not None:
            main_it, rem_it = pr // mt.unroll, pr % mt.unroll
            rem = mt.remainder.counts
        else:
            main_it, rem_it, rem = pr / mt.unroll, 0, None
        instr += main_it * body.instructions + (rem_it * rem.instructions if rem else 0)
        mufu += main_it * body.mufu + (rem_it * rem.mufu if rem else 0)
        param_bytes = mt.role.params * PARAM_BYTES * mt.unroll
        l2 += main_it * (body.load_bytes() + body.store_bytes() - param_bytes)
        if rem:
            l2 += rem_it * (rem.load_bytes() + rem.store_bytes() - mt.role.params * PARAM_BYTES)
        if mt.role is dram_role:
            per_thread = (body.load_bytes() - param_bytes) * min(1.0, pr / mt.unroll)
            in_flight = per_thread
    outer = c.fn.enclosing(matched[0].loop)
    overhead = outer.counts if outer is not None else None
    if overhead is not None:
        instr += overhead.instructions
        mufu += overhead.mufu
        l2 += overhead.load_bytes() + overhead.store_bytes()
    elems = p * pack
    blocks = model.blocks_per_sm(m, c.threads, c.registers, c.shared_bytes, math.ceil(grid_blocks / m.sms))
    warps = blocks * math.ceil(c.threads / 32)
    cost = model.StreamCost(
        instructions=instr / elems,
        mufu=mufu / elems,
        l2_bytes=l2 / elems,
        dram_bytes=dram_bytes,
        min_bytes=min_bytes,
        in_flight_per_sm=in_flight * 32 * warps,
        warps_per_sm=warps,
        sm_fraction=min(1.0, grid_blocks / m.sms),
    )
    details = {
        "loops": {
            mt.role.name: {
                "instructions": mt.loop.counts.instructions,
                "unroll": mt.unroll,
                "elements": mt.unroll * pack,
                "mufu": mt.loop.counts.mufu,
                "branches": mt.loop.counts.branches,
            }
            for mt in matched
        },
        "row_overhead_instructions": overhead.instructions if overhead is not None else 0,
        "blocks_per_sm": blocks,
    }
    return cost, details


def mma_loops(c: Compiled, roles: list[str]) -> dict:
    """The loops whose own code holds tensor-core instructions, in address order, named by ``roles`` (a loop may
    hold inner loops that only spin on an mbarrier).

    Raises:
        ValueError: the number of such loops differs from the number of roles."""
    loops = [lp for lp in c.fn.loops if lp.counts.mma]
    if len(loops) != len(roles):
        raise ValueError(f"{c.symbol}: {len(loops)} MMA loops, expected {len(roles)} ({', '.join(roles)})")
    return dict(zip(roles, loops))


def tile_iteration(c: Compiled, loop, warps: int, l2_bytes: float, tma_bytes: float = 0.0) -> model.TileIteration:
    """One CTA-iteration of an MMA loop: its SASS counts (per warp), scaled to the CTA where the model needs it.
    ``tma_bytes``: what the loop's TMA copies move between shared memory and global memory per iteration (the
    schedule's bytes: a copy's size is in its descriptor, not the SASS), counted when the SASS issues TMA."""
    k = loop.counts
    overlap = sum(c.fn.waits_after_mma(loop))
    # cp.async fills and LDS/STS are counted from the SASS per warp.
    fills = tma_bytes if k.tma else 0.0
    wgmma_ops = tuple((f, b, n * warps / 4) for (f, b), n in sorted(k.wgmma_shapes.items()))
    fp8_ops = tuple((f, b, n * warps / 4) for (f, b), n in sorted(k.fp8_shapes.items()))
    return model.TileIteration(
        warps=warps,
        instructions=k.instructions - k.mma,
        mufu=k.mufu,
        mma_flops=k.mma_flops * warps,
        wgmma=k.wgmma > 0,
        overlap_instr=overlap,
        mma_sync_flops=k.mma_sync_flops * warps,
        l2_bytes=l2_bytes,
        shared_bytes=k.shared_bytes * warps + fills,
        wgmma_ops=wgmma_ops,
        mma_fp8_flops=k.mma_fp8_flops * warps,
        fp8_ops=fp8_ops,
    )
