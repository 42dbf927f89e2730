"""``megakernels bench``: the kernel microbenchmarks and end-to-end throughput on this machine (docs/design.md §5, §6).

    megakernels bench [--ops NAME,...] [--dtype float32,bfloat16,...] [--quick] [--out DIR] [--device cpu|cuda]
                      [--no-compile] [--no-peers] [--min-run-time S]
    megakernels bench --e2e PRESET [--tp N --pp N --vpp N --dp N --nproc N --precision ... --steps N ...]

Measures the device's ceilings first (copy bandwidth, GEMM FLOP/s per dtype; ``ceilings``), then prints one table
per op: median time of ours, GB/s or TFLOP/s (the bytes or FLOPs that must move, counted in each op's module), %
of the measured ceiling, and the speed-up against every baseline measured in the same run (PyTorch eager,
torch.compile where it applies, torch's AdamW variants, SDPA, and apex / flash-attn / Liger-Kernel when
installed — a missing peer is a note, not an error). With ``--out DIR``: ``DIR/bench.json`` ({machine, ceilings,
notes, rows, e2e}) and ``DIR/<op>.png`` (speed vs size). ``--e2e`` runs the end-to-end measurement (``e2e``)
instead of the microbenchmarks, or after them when ``--ops`` is given too.

Argument errors exit with status 2 and name the flag, before anything is measured; a failed rank exits with 1.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# op -> family module (kept here, not imported from the modules: building the parser must not import torch)
OPS = {
    "layer_norm": "norms", "layer_norm_gelu": "norms", "rms_norm": "norms", "bias_gelu": "norms",
    "scaled_softmax": "softmax", "scaled_masked_softmax": "softmax", "scaled_causal_softmax": "softmax",
    "adamw": "adamw", "cross_entropy": "cross_entropy", "flash_attention": "attention",
    "rope": "rope", "swiglu": "swiglu", "grouped_gemm": "moe", "moe_dispatch": "moe", "hf_train": "hf",
}
GROUPS = {"norms": [o for o, f in OPS.items() if f == "norms"],
          "softmax": [o for o, f in OPS.items() if f == "softmax"], "attention": ["flash_attention"],
          "llama": ["rope", "swiglu"], "moe": ["grouped_gemm", "moe_dispatch"], "hf": ["hf_train"],
          "all": list(OPS)}
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``megakernels bench`` on the ``megakernels`` subparsers (``set_defaults(_run=main)``)."""
    p = sub.add_parser("bench", help="kernel microbenchmarks and end-to-end training throughput",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default=None, help=f"comma list of ops or groups ({', '.join(GROUPS)}): "
                   f"{', '.join(OPS)} (default: all, or none with --e2e)")
    p.add_argument("--dtype", default=None, help="comma list of float32, bfloat16, float16 (or fp32, bf16, fp16; "
                   "default: each op's usual set)")
    p.add_argument("--quick", action="store_true", help="small shapes, short timing (a smoke run)")
    p.add_argument("--out", default=None, metavar="DIR", help="write DIR/bench.json and DIR/<op>.png")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    p.add_argument("--no-peers", action="store_true", help="skip apex / flash-attn / Liger-Kernel even if installed")
    p.add_argument("--min-run-time", type=float, default=None, metavar="S",
                   help="seconds of calibrated repeats per measurement (default 0.5; 0.05 with --quick)")
    p.add_argument("--e2e", default=None, metavar="PRESET", help="end-to-end training throughput of PRESET "
                   "(comma list; gpt-tiny, gpt-1.3b, ..., gpt-cpu-s256, gpt-cpu-s1024)")
    from megakernels_models.bench import e2e

    e2e.add_arguments(p)
    p.set_defaults(_run=main)
    return p


def resolve_ops(value: str | None, e2e: bool) -> list[str]:
    """``--ops`` -> op names (groups expanded, order kept).

    Raises:
        ValueError: an unknown name (the message names --ops).
    """
    if value is None:
        return [] if e2e else list(OPS)
    out = []
    for item in (v.strip() for v in value.split(",")):
        if not item:
            continue
        if item not in OPS and item not in GROUPS:
            raise ValueError(f"--ops: unknown op {item!r}; choose from {', '.join([*OPS, *GROUPS])}")
        for op in GROUPS.get(item, [item]):
            if op not in out:
                out.append(op)
    if not out:
        raise ValueError(f"--ops: expected a comma list of ops, got {value!r}")
    return out


def _check(ns) -> tuple[list[str], list[str] | None]:
    """Everything wrong with the flags, as a ValueError naming the flag, before anything is measured."""
    from megakernels_models.bench.common import DTYPE_ALIASES, split_list

    ops = resolve_ops(ns.ops, ns.e2e is not None)
    dtypes = split_list("--dtype", ns.dtype, DTYPE_NAMES, DTYPE_ALIASES) if ns.dtype is not None else None
    if ns.min_run_time is not None and not ns.min_run_time > 0:
        raise ValueError(f"--min-run-time must be > 0 seconds, got {ns.min_run_time}")
    if ns.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device available")
    return ops, dtypes


