"""PyTorch ops priced on the GPU: GEMMs by cuBLAS's tiles and waves, everything else by its bytes; a compiled
region as Inductor runs it (its fused kernels and their row passes)."""

from __future__ import annotations

import math

from costmodel import cublas, model
from costmodel.peers.recorder import Op
from costmodel.peers.triton_price import price_triton


def _op_name(op: Op) -> str:
    return op.func.__name__.split(".")[0] if hasattr(op.func, "__name__") else str(op.func)


def launches_nothing(op: Op) -> bool:
    """Whether a recorded PyTorch op launches no kernel: a view, an allocation, a query, an op with no output."""
    schema = getattr(op.func, "_schema", None)
    if schema is not None and any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
        return True  # a view (an in-place op, whose return aliases the tensor it writes, launches a kernel)
    return not op.outputs or _op_name(op) in (
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "device",
        "lift_fresh",
        "sym_size",
        "sym_stride",
        "sym_numel",
    )


# PyTorch ops whose kernels write their outputs without reading their inputs' data (the input gives a shape, or is
# the tensor filled in place)
WRITES_ONLY = frozenset(
    {"zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like", "fill_", "zero_", "normal_",
     "uniform_", "random_", "bernoulli_"}
)  # fmt: skip


def price_torch(op: Op, m: model.Machine) -> dict | None:
    """GPU time of one recorded PyTorch op on ``m``; None for one that launches no kernel."""

    if launches_nothing(op):
        return None
    name = _op_name(op)

    def size(t):
        return math.prod(t[0]) * t[1].itemsize

    # an op that only writes (a factory like zeros_like, a fill) reads nothing of its inputs
    nbytes = (0 if name in WRITES_ONLY else sum(size(t) for t in op.inputs)) + sum(size(t) for t in op.outputs)
    # PyTorch's CUDA softmax backward (not the log one) is two kernels: tmp = grad * output, then the row kernel on
    # (tmp, output) (aten/src/ATen/native/cuda/SoftMax.cu, softmax_backward_cuda_out)
    kernels = 2 if name == "_softmax_backward_data" else 1
    nbytes *= kernels
    t = nbytes / m.dram_copy
    bound = "dram"
    extra = {"kernels": kernels} if kernels > 1 else {}
    if name in ("mm", "addmm", "bmm", "baddbmm", "matmul") and len(op.inputs) >= 2:
        a, b = op.inputs[-2][0], op.inputs[-1][0]
        batch, rows, cols, depth = cublas.dims(a, b)
        g = cublas.gemm_time(m, batch, rows, cols, depth, op.inputs[-1][1])
        extra = {"gemm": f"{batch}x{rows}x{cols}x{depth} {str(op.inputs[-1][1]).split('.')[-1]}", **g}
        extra.pop("time_s")
        if g["time_s"] > t:
            t, bound = g["time_s"], "mma"
    return {"kernel": f"aten.{name}", "bound": bound, "time_s": t + kernels * m.launch_s, "dram_bytes": nbytes, **extra}


# The ops Inductor leaves as extern kernels (called as they are from its generated code): the GEMMs; a Triton kernel
# a compiled function launches is its own kernel too
EXTERN = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "_scaled_mm", "convolution", "_convolution"})


