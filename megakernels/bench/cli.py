"""``megakernels bench``: kernel microbenchmarks and end-to-end throughput on this machine (docs/benchmarks.md).

    megakernels bench [--ops NAME,...] [--dtype float32,bfloat16,...] [--quick] [--out DIR] [--device cpu|cuda]
                      [--no-compile] [--no-peers] [--min-run-time S] [--shapes A,B[,C,D];...]
                      [--head-dims 64,128] [--seqlens 4096,8192]
    megakernels bench --e2e PRESET [--tp N --pp N --vpp N --dp N --nproc N --precision ... --steps N ...]
    megakernels bench --plan-check [--steps N] [--warmup N] [--out DIR]
    megakernels bench --static ...   (and the other modes of the tools beside the package, when installed)

Measures the device's ceilings first (copy bandwidth, GEMM FLOP/s per dtype; ``ceilings``), then prints one table
per op: median time of ours, GB/s or TFLOP/s (the bytes or FLOPs that must move, counted in each op's module), %
of the measured ceiling, and the speed-up against every baseline measured in the same run (PyTorch eager,
torch.compile where it applies, torch's AdamW variants, SDPA, and apex / flash-attn / Liger-Kernel when
installed — a missing peer is a note, not an error). With ``--out DIR``: ``DIR/bench.json`` ({machine, ceilings,
notes, rows, e2e}) and ``DIR/<op>.png`` (speed vs size). ``--e2e`` runs the end-to-end measurement (``e2e``)
instead of the microbenchmarks, or after them when ``--ops`` is given too. ``--shapes`` replaces the default
shapes of the ops whose shapes have that many sizes: rows,hidden (norms, bias_gelu), rows,ffn (swiglu),
tokens,vocab (cross_entropy), b,h,sq,sk (softmax), b,s,heads,kv_heads,head_dim (rope), m,n,k (fp8_gemm);
``--head-dims`` and ``--seqlens`` those of flash_attention.
``--plan-check`` asks whether ``megakernels plan`` orders layouts as this machine runs them: four layouts of
gpt-tiny on 4 local processes, predicted with a CPU device profile measured here, then trained
(``plan_check``; ``DIR/plan_check.json`` with --out).

Argument errors exit with status 2 and name the flag, before anything is measured; a failed rank exits with 1.
"""
# The microbenchmarks are the kernel library's own (``python -m megakernels.bench`` runs them without the trainer);
# --e2e and --plan-check train models, so the trainer adds them on top as ``Extension``s
# (megakernels_models/bench/modes.py): this package never imports megakernels_models. Tools installed beside the
# package (the static GPU cost model of a development checkout) add theirs through the entry-point group
# ``PLUGINS`` (each entry: a callable returning Extensions); the package never imports them by name.

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from megakernels import precisions

# op -> family module (kept here, not imported from the modules: building the parser must not import torch)
OPS = {
    "layer_norm": "norms",
    "layer_norm_gelu": "norms",
    "rms_norm": "norms",
    "bias_gelu": "bias_gelu",
    "scaled_softmax": "softmax",
    "scaled_masked_softmax": "softmax",
    "scaled_causal_softmax": "softmax",
    "adamw": "adamw",
    "adamw_offload": "adamw",
    "muon": "muon",
    "cross_entropy": "cross_entropy",
    "flash_attention": "attention",
    "rope": "rope",
    "swiglu": "swiglu",
    "grouped_gemm": "moe",
    "moe_dispatch": "moe",
    "moe_router": "moe",
    "moe_permute": "moe",
    "fp8_gemm": "fp8",
    "hf_train": "hf",
}
GROUPS = {
    "norms": [o for o, f in OPS.items() if f == "norms"],
    "softmax": [o for o, f in OPS.items() if f == "softmax"],
    "attention": ["flash_attention"],
    "llama": ["rope", "swiglu"],
    "moe": ["grouped_gemm", "moe_dispatch", "moe_router", "moe_permute"],
    "fp8": ["fp8_gemm"],
    "hf": ["hf_train"],
    "all": list(OPS),
}
DTYPE_NAMES = tuple(precisions.DTYPE_NAMES)
# --shapes: the families whose shapes have that many sizes
SHAPE_DIMS = {
    "norms": "rows,hidden",
    "bias_gelu": "rows,hidden",
    "cross_entropy": "tokens,vocab",
    "softmax": "b,h,sq,sk",
    "rope": "b,s,heads,kv_heads,head_dim",
    "swiglu": "rows,ffn",
    "fp8": "m,n,k",
}


