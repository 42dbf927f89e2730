"""Reading compiled GPU code without a GPU: resource usage and SASS of a cubin, and the loops of a kernel.

``cuobjdump`` (from the CUDA toolkit, or the copy Triton ships) prints each function's SASS with addresses and its
resource usage (registers, stack frame, static shared memory). From the SASS this module builds the control-flow
graph (basic blocks; ``BRA`` edges; a ``CALL.REL.NOINC`` to code that never returns is a jump, ptxas's way out of
a loop; other ``CALL``s and ``BRA.DIV`` lead to out-of-line slow paths and get no edge), finds
the natural loops (back edges to a dominating header), and counts per loop what a cost model needs: instructions
issued per iteration, MUFU operations, tensor-core instructions and their shapes, global accesses by width,
barriers, waits on wgmma, TMA copies.

Counting rules (costmodel/README.md): every block of a loop body counts once per iteration, except *cold*
blocks (those that call an out-of-line subroutine: the IEEE-division and square-root slow paths), and blocks of
inner loops, which belong to the inner loop. NOPs are not counted. A body with internal branches is therefore
counted as if every branch were taken (an upper bound); ``branches`` reports how many there are.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Za-z0-9_.]*)\s*([^;]*);")
_TARGET = re.compile(r"0x([0-9a-f]+)")
_RES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


@dataclasses.dataclass
class Instr:
    addr: int
    pred: str  # "" or the guard, e.g. "@!P0"
    op: str  # full opcode with modifiers, e.g. "LDG.E.128"
    operands: str

    @property
    def base(self) -> str:
        return self.op.split(".", 1)[0]


@dataclasses.dataclass
class Resources:
    registers: int
    stack_bytes: int  # local-memory stack frame: spills (and arrays not kept in registers)
    static_shared: int
    local_bytes: int


@dataclasses.dataclass
class Counts:
    """What one pass over some instructions issues (per thread / per warp: SASS is per warp)."""

    instructions: int = 0
    mufu: int = 0
    mufu_ops: dict = dataclasses.field(default_factory=dict)
    mma: int = 0  # HGMMA / QGMMA (wgmma: 16-bit and tf32 / FP8) + HMMA (mma.sync) instructions
    wgmma: int = 0
    mma_flops: float = 0.0  # FLOPs of the tensor-core instructions, per warp (wgmma: per warpgroup / 4)
    mma_sync_flops: float = 0.0  # the part of mma_flops issued by HMMA (mma.sync)
    mma_fp8_flops: float = 0.0  # the part of mma_flops issued by QGMMA (FP8 wgmma, twice the 16-bit rate)
    global_loads: dict = dataclasses.field(default_factory=dict)  # width in bytes -> count (cp.async included)
    global_stores: dict = dataclasses.field(default_factory=dict)
    async_copies: int = 0  # LDGSTS (cp.async)
    async_copy_bytes: int = 0
    tma: int = 0  # UTMALDG / UTMASTG / UBLKCP (bulk tensor copies)
    atomics: int = 0
    barriers: int = 0  # BAR.SYNC / BAR.RED
    wgmma_waits: int = 0  # WARPGROUP.DEPBAR (waits for wgmma results)
    shuffles: int = 0
    branches: int = 0  # conditional branches other than the loop's own back edge
    shared_bytes: float = 0.0  # per warp: bytes through shared memory (LDS/STS/LDSM/STSM, cp.async fills, and
    # a quarter of each wgmma's shared-memory operands)
    wgmma_shapes: dict = dataclasses.field(default_factory=dict)  # (FLOPs, shared bytes) of one warpgroup wgmma
    # -> instructions (per warp)
    fp8_shapes: dict = dataclasses.field(default_factory=dict)  # the same of the FP8 wgmmas (QGMMA)
    local_bytes: float = 0.0  # per thread: bytes through local memory (LDL / STL: spilled registers)
    mma_tf32_flops: float = 0.0  # the part of mma_flops on tf32 operands (half the 16-bit rate)

    def add(self, ins: Instr) -> None:
        if ins.base == "NOP":
            return
        self.instructions += 1
        b, op = ins.base, ins.op
        if b == "MUFU":
            self.mufu += 1
            sub = op.split(".")[1] if "." in op else "?"
            self.mufu_ops[sub] = self.mufu_ops.get(sub, 0) + 1
        elif b in WGMMA_OPS:
            self.mma += 1
            self.wgmma += 1
            m = re.search(r"(\d+)x(\d+)x(\d+)", op)
            if m:  # one wgmma is a warpgroup's M x N x K; per warp a quarter of it
                flops = 2 * int(m[1]) * int(m[2]) * int(m[3])
                self.mma_flops += flops / 4
                if ".TF32" in op:
                    self.mma_tf32_flops += flops / 4
                read = wgmma_shared_bytes(ins, int(m[1]), int(m[2]), int(m[3]))
                self.shared_bytes += read / 4
                shapes = self.wgmma_shapes
                if b == "QGMMA":
                    self.mma_fp8_flops += flops / 4
                    shapes = self.fp8_shapes
                shapes[(flops, read)] = shapes.get((flops, read), 0) + 1
        elif b == "HMMA":
            self.mma += 1
            shape = op.split(".")[1] if "." in op else ""
            if shape.startswith("168") and shape[3:].isdigit():  # HMMA.16816: m16 n8 k16 per warp
                self.mma_flops += 2 * 16 * 8 * int(shape[3:])
                self.mma_sync_flops += 2 * 16 * 8 * int(shape[3:])
                if ".TF32" in op:
                    self.mma_tf32_flops += 2 * 16 * 8 * int(shape[3:])
        elif b == "LDG":
            w = access_width(op)
            self.global_loads[w] = self.global_loads.get(w, 0) + 1
        elif b == "STG":
            w = access_width(op)
            self.global_stores[w] = self.global_stores.get(w, 0) + 1
        elif b == "LDGSTS":  # a global load that lands in shared memory (cp.async)
            self.async_copies += 1
            self.async_copy_bytes += access_width(op)
            self.shared_bytes += 32 * access_width(op) if ins.pred != "@!PT" else 0
            w = access_width(op)
            self.global_loads[w] = self.global_loads.get(w, 0) + 1
        elif b in ("UTMALDG", "UTMASTG", "UBLKCP", "UTMAREDG"):
            self.tma += 1
        elif b in ("RED", "ATOMG", "ATOM", "REDG"):
            self.atomics += 1
            w = access_width(op)
            self.global_stores[w] = self.global_stores.get(w, 0) + 1
        elif b in ("LDL", "STL"):
            self.local_bytes += access_width(op)
        elif b == "BAR":
            self.barriers += 1
        elif op.startswith("WARPGROUP.DEPBAR"):
            self.wgmma_waits += 1
        elif b == "SHFL":
            self.shuffles += 1
        elif b in ("LDS", "STS", "LDSM", "STSM") and ins.pred != "@!PT":  # @!PT: a placeholder that never runs
            self.shared_bytes += 32 * shared_width(op)
        if b == "BRA" and ins.pred and not op.startswith("BRA.DIV"):
            self.branches += 1

    def merge(self, other: Counts) -> None:
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, dict):
                for k, v in b.items():
                    a[k] = a.get(k, 0) + v
            else:
                setattr(self, f.name, a + b)

    def load_bytes(self) -> int:
        return sum(w * n for w, n in self.global_loads.items())

    def store_bytes(self) -> int:
        return sum(w * n for w, n in self.global_stores.items())

    def vector_loads(self, min_width: int = 8) -> int:
        return sum(n for w, n in self.global_loads.items() if w >= min_width)

    def vector_stores(self, min_width: int = 8) -> int:
        return sum(n for w, n in self.global_stores.items() if w >= min_width)


# wgmma in SASS: HGMMA (16-bit and tf32 operands), QGMMA (FP8: e4m3 / e5m2, at twice the 16-bit rate on sm_90)
WGMMA_OPS = ("HGMMA", "QGMMA")


def access_width(op: str) -> int:
    """Bytes per thread of a global access from its opcode modifiers (LDG.E.128 -> 16; no size modifier -> 4)."""
    mods = op.split(".")[1:]
    for m, w in (("128", 16), ("64", 8), ("U16", 2), ("S16", 2), ("U8", 1), ("S8", 1), ("16", 2)):
        if m in mods:
            return w
    return 4


def shared_width(op: str) -> int:
    """Bytes per thread of a shared-memory access: LDS/STS by their size modifier (as ``access_width``);
    LDSM/STSM move 1, 2 or 4 8x8 matrices of 16-bit elements per warp (``.4`` -> 16 B a thread)."""
    b, mods = op.split(".", 1)[0], op.split(".")[1:]
    if b in ("LDSM", "STSM"):
        n = int(mods[-1]) if mods and mods[-1] in ("1", "2", "4") else 1
        return 4 * n
    return access_width(op)


_ELEMENT_BYTES = {"BF16": 2, "F16": 2, "TF32": 4, "E4M3": 1, "E5M2": 1, "S8": 1, "U8": 1}


def wgmma_shared_bytes(ins: Instr, m: int, n: int, k: int) -> int:
    """Bytes one warpgroup wgmma (HGMMA, QGMMA) reads from shared memory: B (K x N) always, A (M x K) too when it comes
    from a descriptor (``R.., gdesc[..], ..``: the SS form) rather than registers (``R.., R.., gdesc[..]``: RS).
    Each operand counts once per instruction (the model's assumption: the four warps' tensor cores share one read
    of B)."""
    size = next((_ELEMENT_BYTES[t] for t in reversed(ins.op.split(".")) if t in _ELEMENT_BYTES), 2)
    operands = [o.strip() for o in ins.operands.split(",")]
    a_shared = len(operands) > 1 and operands[1].startswith("gdesc")
    return (k * n + (m * k if a_shared else 0)) * size


@dataclasses.dataclass
class Block:
    start: int  # index into Function.instrs
    end: int  # exclusive
    succ: list = dataclasses.field(default_factory=list)
    cold: bool = False


@dataclasses.dataclass
class Loop:
    header: int  # block index
    blocks: set  # block indices of the whole natural loop (inner loops included)
    own: set = dataclasses.field(default_factory=set)  # blocks not inside an inner loop
    inner: list = dataclasses.field(default_factory=list)
    counts: Counts = dataclasses.field(default_factory=Counts)  # one iteration of this loop's own blocks
    addr: int = 0

    @property
    def innermost(self) -> bool:
        return not self.inner


@dataclasses.dataclass
class Function:
    name: str
    instrs: list
    resources: Resources | None = None

    @functools.cached_property
    def totals(self) -> Counts:
        c = Counts()
        for ins in self.instrs:
            c.add(ins)
        return c

    @functools.cached_property
    def blocks(self) -> list:
        return _basic_blocks(self.instrs)

    @functools.cached_property
    def loops(self) -> list:
        """Natural loops in address order, each with its own blocks' counts (inner loops excluded)."""
        return _natural_loops(self.instrs, self.blocks)

    def innermost_loops(self) -> list:
        return [lp for lp in self.loops if lp.innermost]

    def enclosing(self, loop: Loop) -> Loop | None:
        """The smallest loop that strictly contains ``loop``."""
        outer = [lp for lp in self.loops if lp is not loop and loop.blocks < lp.blocks]
        return min(outer, key=lambda lp: len(lp.blocks)) if outer else None

    def path_counts(self, trips: list) -> tuple[Counts, dict]:
        """What one thread's run issues along the function's costliest path, with each loop's counts
        (``Loop.counts``) times its ``trips`` (per loop, in ``loops`` order; an inner loop's trips are per
        iteration of its outer loop, and may be fractional). Each loop is collapsed to one node of the
        control-flow graph; of the paths from the entry the one with the most global bytes (then instructions) is
        taken: the alternatives of a branch (an early exit for an ignored row) are not both executed. Blocks no
        path reaches (out-of-line subroutines) and cold blocks count nothing. Returns the counts and each loop's
        number of runs (``id(loop)`` -> its trips x its enclosing loops' trips)."""
        runs: dict = {}
        for lp, t in zip(self.loops, trips):
            outer = self.enclosing(lp)
            runs[id(lp)] = t * (runs.get(id(outer), 1) if outer is not None else 1)
        node = {k: ("b", k) for k in range(len(self.blocks))}
        weight: dict = {}
        for j, lp in enumerate(lp for lp in self.loops if self.enclosing(lp) is None):
            c = Counts()
            for inner in [lp, *lp.inner]:
                c.merge(_scaled(inner.counts, runs[id(inner)]))
            weight[("l", j)] = c
            for b in lp.blocks:
                node[b] = ("l", j)
        for k, b in enumerate(self.blocks):
            if node[k] == ("b", k):
                weight[node[k]] = c = Counts()
                for ins in self.instrs[b.start : b.end] if not b.cold else ():
                    c.add(ins)
        succ: dict = {v: set() for v in weight}
        for k, b in enumerate(self.blocks):
            succ[node[k]].update(node[t] for t in b.succ if node[t] != node[k])
        order, state = [], {}

        def visit(v):  # depth-first post order from the entry; a cycle left after collapsing loops is refused
            state[v] = 1
            for w in succ[v]:
                if state.get(w) == 1:
                    raise ValueError(f"{self.name}: a cycle outside the natural loops")
                if w not in state:
                    visit(w)
            state[v] = 2
            order.append(v)

        visit(node[0])

        def cost(c: Counts) -> tuple:
            return (c.load_bytes() + c.store_bytes(), c.instructions)

        best: dict = {}
        for v in order:  # successors first: best[v] = the costliest path from v
            best[v] = Counts()
            best[v].merge(weight[v])
            if succ[v]:
                best[v].merge(max((best[w] for w in succ[v]), key=cost))
        return best[node[0]], runs

    def waits_after_mma(self, loop: Loop) -> list:
        """For each committed group of wgmmas in the loop: the instructions this warp issues between the commit
        and the wait that retires it (``WARPGROUP.DEPBAR.LE gsb0, N`` retires all but the newest N groups),
        following the loop around its back edge. 0: the wgmma is waited on at once and nothing overlaps it."""
        seq = [
            ins
            for bi in sorted(loop.blocks)
            if not self.blocks[bi].cold
            for ins in self.instrs[self.blocks[bi].start : self.blocks[bi].end]
        ]
        out, open_groups = [], []
        for lap in (0, 1):
            for ins in seq:
                if ins.base in WGMMA_OPS:
                    if "gsb0" in ins.operands:  # the group's last wgmma commits it
                        open_groups.append([0, lap])
                    continue
                if ins.op.startswith("WARPGROUP.DEPBAR"):
                    m = _TARGET.findall(ins.operands)
                    keep = int(m[-1], 16) if m else 0
                    done, open_groups = (
                        open_groups[: max(0, len(open_groups) - keep)],
                        open_groups[max(0, len(open_groups) - keep) :],
                    )
                    out += [n for n, when in done if when == 1 or lap == 1]
                elif ins.base not in ("NOP", "WARPGROUP"):
                    for g in open_groups:
                        g[0] += 1
            if lap == 0:
                out = []
                open_groups = [[n, 1] for n, _ in open_groups]  # carried across the back edge
        return out