def fuse_compiled(ops: list[Op]) -> list[tuple]:
    """The kernels Inductor runs for one compiled call, from the ops recorded in it (between its "compiled" and
    "compiled_end" markers, the latter included for the call's outputs), in order of first appearance: ("extern",
    op) for a GEMM (``EXTERN``) or a Triton launch, kept as it is; ("fused", {"ops", "read_bytes", "write_bytes"})
    for a fused kernel. Assumptions about Inductor (costmodel/README.md):

    - every op that launches something and is not extern joins a fused kernel; the fused kernels are the levels of
      the data flow between externs: an op joins level g, the latest level among its inputs' producers (a fused
      kernel's level, or an extern's), and an extern fed by level g runs after it and before level g + 1 (an
      extern fed only by externs or by the call's inputs shares their level);
    - a fused kernel reads from DRAM each tensor it reads that it did not produce itself (once, whatever the number
      of its ops that read it), and writes each tensor it produces that is read outside it (by a later kernel) or
      leaves the call (a returned storage, or one made before the call that the call writes into); what it makes
      and uses itself stays on chip. Bytes are the views' distinct elements, at most the storage's;
    - where its rows are longer than a persistent reduction holds, a fused kernel runs as Inductor's looped
      reduction: one loop over the rows per reduction a later op of the kernel needs, each loop reading again what
      it uses (``_row_passes``: the kernel's reads are its passes' reads summed; "passes" counts them);
    - views and allocations launch nothing.

    Raises:
        ValueError: a read-back (a graph break) inside the call, or no "compiled_end" marker."""
    if not ops or ops[-1].kind != "compiled_end":
        raise ValueError("a compiled region's ops must end with its 'compiled_end' marker")
    returned = set(ops[-1].access[0]) if ops[-1].access else set()
    version: dict[int, int] = {}  # storage -> its current version (each write makes one)
    made_by: dict[tuple, tuple] = {}  # (storage, version) -> ("g", level) | ("e", level)
    readers: dict[tuple, set] = {}  # (storage, version) -> the kernels that read it
    outside, seen = set(), set()  # storages the call did not make; storages met
    groups: dict[int, dict] = {}
    kernels: list = []  # ("extern", op, tag) | ("group", level), in order of first appearance

    def level_of(sid: int) -> tuple:
        return made_by.get((sid, version.get(sid, 0)), ("in", 0))

    for i, op in enumerate(ops[:-1]):
        if op.kind == "sync":
            raise ValueError("a read-back inside a compiled region (a graph break) is not modelled")
        if op.kind not in ("torch", "triton"):
            continue
        ins, outs = op.access or ((), ())
        for a in ins:
            if a[0] not in seen:
                seen.add(a[0])
                outside.add(a[0])
        seen.update(a[0] for a in outs)
        extern = op.kind == "triton" or _op_name(op) in EXTERN
        if op.kind == "torch" and not extern and launches_nothing(op):
            continue  # a view or an allocation
        made = [level_of(a[0]) for a in ins]
        if extern:
            level = max([g + 1 if kind == "g" else g for kind, g in made], default=0)
            tag = ("e", i)
            kernels.append(("extern", op, tag))
        else:
            level = max([g for _, g in made], default=0)
            tag = ("g", level)
            if level not in groups:
                groups[level] = {"ops": 0, "reads": {}, "writes": {}, "trace": []}
                kernels.append(("group", level))
            group = groups[level]
            group["ops"] += 1
        in_keys = []
        for a in ins:
            key = (a[0], version.get(a[0], 0))
            in_keys.append((key, a[1], a[2], a[3]))
            readers.setdefault(key, set()).add(tag)
            if not extern and made_by.get(key) != tag:
                group["reads"].setdefault(key, {})[a[1]] = (a[2], a[3])
        out_keys = []
        for a in outs:
            version[a[0]] = version.get(a[0], 0) + 1
            key = (a[0], version[a[0]])
            out_keys.append((key, a[1], a[2], a[3]))
            made_by[key] = ("e", level) if extern else tag
            if not extern:
                group["writes"].setdefault(key, {})[a[1]] = (a[2], a[3])
        if not extern:
            group["trace"].append((_op_name(op), in_keys, out_keys))

    def nbytes(views: dict) -> int:
        return min(sum(b for b, _ in views.values()), max(s for _, s in views.values()))

    out = []
    for k in kernels:
        if k[0] == "extern":
            out.append(("extern", k[1]))
            continue
        tag, group = ("g", k[1]), groups[k[1]]
        written, stored = 0, set()
        for key, views in group["writes"].items():
            sid, v = key
            leaves = v == version[sid] and (sid in returned or sid in outside)
            if leaves or readers.get(key, set()) - {tag}:
                written += nbytes(views)
                stored.add(key)
        passes, materialised = _row_passes(group["trace"], stored)
        seen_views: dict = {}
        for _, ins, outs in group["trace"]:
            for key, view, b, sb in (*ins, *outs):
                seen_views.setdefault(key, {})[view] = (b, sb)
        read = sum(nbytes(seen_views[key]) for keys in passes for key in keys)
        written += sum(nbytes(seen_views[key]) for key in materialised - stored)
        out.append(("fused", {"ops": group["ops"], "read_bytes": read, "write_bytes": written, "passes": len(passes)}))
    return out