def run_ops(ops: list[str], dtypes: list[str] | None, ns, ceilings: dict, peers, log=print) -> list[dict]:
    """Run each op's family module on ``ops``; returns every result row."""
    quick, device = ns.quick, ns.device
    t = ns.min_run_time or (0.05 if quick else 0.5)
    rows = []
    families = list(dict.fromkeys(OPS[o] for o in ops))
    for fam in families:
        mod = importlib.import_module(f"megakernels_models.bench.{fam}")
        mine = [o for o in ops if OPS[o] == fam]
        if fam == "attention":
            ds = dtypes or list(mod.default_dtypes(device))
            head_dims, seqlens = ([64], [128]) if quick else ([64, 128], mod.GPU_SEQLENS if device == "cuda"
                                                              else mod.CPU_SEQLENS)
            rows += mod.run(ds, head_dims, seqlens, device=device, min_run_time=t, ceilings=ceilings, peers=peers,
                            log=log)
        elif fam == "adamw":
            rows += mod.run(mod.default_configs(quick), dtypes or mod.DEFAULT_DTYPES, device=device,
                            min_run_time=max(t, 0.05 if quick else 1.0), ceilings=ceilings, peers=peers, log=log)
        elif fam == "moe":
            rows += mod.run(mine, dtypes, mod.default_shapes(device, quick), device=device, quick=quick,
                            min_run_time=t, ceilings=ceilings, notes=peers.notes, log=log)
        elif fam == "hf":
            rows += mod.run(dtypes or mod.DEFAULT_DTYPES, quick=quick, device=device, min_run_time=t,
                            ceilings=ceilings, notes=peers.notes, log=log)
        elif fam == "cross_entropy":
            rows += mod.run(dtypes or mod.DEFAULT_DTYPES, mod.default_shapes(device, quick), device=device,
                            min_run_time=t, ceilings=ceilings, peers=peers, log=log)
        else:  # norms, softmax, rope, swiglu: fused vs eager vs torch.compile
            rows += mod.run(mine, dtypes or mod.DEFAULT_DTYPES, mod.default_shapes(device, quick), device=device,
                            with_compile=not ns.no_compile, min_run_time=t, ceilings=ceilings, peers=peers, log=log)
    return rows


def gemm_dtypes(ops: list[str], dtypes: list[str] | None, device: str) -> list[str]:
    """The dtypes whose GEMM rate is measured: the requested ones, else those the selected ops run in."""
    if dtypes:
        return dtypes
    out = ["float32"]
    if "flash_attention" in ops:
        out = ["bfloat16", "float16"] if device == "cuda" else ["float32"]
    if "grouped_gemm" in ops:  # megakernels_models/bench/moe.py's DEFAULT_DTYPES
        out += [d for d in ("float32", "bfloat16") if d not in out]
    return out


def main(ns: argparse.Namespace) -> int:
    """Run ``megakernels bench`` on parsed flags; returns the exit status (2: bad flags, 1: a failed rank)."""
    from megakernels_models.bench import e2e as e2e_mod

    try:
        ops, dtypes = _check(ns)
        plan = e2e_mod.prepare(ns) if ns.e2e is not None else None
    except ValueError as e:  # the trainer's ArgumentError included
        print(f"megakernels bench: error: {e}", file=sys.stderr)
        return 2
    from megakernels.parallel.launch import WorldFailed
    from megakernels_models.bench import ceilings as ceil
    from megakernels_models.bench.common import machine, machine_line, write_json
    from megakernels_models.bench.peers import Peers

    info = machine(ns.device)
    print(machine_line(info))
    ceilings = ceil.measure(ns.device, gemm_dtypes(ops, dtypes, ns.device), quick=ns.quick)
    peers = Peers(ns.device, enabled=not ns.no_peers)
    rows = run_ops(ops, dtypes, ns, ceilings, peers) if ops else []
    e2e_rows = None
    if plan is not None:
        try:
            e2e_rows = e2e_mod.run(ns, plan)
        except WorldFailed as e:
            print(f"megakernels bench: a rank failed: {e}", file=sys.stderr)
            return 1
    print()
    for n in peers.notes:
        print(f"note: {n}")
    payload = {"machine": info, "ceilings": ceilings, "notes": peers.notes, "rows": rows}
    if e2e_rows is not None:
        payload["e2e"] = e2e_rows
    path = write_json(ns.out, "bench.json", payload)
    if path:
        from megakernels_models.bench import plot

        print(f"wrote {path}")
        if rows and not plot.available():
            print("note: matplotlib is not installed, so no plots were drawn; pip install 'megakernels[bench]' "
                  "(or matplotlib) for DIR/<op>.png")
            return 0
        for png in plot.write_plots(rows, ns.out):
            print(f"wrote {png}")
    return 0