def _subroutine_at(instrs: list, i: int) -> bool:
    """Whether the code from ``instrs[i]`` on returns (``RET``) before it exits: an out-of-line subroutine."""
    for ins in instrs[i:]:
        if ins.base == "RET":
            return True
        if ins.base == "EXIT" and not ins.pred:
            return False
    return False


def _jump_calls(instrs: list, index: dict) -> set:
    """Indices of ``CALL.REL.NOINC`` instructions that are jumps, not calls: ptxas leaves a loop through one (its
    target is the code after the loop, which never returns), where a slow path's call targets a subroutine."""
    out = set()
    for i, ins in enumerate(instrs):
        if ins.base == "CALL" and "NOINC" in ins.op.split("."):
            t = _branch_target(ins)
            if t is not None and t in index and not _subroutine_at(instrs, index[t]):
                out.add(i)
    return out


def _scaled(c: Counts, n: float) -> Counts:
    """``n`` times ``c``, field by field (dict fields key by key)."""
    out = Counts()
    for f in dataclasses.fields(Counts):
        v = getattr(c, f.name)
        setattr(out, f.name, {k: n * x for k, x in v.items()} if isinstance(v, dict) else n * v)
    return out


def _basic_blocks(instrs: list) -> list:
    index = {ins.addr: i for i, ins in enumerate(instrs)}
    jumps = _jump_calls(instrs, index)
    leaders = {0}
    for i, ins in enumerate(instrs):
        if i in jumps:
            leaders.add(i + 1)
            leaders.add(index[_branch_target(ins)])
        elif ins.base in ("BRA", "EXIT", "RET", "BRX", "JMP") or ins.op.startswith("BRA"):
            if i + 1 < len(instrs):
                leaders.add(i + 1)
            t = _branch_target(ins)
            if t is not None and t in index and not ins.op.startswith("BRA.DIV"):
                leaders.add(index[t])
    starts = sorted(leaders)
    blocks = [Block(s, e) for s, e in zip(starts, starts[1:] + [len(instrs)])]
    first = {b.start: k for k, b in enumerate(blocks)}
    for k, b in enumerate(blocks):
        last = instrs[b.end - 1]
        unconditional_exit = last.base in ("EXIT", "RET") and not last.pred
        if b.end - 1 in jumps:
            b.succ.append(first[index[_branch_target(last)]])
            if last.pred and k + 1 < len(blocks):
                b.succ.append(k + 1)
        elif last.base == "BRA" and not last.op.startswith("BRA.DIV"):
            t = _branch_target(last)
            if t is not None and t in index:
                b.succ.append(first[index[t]])
            if last.pred and k + 1 < len(blocks):
                b.succ.append(k + 1)
        elif not unconditional_exit and k + 1 < len(blocks):
            b.succ.append(k + 1)
        b.cold = any(ins.base == "CALL" and j not in jumps for j, ins in enumerate(instrs[b.start : b.end], b.start))
    return blocks