# How Inductor runs the ops of one fused kernel over their rows (torch 2.x, torch/_inductor): the ops that reduce a
# row and then use the result (softmax and log-softmax, forward and backward) decompose into a reduction and a
# pointwise use of it; those that reduce to fewer elements end a row's data flow there.
ROW_NORMALISE = frozenset({"_log_softmax", "_softmax", "_log_softmax_backward_data", "_softmax_backward_data"})
# indirect reads: one element of the indexed input per output element (a gather's load, not a pass over the row)
GATHERS = frozenset({"gather", "nll_loss_forward", "nll_loss2d_forward", "index_select", "index", "take_along_dim"})
# indirect writes: Inductor stores their result (a scatter cannot be recomputed where it is used)
SCATTERS = frozenset({"scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "index_put",
                      "index_put_", "index_add", "index_add_", "masked_scatter"})  # fmt: skip
# inputs an op takes for their shape only (the positions among its tensor arguments)
SHAPE_ONLY = {"nll_loss_backward": (1,), "nll_loss2d_backward": (1,), "new_zeros": (0,), "new_ones": (0,),
              "new_full": (0,), "new_empty": (0,)}  # fmt: skip
# a reduction whose row is at most this long runs persistent, the row held in registers and read once
# (torch/_inductor/choices.py, InductorChoices.should_use_persistent_reduction: ReductionHint.INNER -> 1024)
PERSISTENT_RBLOCK = 1024


def _numel(entry: tuple) -> int:
    """Elements of the view of one access entry (key, (offset, shape, strides, dtype), bytes, storage bytes)."""
    return math.prod(entry[1][1])


def _keeps_last(ins: list, outs: list) -> bool:
    """Whether a reduction keeps its largest input's last dimension (reduces leading ones: a column reduction)."""
    src = max(ins, key=_numel)[1][1]
    out = outs[0][1][1]
    return len(src) >= 2 and _numel(outs[0]) > 1 and bool(out) and out[-1] == src[-1]


