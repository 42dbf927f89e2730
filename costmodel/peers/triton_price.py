"""Triton launches priced from their IR and SASS: loop trip counts from the IR's ``scf.for`` bounds at the
launch's arguments, bytes through L2 and DRAM, the streaming model's time."""

from __future__ import annotations

import math
import re

from costmodel import model

# ---- pricing ---------------------------------------------------------------------------------------------------

_FOR = re.compile(r"scf\.for\s+%[\w.]+\s*=\s*(%[\w.]+)\s+to\s+(%[\w.]+)\s+step\s+(%[\w.]+)")
_DEF = re.compile(r"^\s*(%[\w.#]+)(?::\d+)?\s*=\s*([\w.]+)\s*(.*)$")
_ARITH = {
    "arith.addi": lambda a, b: a + b,
    "arith.subi": lambda a, b: a - b,
    "arith.muli": lambda a, b: a * b,
    "arith.divsi": lambda a, b: int(a / b),
    "arith.divui": lambda a, b: a // b,
    "arith.remsi": lambda a, b: a - b * int(a / b),
    "arith.minsi": min,
    "arith.maxsi": max,
    "arith.minui": min,
    "arith.maxui": max,
}


_ELEMENT = {"f64": 8, "i64": 8, "f32": 4, "i32": 4, "bf16": 2, "f16": 2, "i16": 2, "i8": 1, "i1": 1}


def _access_bytes(line: str) -> int:
    """Bytes one ``tt.load`` / ``tt.store`` line of TTIR moves: its pointer tile's elements x element size."""
    m = re.search(r":\s*tensor<([\dx]+)x!tt\.ptr<(\w+)>>", line)
    if m:
        return math.prod(int(d) for d in m.group(1).split("x")) * _ELEMENT.get(m.group(2), 4)
    m = re.search(r":\s*!tt\.ptr<(\w+)>", line)
    return _ELEMENT.get(m.group(1), 4) if m else 0