def _branch_target(ins: Instr) -> int | None:
    m = _TARGET.findall(ins.operands)
    return int(m[-1], 16) if m else None


def _dominators(blocks: list) -> list:
    n = len(blocks)
    preds = [[] for _ in range(n)]
    for k, b in enumerate(blocks):
        for s in b.succ:
            preds[s].append(k)
    reach, stack = {0}, [0]
    while stack:
        for s in blocks[stack.pop()].succ:
            if s not in reach:
                reach.add(s)
                stack.append(s)
    dom = [set(reach) if k in reach else set() for k in range(n)]
    dom[0] = {0}
    changed = True
    while changed:
        changed = False
        for k in sorted(reach - {0}):
            ps = [dom[p] for p in preds[k] if p in reach]
            new = set.intersection(*ps) | {k} if ps else {k}
            if new != dom[k]:
                dom[k], changed = new, True
    return dom


def _natural_loops(instrs: list, blocks: list) -> list:
    dom = _dominators(blocks)
    preds = [[] for _ in blocks]
    for k, b in enumerate(blocks):
        for s in b.succ:
            preds[s].append(k)
    bodies: dict[int, set] = {}
    for k, b in enumerate(blocks):
        for h in b.succ:
            if h in dom[k]:  # back edge k -> h
                body, stack = {h, k}, ([k] if k != h else [])
                while stack:
                    for p in preds[stack.pop()]:
                        if p not in body:
                            body.add(p)
                            stack.append(p)
                bodies.setdefault(h, set()).update(body)
    loops = [Loop(h, body, addr=instrs[blocks[h].start].addr) for h, body in sorted(bodies.items())]
    for lp in loops:
        lp.inner = [o for o in loops if o is not lp and o.blocks < lp.blocks]
        nested = set().union(*(o.blocks for o in lp.inner)) if lp.inner else set()
        lp.own = lp.blocks - nested
        for bi in sorted(lp.own):
            if blocks[bi].cold:
                continue
            for ins in instrs[blocks[bi].start : blocks[bi].end]:
                lp.counts.add(ins)
        lp.counts.branches = max(0, lp.counts.branches - 1)  # the loop's own back edge
    return loops