def _row_passes(trace: list, stored: set) -> tuple[list, set]:
    """The DRAM reads of one fused kernel's row passes, as Inductor's looped reduction kernel makes them: (a list
    of sets of the tensors (storage, version) each pass reads, the tensors the kernel materialises).

    ``trace`` is the kernel's ops in order (name, inputs, outputs; each entry (key, view, bytes, storage bytes));
    ``stored`` the tensors the kernel writes out. Rules, each from Inductor's source:

    - an op runs in pass p, the latest pass at which one of its inputs is ready; a row reduction's result (a
      reduction, or the statistics of a softmax family op) is ready one pass after the pass that reads its input:
      a node that needs a reduction's result closes the kernel's loop over the row and opens the next one
      (codegen/simd.py, ``SIMDKernel.disable_reduction`` -> ``codegen_body``), and each loop loads again what it
      uses;
    - a value made in the kernel is recomputed where it is used (Inductor inlines pointwise nodes into their
      readers): a pass that uses it reads the tensors it was made from, unless it is stored (written out of the
      kernel, or a scatter's result: Inductor's scatters are kernels of their own), when the pass reads it (a
      stored value the same pass made is still on chip); reduction results are per row, held on chip;
    - a reduction over leading dimensions (a column sum) has another iteration order and gets a loop of its own
      (``Scheduler.can_fuse`` needs the same numel and reduction numel);
    - a softmax family op's reduction reads its first input (the backward's: the gradient), the use of its result
      all its inputs;
    - gathers read one element a row, and shape-only inputs (a factory's, ``WRITES_ONLY``) nothing;
    - where the longest reduced row is at most ``PERSISTENT_RBLOCK`` the kernel is a persistent reduction: the row
      stays in registers, so every tensor is read once (the passes collapse into one)."""
    ready: dict = {}  # key -> the pass from which the value can be used
    made: dict = {}  # key -> (pass it is made in, the tensors a use reads)
    passes: dict = {}
    materialised: set = set()
    extra = 0  # column reductions' own loops
    row = 0

    def sources(key):
        return made[key][1] if key in made else frozenset({key})

    for name, ins, outs in trace:
        shape_only = range(len(ins)) if name in WRITES_ONLY else SHAPE_ONLY.get(name, ())
        used = [e for i, e in enumerate(ins) if i not in shape_only]
        p = max((ready.get(e[0], 0) for e in used), default=0)
        full = [e for e in used if name not in GATHERS or e[2] == min(x[2] for x in used)]
        src = frozenset().union(*(sources(e[0]) for e in full)) if full else frozenset()
        # a softmax family op's reduction reads its first input only (the input, or the gradient: the backward's
        # row sum is of the gradient; the output it scales is read where the result is used)
        reads = sources(used[0][0]) if name in ROW_NORMALISE and used else src
        out_bytes = max((e[2] for e in outs), default=0)
        reduces = name in ROW_NORMALISE or bool(
            name not in GATHERS and used and outs and out_bytes and _numel(outs[0]) < max(_numel(e) for e in used)
        )
        if reduces or name in ROW_NORMALISE:
            row = max(row, max(e[1][1][-1] if e[1][1] else 1 for e in used))
        column = reduces and name not in ROW_NORMALISE and _keeps_last(used, outs)
        if column:
            extra += 1
            passes[("column", extra)] = set(reads)
        else:  # what the pass made and did not scatter is still on chip
            passes.setdefault(p, set()).update(
                k for k in reads if not (k in made and made[k][0] == p and k not in materialised)
            )
        at = p + 1 if reduces else p  # the pass that makes the output
        if name in ROW_NORMALISE and any(key in stored for key, *_ in outs):  # written where it is made
            passes.setdefault(at, set()).update(k for k in src if not (k in made and made[k][0] == at))
        for key, *_ in outs:
            if name in SCATTERS:
                materialised.add(key)
            if key in stored or name in SCATTERS:
                made[key] = (at, frozenset({key}))
            elif reduces and name not in ROW_NORMALISE:
                made[key] = (at, frozenset())  # per row, on chip
            else:
                made[key] = (at, src)
            ready[key] = at
    order = [passes[k] for k in sorted(k for k in passes if not isinstance(k, tuple))]
    order = [s for s in order if s]
    columns = [s for k, s in passes.items() if isinstance(k, tuple) and s]
    if row <= PERSISTENT_RBLOCK:
        merged = set().union(*order, *columns) if order or columns else set()
        return ([merged] if merged else []), materialised
    return order + columns, materialised


def price_compiled(ops: list[Op], m: model.Machine) -> list[dict]:
    """The GPU time of each kernel of one compiled call (``fuse_compiled``) on ``m``: an extern as it is priced
    eagerly (``price_torch``, ``price_triton``); a fused kernel its DRAM bytes at the copy rate and one launch."""
    out = []
    for kind, k in fuse_compiled(ops):
        if kind == "extern":
            out.append(price_triton(k.launch, m) if k.kind == "triton" else price_torch(k, m))
            continue
        nbytes = k["read_bytes"] + k["write_bytes"]
        t = nbytes / m.dram_copy + m.launch_s
        out.append({"kernel": f"inductor.fused({k['ops']} ops)", "bound": "dram", "time_s": t, "dram_bytes": nbytes})
    return out