class IR:
    """What the pricing needs from a kernel's Triton IR (TTIR): its ``scf.for`` loops' trip counts and which
    pointer arguments it loads from and stores to."""

    def __init__(self, ttir: str, values: dict, contents: dict | None = None):
        self.contents = contents or {}  # argument name -> the integers its tensor holds (``Recorder.contents``)
        self.defs: dict[str, tuple[str, list[str], str]] = {}
        self.loops: list[tuple[str, str, str, int]] = []  # (lb, ub, step, depth)
        self.loop_bytes: list[int] = []  # per loop: the bytes its own loads and stores move in one iteration
        # every global access: (load / store / atomic..., its pointer, bytes per execution, the loops around it)
        self.accesses: list[tuple[str, str, int, list[int]]] = []
        self.values = values
        depth, open_loops = 0, []
        for line in ttir.splitlines():
            m = _FOR.search(line)
            if m:
                self.loops.append((*m.groups(), depth))
                self.loop_bytes.append(0)
                open_loops.append((len(self.loops) - 1, depth))
                for a, b in (
                    re.findall(r"(%[\w.]+)\s*=\s*(%[\w.]+)", line.split("iter_args", 1)[1])
                    if ("iter_args" in line)
                    else []
                ):
                    self.defs[a] = ("alias", [b], "")
            elif open_loops and re.search(r"\btt\.(load|store|atomic)", line):
                self.loop_bytes[open_loops[-1][0]] += _access_bytes(line)
            acc = re.search(r"\btt\.(load|store|atomic\w*)\s+(%[\w.#]+)", line)
            if acc and not m:
                self.accesses.append((acc.group(1), acc.group(2), _access_bytes(line), [i for i, _ in open_loops]))
            d = _DEF.match(line)
            if d and not m:
                self.defs[d.group(1)] = (d.group(2), re.findall(r"%[\w.#]+", d.group(3)), d.group(3))
            depth += line.count("{") - line.count("}")
            while open_loops and depth <= open_loops[-1][1]:
                open_loops.pop()
        self.loaded, self.stored = set(), set()
        for line in ttir.splitlines():
            for op, into in (("tt.load", self.loaded), ("tt.store", self.stored), ("tt.atomic", self.stored)):
                if re.search(rf"\b{op}", line):
                    ptr = re.findall(r"%[\w.#]+", line.split(op, 1)[1])
                    if ptr:
                        into.update(self._args(ptr[0], set()))

    def _args(self, v: str, seen: set) -> set:
        if v in seen:
            return set()
        seen.add(v)
        name = v[1:].split("#")[0]
        if name in self.values:
            return {name}
        if v not in self.defs:
            return set()
        op, operands, _ = self.defs[v]
        if op in ("arith.constant",):
            return set()
        out = set()
        for o in operands:
            out |= self._args(o, seen)
        return out

    def eval(self, v: str, pid: int | tuple = 0):
        """The integer value ``v`` holds in program ``pid`` (one index for every grid axis, or (x, y, z))."""
        name = v[1:].split("#")[0]
        if name in self.values and not hasattr(self.values[name], "shape"):
            return int(self.values[name])
        if v not in self.defs:
            raise ValueError(f"loop bound {v} is not a constant or an argument")
        op, operands, rest = self.defs[v]
        if op == "arith.constant":
            return int(re.match(r"\s*(-?\d+)", rest).group(1))
        if op == "tt.get_program_id":
            return pid if isinstance(pid, int) else pid["xyz".index(rest.split()[0])]
        if op in ("arith.extsi", "arith.extui", "arith.trunci", "arith.index_cast", "alias"):
            return self.eval(operands[0], pid)
        if op in _ARITH:
            return _ARITH[op](self.eval(operands[0], pid), self.eval(operands[1], pid))
        if op == "tt.load" and operands:  # a scalar read from a tensor whose contents a driver gave
            base, offset = operands[0], 0
            while base in self.defs and self.defs[base][0] == "tt.addptr":
                base, offset = self.defs[base][1][0], offset + self.eval(self.defs[base][1][1], pid)
            name = base[1:].split("#")[0]
            if name in self.contents:
                return int(self.contents[name][offset])
        raise ValueError(f"loop bound through {op}")

    def trips(self, pid: int | tuple = 0) -> list[tuple[int, int]]:
        """(trip count in program ``pid``, nesting depth) of each loop, in program order."""
        out = []
        for lb, ub, st, depth in self.loops:
            lo, hi, step = self.eval(lb, pid), self.eval(ub, pid), self.eval(st, pid)
            out.append((max(0, -(-(hi - lo) // step)), depth))
        return out

    def program_axes(self, values: list[str] | None = None) -> set[int]:
        """The grid axes (0 x, 1 y, 2 z) whose program index the loop bounds (or ``values``) depend on, through
        any arithmetic and loads (a tile index read from a tensor at a program-dependent place counts)."""
        axes, seen = set(), set()
        todo = list(values) if values is not None else [v for lp in self.loops for v in lp[:3]]
        while todo:
            v = todo.pop()
            if v in seen or v not in self.defs:
                continue
            seen.add(v)
            op, operands, rest = self.defs[v]
            if op == "tt.get_program_id":
                axes.add("xyz".index(rest.split()[0]))
            todo.extend(operands)
        return axes

    def base(self, ptr: str) -> str | None:
        """The pointer argument a tile of pointers ``ptr`` offsets (through addptr, splat, broadcast, reshapes and
        loop-carried aliases), or None."""
        seen = set()
        while ptr not in seen:
            seen.add(ptr)
            name = ptr[1:].split("#")[0]
            if name in self.values:
                return name
            if ptr not in self.defs or not self.defs[ptr][1]:
                return None
            op, operands, _ = self.defs[ptr]
            if op not in ("tt.addptr", "tt.splat", "tt.broadcast", "tt.expand_dims", "tt.reshape", "alias"):
                return None
            ptr = operands[0]
        return None


def sweep_rereads(ir: IR, nbytes: dict, grid: tuple, l2_bytes: float) -> tuple[float, list]:
    """DRAM bytes beyond each tensor's one read that a launch's re-reads across grid sweeps cost: (bytes, one
    (tensor, axis, reads, sweep bytes, hit share) per tensor that pays them).

    The block scheduler dispatches programs in launch order, axis x fastest (then y, z). A tensor whose accesses
    do not depend on program axis ``a`` (y or z; ``IR.program_axes`` of its pointers) is read again by the
    programs that differ only along ``a``, one full sweep of the faster axes apart: between two reads of the same
    bytes the launch touches every tensor's bytes that the faster axes index (a tensor's size over the extents of
    its axes at or above ``a``, at most what that many programs access). While that sweep fits in the L2 the
    re-reads hit; when it does not, the share of it the L2 holds (``l2_bytes`` / sweep: what an L2 that does not
    keep the oldest lines first retains; an LRU would keep none) hits and the rest of each re-read crosses DRAM.
    Re-reads along x (adjacent programs, running together) and within a program are L2 hits, as before."""
    g = [int(x) for x in grid] + [1] * (3 - len(grid))
    trips = [t for t, _ in ir.trips()]
    per: dict = {}  # tensor -> [bytes per program (program 0's trips), axes, loaded]
    for op, ptr, b, loops in ir.accesses:
        name = ir.base(ptr)
        if name not in nbytes:
            continue
        e = per.setdefault(name, [0.0, set(), False])
        e[0] += b * math.prod(trips[i] for i in loops)
        e[1] |= ir.program_axes([ptr])
        e[2] = e[2] or op == "load"
    extra, why = 0.0, []
    for name, (b, axes, loaded) in per.items():
        free = [a for a in range(3) if g[a] > 1 and a not in axes]
        if not loaded or not free or free[0] == 0:
            continue
        a = free[0]
        stride = math.prod(g[:a])
        sweep = sum(
            min(nbytes[y] / math.prod(g[c] for c in ax if c >= a), stride * by) for y, (by, ax, _) in per.items()
        )
        if sweep <= l2_bytes:
            continue
        reads = math.prod(g[c] for c in free if c >= a)
        size = min(nbytes[name], b * math.prod(g) / reads)  # the part of it the launch reads
        hit = l2_bytes / sweep
        extra += size * (reads - 1) * (1.0 - hit)
        why.append((name, "xyz"[a], reads, sweep, round(hit, 3)))
    return extra, why


def _program_counts(fn, trips: list[int]):
    """Per program, per warp: (the ``sass.Counts`` of the costliest path through the function, loads of one iteration
    of the first loop that loads, or of the whole program without one). The path is ``sass.Function.path_counts``':
    an early exit (an ignored row) is not added to the path it skips."""
    total, runs = fn.path_counts(trips)
    in_flight = total.load_bytes()
    for lp in fn.loops:
        if lp.counts.load_bytes() and runs[id(lp)]:
            in_flight = lp.counts.load_bytes()
            break
    return total, in_flight


_ANALYSED: dict = {}


def price_triton(launch, m: model.Machine) -> dict:
    """Time of one Triton launch on ``m``: compiled for its arch, read from SASS, priced by ``predict_stream``."""
    key = (id(launch), m.name)
    if key not in _ANALYSED:
        _ANALYSED[key] = (launch, analyse_triton(launch, m))
    cost, details = _ANALYSED[key][1]
    pred = model.predict_stream(cost, details["grid"], 1, m)
    if details.get("busiest_program_s", 0.0) > pred["time_s"]:  # unequal programs: the busiest one ends the launch
        return {**details, "bound": "tail", "time_s": details["busiest_program_s"], "times_s": pred["times_s"]}
    return {**details, "bound": pred["bound"], "time_s": pred["time_s"], "times_s": pred["times_s"]}


def spill_traffic(
    local: float, frame: float, shared: float, resident: int, programs: int, m: model.Machine
) -> tuple[float, float]:
    """(bytes to L2, bytes to DRAM) of a launch's ``local`` bytes through local memory (LDL/STL of spilled
    registers), each program's spill frame ``frame`` bytes (per thread x threads), ``resident`` programs per SM with
    ``shared`` bytes of shared memory each. Local memory is cached in L1: the share of the resident frames that fits
    in the L1 shared memory leaves hits there (the accesses then cost their issue slots only); the rest misses to
    L2, and of that the share beyond the L2's capacity (the frames of every busy SM together) to DRAM as well."""
    frames = frame * resident
    if not local or not frames:
        return 0.0, 0.0
    l1_miss = 1.0 - min(1.0, max(0.0, m.l1_bytes - shared * resident) / frames)
    l2_miss = 1.0 - min(1.0, m.l2_bytes / (frames * min(m.sms, math.ceil(programs / resident))))
    return local * l1_miss, local * l1_miss * l2_miss


def _program_shares(ir: IR, grid: tuple) -> list[tuple[tuple, int]] | None:
    """The programs of a launch on ``grid`` whose loop bounds depend on the program index: (program index (x, y,
    z), how many programs share its trips) for every index along the axes the bounds read (the others at 0); None
    when every program runs the same trips."""
    import itertools

    axes = ir.program_axes()
    if not axes:
        return None
    g = [int(x) for x in grid] + [1] * (3 - len(grid))
    ranges = [range(g[a]) if a in axes else range(1) for a in range(3)]
    n = math.prod(g[a] for a in range(3) if a not in axes)
    return [(pid, n) for pid in itertools.product(*ranges)]


def analyse_triton(launch, m: model.Machine) -> tuple:
    """(StreamCost per program, details) of one Triton launch compiled for ``m``."""
    import torch

    from costmodel import compiled
    from megakernels.triton.launch import compile_launch

    c = compiled.triton_kernel(launch, m.arch)
    ck = compile_launch(launch, m.arch)  # Triton's cache: the IR of the same compile
    values = dict(zip(launch.kernel.arg_names, launch.args))
    values.update({k: v for k, v in launch.kwargs.items() if k in launch.kernel.arg_names})
    ir = IR(ck.asm["ttir"], values, getattr(launch, "contents", None))
    n_loops = len(c.fn.loops)
    constant = [all(re.match(r"%c", x) for x in lp[:3]) for lp in ir.loops]

    def aligned(ir_trips):
        # the IR's loops matched to the SASS's: (trips, depth, bytes of one IR iteration) per SASS loop
        trips = [(t, d, b) for (t, d), b in zip(ir_trips, ir.loop_bytes)]
        if len(trips) != n_loops:
            # ptxas unrolls loops of known trip count away: drop the IR loops with constant bounds first
            var = [tdb for tdb, k in zip(trips, constant) if not k]
            if len(var) != n_loops and len({t for t, _, _ in trips}) == 1:
                var = [(trips[0][0], 0, 0)] * n_loops  # every loop of the IR runs the same count: so do the SASS's
            if len(var) != n_loops:
                raise ValueError(f"{launch.name}: {len(trips)} loops in the IR, {n_loops} in the SASS")
            trips = var
        return trips

    trips = aligned(ir.trips())
    warps = launch.num_warps
    # ptxas may unroll a loop of a small body u times (and peel the remainder): its SASS iteration then moves u
    # of the IR's iterations' bytes and runs trips / u times
    unroll = []
    for (_, _, ir_bytes), lp in zip(trips, c.fn.loops):
        sass_bytes = (lp.counts.load_bytes() + lp.counts.store_bytes()) * 32 * warps
        unroll.append(round(sass_bytes / ir_bytes) if ir_bytes and sass_bytes >= 1.5 * ir_bytes else 1)

    def program(trips):
        # one program's work (per warp) at these loop trips: the costliest path's counts, tensor-core clocks
        total, flight = _program_counts(c.fn, [t / u for (t, _, _), u in zip(trips, unroll)])
        mma = m.mma_clocks(total.mma_flops, total.mma_sync_flops, total.mma_fp8_flops, total.mma_tf32_flops)
        work = (total.instructions, total.mufu, total.load_bytes() + total.store_bytes(), total.local_bytes, mma)
        return work, flight

    programs = launch.num_ctas
    (instr, mufu, moved, local, mma), flight = program(trips)
    # Programs whose loop bounds a driver's contents set per program (``Recorder.contents``: the MoE's per-expert
    # token counts) do unequal work: each distinct program's trips are evaluated, the launch's work is their sum
    # (the per-program cost below is its mean), and its busiest program is priced as a launch of its own
    shares = _program_shares(ir, launch.grid) if getattr(launch, "contents", None) else None
    busiest = None
    if shares is not None:
        groups: dict = {}
        for pid, n in shares:
            t = tuple(aligned(ir.trips(pid)))
            groups[t] = groups.get(t, 0) + n
        works = [(t, n, *program(list(t))) for t, n in groups.items()]
        instr, mufu, moved, local, mma = (sum(n * w[i] for _, n, w, _ in works) / programs for i in range(5))
        flight = sum(n * f for _, n, _, f in works) / programs
        trips = [(sum(n * t[i][0] for t, n, _, _ in works) / programs, d, b) for i, (_, d, b) in enumerate(trips)]
        busiest = works
    mma_cycles = mma * warps
    resident = model.blocks_per_sm(m, c.threads, c.registers, c.shared_bytes, math.ceil(programs / m.sms))
    nbytes = {k: v.numel() * v.element_size() for k, v in values.items() if isinstance(v, torch.Tensor)}
    compulsory = sum(nbytes[k] for k in ir.loaded if k in nbytes) + sum(nbytes[k] for k in ir.stored if k in nbytes)
    l2_total = moved * 32 * warps * programs
    # Re-reads hit L2 while the data a program reuses stays there: one iteration of a single top-level loop (a
    # stream of rows), else everything the program loads (several passes over the same row). A loop's depth counts
    # the IR's enclosing braces (module, function), so the top level is the smallest depth.
    loaded = sum(nbytes[k] for k in ir.loaded if k in nbytes) / programs
    depths = [d for _, d, _ in trips]
    top = [t for t, d, _ in trips if d == min(depths)] if depths else []
    reuse = loaded / max(1, top[0]) if len(top) == 1 else loaded
    touched = reuse * min(programs, resident * m.sms)
    dram_total = compulsory if touched <= m.l2_bytes else max(compulsory, l2_total)
    # re-reads a grid sweep apart that the L2 cannot hold across the sweep (``sweep_rereads``)
    sweep_extra, sweep_why = sweep_rereads(ir, nbytes, launch.grid, m.l2_bytes)
    if touched <= m.l2_bytes and sweep_extra:
        dram_total = min(max(compulsory, l2_total), compulsory + sweep_extra)
    spilled = local * 32 * warps * programs
    to_l2, to_dram = spill_traffic(spilled, c.spill_bytes * c.threads, c.shared_bytes, resident, programs, m)
    l2_total += to_l2
    dram_total += to_dram
    cost = model.StreamCost(
        instructions=instr * 32 * warps,
        mufu=mufu * 32 * warps,
        l2_bytes=l2_total / programs,
        dram_bytes=dram_total / programs,
        min_bytes=compulsory / programs,
        in_flight_per_sm=flight * 32 * warps * resident,
        warps_per_sm=resident * warps,
        sm_fraction=min(1.0, programs / m.sms),
        mma_cycles=mma_cycles,
    )
    details = {}
    if busiest is not None:
        # the launch lasts at least as long as its busiest program would as a launch of its own (one program on
        # one SM, its loads alone in flight; its DRAM bytes its L2 bytes at the launch's DRAM share of them)
        def alone(work, flight):
            w_instr, w_mufu, w_moved, w_local, w_mma = work
            l2 = w_moved * 32 * warps + (w_local * 32 * warps * to_l2 / spilled if spilled else 0.0)
            one = model.StreamCost(
                instructions=w_instr * 32 * warps,
                mufu=w_mufu * 32 * warps,
                l2_bytes=l2,
                dram_bytes=l2 * dram_total / l2_total if l2_total else 0.0,
                min_bytes=0.0,
                in_flight_per_sm=flight * 32 * warps,
                warps_per_sm=warps,
                sm_fraction=1.0 / m.sms,
                mma_cycles=w_mma * warps,
            )
            return model.predict_stream(one, 1, 1, m)["time_s"]

        t, _, work, f = max(busiest, key=lambda w: alone(w[2], w[3]))
        details = {"busiest_program_s": alone(work, f), "busiest_loop_trips": [x for x, _, _ in t]}
    return cost, {
        "kernel": launch.name,
        "grid": programs,
        "warps": warps,
        "registers": c.registers,
        "spill_bytes": c.spill_bytes,
        "local_bytes": spilled,
        "blocks_per_sm": resident,
        "loop_trips": [t for t, _, _ in trips],
        "instructions_per_program": instr * warps,
        "dram_bytes": dram_total,
        "l2_bytes": l2_total,
        **({"sweep_rereads": sweep_why} if sweep_extra else {}),
        **details,
    }