# ---- tools -----------------------------------------------------------------------------------------------------


def find_tool(name: str) -> str | None:
    """``cuobjdump`` / ``nvdisasm`` / ``ptxas``: the CUDA toolkit's, else the copy Triton ships."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "bin", name)):
            return os.path.join(home, "bin", name)
    try:
        import triton

        p = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
        if os.path.exists(p):
            return p
    except ImportError:
        pass
    return shutil.which(name)


def _cuobjdump(args: list, cubin: bytes) -> str:
    """``cuobjdump ARGS`` of ``cubin``, kept on disk by the cubin's and the tool's hash (beside the static model's
    cubins: ``$XDG_CACHE_HOME/megakernels/static/sass``), so a repeated analysis (every test run, every checkout) does
    not run the tool again."""
    tool = find_tool("cuobjdump")
    if tool is None:
        raise RuntimeError("static analysis needs cuobjdump (CUDA toolkit, or the copy bundled with Triton)")
    st = os.stat(tool)
    key = hashlib.sha256(f"{tool} {st.st_size} {st.st_mtime_ns} {' '.join(args)}".encode() + cubin).hexdigest()[:32]
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(root, "megakernels", "static", "sass", f"{key}.txt")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, *args, f.name], capture_output=True, text=True, check=True).stdout
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(out)
    os.replace(tmp, path)  # whole or absent: a reader never sees half a file
    return out


def parse_sass(text: str) -> dict[str, Function]:
    """Functions of ``cuobjdump -sass`` output (``Function : name`` headers, ``/*addr*/ [@P] OP operands ;``)."""
    funcs: dict[str, Function] = {}
    current = None
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("Function : "):
            current = Function(s[len("Function : ") :].strip(), [])
            funcs[current.name] = current
            continue
        if current is None:
            continue
        m = _INSTR.search(line)
        if m:
            current.instrs.append(Instr(int(m[1], 16), (m[2] or "").strip(), m[3], m[4].strip()))
    return funcs


def read_cubin(cubin: bytes) -> dict[str, Function]:
    """Every function of a cubin: SASS and resource usage, by (mangled) name."""
    funcs = parse_sass(_cuobjdump(["-sass"], cubin))
    name = None
    for line in _cuobjdump(["-res-usage"], cubin).splitlines():
        s = line.strip()
        if s.startswith("Function "):
            name = s[len("Function ") :].rstrip(":").strip()
            continue
        m = _RES.search(s)
        if m and name in funcs:
            funcs[name].resources = Resources(*(int(v) for v in m.groups()))
    return funcs


def demangle(names: list[str]) -> dict[str, str]:
    """Mangled -> demangled names (``c++filt``; the names themselves when it is missing)."""
    tool = shutil.which("c++filt") or find_tool("cu++filt")
    if not tool or not names:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {n: n for n in names}