class Extension:
    """A mode that a package on top of the library adds to ``megakernels bench`` (the trainer adds --e2e and
    --plan-check). ``dest``: the namespace attribute of its flag (given when not None/False), and the key of its
    result in bench.json; ``alone``: its mode replaces the microbenchmarks (and exits with ``run``'s status)."""

    dest: str = ""
    alone: bool = False

    def given(self, ns: argparse.Namespace) -> bool:
        """Whether the command line asks for this mode (its flag ``dest`` was given)."""
        return getattr(ns, self.dest, None) not in (None, False)

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        """Add the flags of this mode to ``p``."""

    def prepare(self, ns: argparse.Namespace):
        """Check the flags before anything is measured (ValueError naming the flag); returns what ``run`` gets."""

    def run(self, ns: argparse.Namespace, state):
        """Run the mode: the exit status when ``alone``, else the rows stored under ``dest`` in bench.json."""
        raise NotImplementedError


# Entry-point group of the tools beside the package: each entry is a callable returning Extensions.
PLUGINS = "megakernels.bench"


def plugin_modes() -> list[Extension]:
    """The modes that installed tools add to ``megakernels bench`` (entry-point group ``PLUGINS``)."""
    from importlib.metadata import entry_points

    return [mode for ep in entry_points(group=PLUGINS) for mode in ep.load()()]


class Absent(Extension):
    """A mode of a development tool that is not installed here: its flags parse, and using it is answered with how
    to install the tool (one line, exit status 2)."""

    alone = True

    def __init__(self, dest: str, flags: Sequence[tuple[str, dict]], what: str):
        self.dest, self.flags, self.what = dest, flags, what

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        for flag, kwargs in self.flags:
            p.add_argument(flag, **{"help": f"{self.what} (not installed here)", **kwargs})

    def given(self, ns: argparse.Namespace) -> bool:
        return any(getattr(ns, f[2:].replace("-", "_"), None) not in (None, False) for f, _ in self.flags)

    def prepare(self, ns: argparse.Namespace):
        raise ValueError(
            f"{self.flags[0][0]}: {self.what} is a development tool beside the package and is not installed here; "
            "in a clone of the repository, `bash scripts/setup.sh` installs it into .venv"
        )


# The static GPU cost model's modes (docs/benchmarks.md), answered when it is not installed.
_STATIC = "the static GPU cost model"
ABSENT_MODES = (
    Absent(
        "static",
        (
            ("--static", {"action": "store_true"}),
            ("--peer-csv", {"default": None, "metavar": "FILE"}),
            ("--peer-path", {"default": None, "metavar": "DIR"}),
        ),
        _STATIC,
    ),
    Absent("measure_peers", (("--measure-peers", {"default": None, "metavar": "FILE"}),), _STATIC),
)


def add_parser(sub, extensions: Sequence[Extension] = ()) -> argparse.ArgumentParser:
    """Register ``megakernels bench`` on the ``megakernels`` subparsers (``set_defaults(_run=main)``), with the
    modes ``extensions`` add."""
    p = sub.add_parser(
        "bench",
        help="kernel microbenchmarks and end-to-end training throughput",
        description=__doc__.replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure(p, extensions)
    return p


def configure(p: argparse.ArgumentParser, extensions: Sequence[Extension] = ()) -> argparse.ArgumentParser:
    """Add the flags of ``megakernels bench`` and those of ``extensions`` to ``p`` (``set_defaults(_run=main)``)."""
    p.add_argument(
        "--ops",
        default=None,
        help=f"comma list of ops or groups ({', '.join(GROUPS)}): {', '.join(OPS)} (default: all, or none with --e2e)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        help="comma list of float32, bfloat16, float16 (or fp32, bf16, fp16; default: each op's usual set)",
    )
    p.add_argument("--quick", action="store_true", help="small shapes, short timing (a smoke run)")
    p.add_argument("--out", default=None, metavar="DIR", help="write DIR/bench.json and DIR/<op>.png")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    p.add_argument("--no-peers", action="store_true", help="skip apex / flash-attn / Liger-Kernel even if installed")
    p.add_argument(
        "--min-run-time",
        type=float,
        default=None,
        metavar="S",
        help="seconds of calibrated repeats per measurement (default 0.5; 0.05 with --quick)",
    )
    p.add_argument(
        "--shapes",
        default=None,
        metavar="A,B[,C,D];...",
        help="shapes instead of the defaults: "
        "rows,hidden (norms, bias_gelu), rows,ffn (swiglu), tokens,vocab (cross_entropy), "
        "b,h,sq,sk (softmax), b,s,heads,kv_heads,head_dim (rope), m,n,k (fp8_gemm)",
    )
    p.add_argument("--head-dims", default=None, metavar="D,...", help="flash_attention head dims (default 64,128)")
    p.add_argument(
        "--seqlens",
        default=None,
        metavar="S,...",
        help="flash_attention sequence lengths (default: 512..16k on cuda, 512..4k on cpu)",
    )
    extensions = list(extensions)
    extensions += [m for m in plugin_modes() if m.dest not in {x.dest for x in extensions}]
    extensions += [m for m in ABSENT_MODES if m.dest not in {x.dest for x in extensions}]
    for ext in extensions:
        ext.add_arguments(p)
    p.set_defaults(_run=main, _extensions=tuple(extensions))
    return p


def resolve_ops(value: str | None, e2e: bool, extra: tuple[str, ...] = ()) -> list[str]:
    """``--ops`` -> op names (groups expanded, order kept); ``extra``: more accepted names (a mode's own ops, such
    as the static report's kernels that are not measured).

    Raises:
        ValueError: an unknown name (the message names --ops).
    """
    if value is None:
        return [] if e2e else list(OPS)
    out = []
    for item in (v.strip() for v in value.split(",")):
        if not item:
            continue
        if item not in OPS and item not in GROUPS and item not in extra:
            known = [*OPS, *GROUPS, *(x for x in extra if x not in OPS)]
            raise ValueError(f"--ops: unknown op {item!r}; choose from {', '.join(known)}")
        for op in GROUPS.get(item, [item]):
            if op not in out:
                out.append(op)
    if not out:
        raise ValueError(f"--ops: expected a comma list of ops, got {value!r}")
    return out


def _int_list(flag: str, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise ValueError(f"{flag}: expected a comma list of positive integers, got {value!r}")
    return out


def parse_shapes(value: str | None, ops: list[str]) -> dict[str, list[tuple[int, ...]]]:
    """``--shapes`` -> {family: shapes} for the families of ``ops`` that take shapes of that many sizes.

    Raises:
        ValueError: a malformed shape, or a selected family that takes shapes and got none of its size."""
    if value is None:
        return {}
    try:
        shapes = [tuple(int(v) for v in item.split(",")) for item in value.split(";") if item.strip()]
    except ValueError:
        shapes = []
    if not shapes or any(min(s) < 1 for s in shapes):
        raise ValueError(f"--shapes: expected positive sizes like 4096,1024;8192,4096, got {value!r}")
    out = {}
    for fam in dict.fromkeys(OPS[o] for o in ops):
        if fam in SHAPE_DIMS:
            n = len(SHAPE_DIMS[fam].split(","))
            out[fam] = [s for s in shapes if len(s) == n]
            if not out[fam]:
                raise ValueError(f"--shapes: {fam} needs {SHAPE_DIMS[fam]} shapes ({n} sizes), got {value!r}")
    return out


def _active(ns) -> list[Extension]:
    """The extensions whose flag was given, those that run alone first."""
    given = [x for x in getattr(ns, "_extensions", ()) if x.given(ns)]
    return sorted(given, key=lambda x: not x.alone)


def _check(ns) -> tuple[list[str], list[str] | None]:
    """Everything wrong with the flags, as a ValueError naming the flag, before anything is measured. A mode that
    runs alone checks its own flags (``Extension.prepare``)."""
    from megakernels.bench.common import DTYPE_ALIASES, split_list

    active = _active(ns)
    alone = [x for x in active if x.alone]
    if alone:
        if len(active) > 1:
            flags = ", ".join(_flag(x) for x in active[1:])
            raise ValueError(f"{_flag(alone[0])}: this mode runs alone; drop {flags}")
        return [], None
    after = [x for x in active if not x.alone]  # modes run after the microbenchmarks (--e2e)
    ops = resolve_ops(ns.ops, bool(after))
    ns.shape_map = parse_shapes(ns.shapes, [o for o in ops if o in OPS])
    ns.head_dim_list, ns.seqlen_list = _int_list("--head-dims", ns.head_dims), _int_list("--seqlens", ns.seqlens)
    dtypes = split_list("--dtype", ns.dtype, DTYPE_NAMES, DTYPE_ALIASES) if ns.dtype is not None else None
    if ns.min_run_time is not None and not ns.min_run_time > 0:
        raise ValueError(f"--min-run-time must be > 0 seconds, got {ns.min_run_time}")
    if ns.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device available")
    return ops, dtypes


def _flag(x: Extension) -> str:
    return "--" + x.dest.replace("_", "-")


def run_ops(ops: list[str], dtypes: list[str] | None, ns, ceilings: dict, peers, log=print) -> list[dict]:
    """Run each op family's module on its ops of ``ops`` (``module.run(common.Request)``); returns every row."""
    from megakernels.bench.common import Request

    shape_map = getattr(ns, "shape_map", None) or {}
    rows = []
    for fam in dict.fromkeys(OPS[o] for o in ops):
        request = Request(
            ops=tuple(o for o in ops if OPS[o] == fam),
            dtypes=tuple(dtypes) if dtypes else None,
            shapes=tuple(shape_map[fam]) if shape_map.get(fam) else None,
            head_dims=tuple(getattr(ns, "head_dim_list", None) or ()) or None,
            seqlens=tuple(getattr(ns, "seqlen_list", None) or ()) or None,
            device=ns.device,
            quick=ns.quick,
            min_run_time=ns.min_run_time or (0.05 if ns.quick else 0.5),
            with_compile=not ns.no_compile,
            ceilings=ceilings,
            peers=peers,
            log=log,
        )
        rows += importlib.import_module(f"megakernels.bench.{fam}").run(request)
    return rows


def gemm_dtypes(ops: list[str], dtypes: list[str] | None, device: str) -> list[str]:
    """The dtypes whose GEMM rate is measured: the requested ones, else those the selected ops run in."""
    if dtypes:
        return dtypes
    out = ["float32"]
    if "flash_attention" in ops:
        out = ["bfloat16", "float16"] if device == "cuda" else ["float32"]
    if "grouped_gemm" in ops:  # megakernels/bench/moe.py's DEFAULT_DTYPES
        out += [d for d in ("float32", "bfloat16") if d not in out]
    if "fp8_gemm" in ops and device == "cuda":  # held against the bf16 GEMM rate on a GPU (megakernels/bench/fp8.py)
        out += [d for d in ("bfloat16",) if d not in out]
    return out


def main(ns: argparse.Namespace) -> int:
    """Run ``megakernels bench`` on parsed flags; returns the exit status (2: bad flags, 1: a failed rank)."""
    active = _active(ns)
    try:
        ops, dtypes = _check(ns)
        states = [(x, x.prepare(ns)) for x in active]
    except ValueError as e:  # an extension's own argument errors included (the trainer's ArgumentError)
        print(f"megakernels bench: error: {e}", file=sys.stderr)
        return 2
    for x, state in states:
        if x.alone:
            return x.run(ns, state)
    from megakernels.bench import ceilings as ceil
    from megakernels.bench.common import machine, machine_line, write_json
    from megakernels.bench.peers import Peers
    from megakernels.parallel.launch import WorldFailed

    info = machine(ns.device)
    print(machine_line(info))
    ceilings = ceil.measure(ns.device, gemm_dtypes(ops, dtypes, ns.device), quick=ns.quick)
    peers = Peers(ns.device, enabled=not ns.no_peers)
    rows = run_ops(ops, dtypes, ns, ceilings, peers) if ops else []
    extra = {}
    for x, state in states:
        try:
            extra[x.dest] = x.run(ns, state)
        except WorldFailed as e:
            print(f"megakernels bench: a rank failed: {e}", file=sys.stderr)
            return 1
    print()
    for n in peers.notes:
        print(f"note: {n}")
    payload = {"machine": info, "ceilings": ceilings, "notes": peers.notes, "rows": rows, **extra}
    path = write_json(ns.out, "bench.json", payload)
    if path:
        from megakernels.bench import plot

        print(f"wrote {path}")
        if rows and not plot.available():
            print(
                "note: matplotlib is not installed, so no plots were drawn; pip install 'megakernels[bench]' "
                "(or matplotlib) for DIR/<op>.png"
            )
            return 0
        for png in plot.write_plots(rows, ns.out):
            print(f"wrote {png}")
    return 0
