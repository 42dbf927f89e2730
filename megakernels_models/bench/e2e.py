"""End-to-end training throughput: the trainer on a (tp, pp, dp) layout, and megakernels' GPT or Llama against a plain
PyTorch eager model of the same shape on one device, measured in the same run.

    megakernels bench --e2e PRESET [--device cpu|cuda] [--precision fp32|bf16|fp16|fp8 [--fp8-recipe R]]
                      [--tp N] [--pp N] [--vpp N]
                      [--dp N] [--nproc N] [--micro-batch-size B] [--global-batch-size G] [--steps 5] [--warmup 2]
                      [--sequence-parallel] [--distributed-optimizer] [--recompute none|selective|full]
                      [--no-baseline] [--quick] [--out DIR]

PRESET is a GPT or Llama trainer preset (``gpt-tiny``, ``gpt-1.3b``, ``llama-tiny``, ``llama3-8b``, ...; a comma
list for several) or a CPU-sized GPT (``gpt-cpu-s256``, ``gpt-cpu-s1024``; the default on the CPU is both, on CUDA
``gpt-1.3b``). ``--quick`` measures a tiny model of the first preset's family (2 layers, h 64, s 32) instead.

1. The trainer (``megakernels_models.training.train.run``, so exactly what ``megakernels train`` runs, spawning
   ``--nproc`` local processes for a layout on the CPU) trains ``--warmup`` + ``--steps`` optimizer steps on the
   embedded corpus with per-phase step timers on (``megakernels_models.training.timers``); the last ``--steps`` are
   reported: tokens/s, TFLOP/s per device (model FLOPs of Narayanan et al.: 3x forward incl. attention, no recompute),
   MFU against the device's peak (the trainer's table for GPUs, a timed matmul on the CPU, or ``--peak-tflops``), peak
   memory per device (CUDA allocated memory, or each rank's peak resident set on the CPU) and the time split (forward,
   backward, optimizer, communication, bubble; mean over ranks) next to the schedule's ideal bubble fraction.
2. The baseline (``eager_gpt.compare_single``): one training step of megakernels' ``GPTModel`` (``LlamaModel``)
   and of a plain eager PyTorch GPT (Llama) of the same shape and weights — SDPA attention, F.cross_entropy,
   torch.optim.AdamW — tp = pp = dp = 1, the trainer's micro-batch.

Writes DIR/e2e.json; never asserts on time.
"""

from __future__ import annotations

import argparse
import math
import os

import torch

from megakernels_models.bench.eager_gpt import CPU_PRESETS, SHAPE, compare_single, impl_labels, unsupported
from megakernels_models.bench.eager_gpt import PRECISIONS as BASELINE_PRECISIONS

QUICK = "quick"  # a tiny GPT (2 layers, h 64, s 32): a smoke run
QUICK_LLAMA = "quick-llama"  # a tiny Llama (2 layers, h 64, 4 heads, 2 key/value heads, s 32)
QUICK_OF = {"llama": QUICK_LLAMA}  # the quick model of a family (GPT's for any other)
# The quick models: (the preset they shrink, its overrides).
_SMALL = dict(num_layers=2, hidden_size=64, num_heads=4, seq_length=32, dropout=0.0, attention_dropout=0.0)
QUICK_MODELS = {
    QUICK: ("gpt-tiny", _SMALL),
    QUICK_LLAMA: ("llama-tiny", dict(_SMALL, num_kv_heads=2, ffn_hidden_size=176)),
}
FAMILIES = ("gpt", "llama")  # the families --e2e measures (the eager baselines')


# The trainer flags of --e2e: TrainArgs' own (help, choices and checks declared once, in arguments.py).
LAYOUT_FLAGS = (
    "precision",
    "fp8_recipe",
    "fsdp",
    "zero",
    "tp",
    "pp",
    "vpp",
    "dp",
    "nproc",
    "micro_batch_size",
    "global_batch_size",
    "sequence_parallel",
    "distributed_optimizer",
    "recompute",
    "schedule",
    "attention",
)
# Defaults that differ from TrainArgs' (None: decided per model and device in prepare / trainer_args).
E2E_DEFAULTS = {"precision": None, "nproc": None, "micro_batch_size": None, "global_batch_size": None}
E2E_GROUP = "end-to-end (with --e2e)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The trainer-layout and step flags of ``megakernels bench --e2e``."""
    from megakernels_models.arguments import TrainArgs
    from megakernels_models.settings import add_settings

    add_settings(
        p,
        TrainArgs,
        names=LAYOUT_FLAGS,
        group=E2E_GROUP,
        defaults={
            "precision": "bf16 on CUDA, fp32 on the CPU",
            "nproc": "tp·pp·dp",
            "micro_batch_size": "the preset's",
            "global_batch_size": "micro × dp, × 2·pp with pipelining",
        },
    )
    g = next(a for a in p._action_groups if a.title == E2E_GROUP)
    g.add_argument("--steps", type=int, default=5, help="measured optimizer steps")
    g.add_argument("--warmup", type=int, default=2, help="optimizer steps before the measured ones")
    g.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: table/measured)")
    g.add_argument("--no-baseline", action="store_true", help="skip the one-device eager-PyTorch comparison")
    g.add_argument("--no-trainer", action="store_true", help="skip the trainer run (baseline comparison only)")


def _fill_layout(ns) -> None:
    """The layout flags the user did not give (the parser leaves them out) take their e2e or TrainArgs default."""
    import dataclasses

    from megakernels_models.arguments import TrainArgs

    fields = {f.name: f.default for f in dataclasses.fields(TrainArgs)}
    for name in LAYOUT_FLAGS:
        if not hasattr(ns, name):
            setattr(ns, name, E2E_DEFAULTS.get(name, fields[name]))


def presets_for(name: str | None, device: str, quick: bool) -> list[str]:
    """The models an e2e run measures: ``name``, or the device's default."""
    names = [n for n in (name or "").split(",") if n]
    if quick:
        return [QUICK_OF.get(_family(names[0]) if names else None, QUICK)]
    if names:
        return names
    return ["gpt-1.3b"] if device == "cuda" else list(CPU_PRESETS)


def _family(name: str) -> str | None:
    """The family of preset ``name`` (None: not a preset)."""
    from megakernels_models.models.config import PRESETS

    if name in CPU_PRESETS:
        return CPU_PRESETS[name][0]["model"]
    return PRESETS[name].model if name in PRESETS else None


def model_config(name: str, device: str):
    """(ModelConfig with dropout 0, default micro-batch) of ``name``.

    Raises:
        ValueError: an unknown preset or one of a family other than GPT and Llama (the message names ``--e2e``).
    """
    from megakernels_models.models.config import PRESETS, ModelConfig, preset

    if name in QUICK_MODELS:
        base, sizes = QUICK_MODELS[name]
        return preset(base, **sizes), 2
    if name in CPU_PRESETS:
        cfg, mbs = CPU_PRESETS[name]
        return ModelConfig(**cfg), mbs
    if name not in PRESETS:
        raise ValueError(f"--e2e: unknown preset {name!r}; choose from {', '.join([*CPU_PRESETS, *PRESETS])}")
    cfg = preset(name, dropout=0.0, attention_dropout=0.0)
    if cfg.model not in FAMILIES:
        raise ValueError(
            f"--e2e: {name} is a {cfg.model} model; the end-to-end benchmark measures GPT and Llama presets"
        )
    return cfg, 4 if device == "cuda" else 2


def trainer_args(name: str, cfg, mbs: int, ns, peak: float | None):
    """``TrainArgs`` of the trainer run for model ``name`` from the flags (validated: ``ArgumentError`` names the
    flag and the rule)."""
    from megakernels_models.arguments import SIZES, TrainArgs, validate
    from megakernels_models.models.config import PRESETS

    dp = ns.dp or (ns.nproc // (ns.tp * ns.pp) if ns.nproc else 1)
    nproc = ns.nproc or ns.tp * ns.pp * dp
    gbs = ns.global_batch_size or mbs * max(1, dp) * (1 if ns.pp == 1 else 2 * ns.pp)
    # a preset by name; a quick model as its preset with the sizes changed; a CPU-sized one by its sizes
    preset = name if name in PRESETS else QUICK_MODELS[name][0] if name in QUICK_MODELS else None
    sizes = {} if name in PRESETS else {k: getattr(cfg, k) for k in SIZES}
    args = TrainArgs(
        model=cfg.model,
        preset=preset,
        **sizes,
        dropout=0.0,
        tp=ns.tp,
        pp=ns.pp,
        vpp=ns.vpp,
        dp=ns.dp,
        nproc=nproc,
        device=ns.device,
        sequence_parallel=ns.sequence_parallel,
        schedule=ns.schedule,
        attention=ns.attention,
        micro_batch_size=mbs,
        global_batch_size=gbs,
        steps=ns.warmup + ns.steps,
        warmup_steps=0,
        precision=ns.precision,
        recompute=ns.recompute,
        distributed_optimizer=ns.distributed_optimizer,
        corpus_bytes=4 << 20,
        eval_interval=0,
        progress=False,
        step_timers=True,
        peak_tflops=peak if peak and math.isfinite(peak) else None,
    )
    validate(args)
    return args


def measure_trainer(args, cfg, warmup: int) -> dict:
    """Train per ``args`` and summarise the steps after ``warmup`` (see the module docstring)."""
    from megakernels.parallel.pipeline.schedules import bubble_fraction
    from megakernels_models.training.train import run

    records = run(args)[warmup:]
    tokens_step = args.global_batch_size * cfg.seq_length
    step_s = sum(tokens_step / r["tokens_per_s"] for r in records) / len(records)
    world = args.world_size()
    tflops = cfg.flops_per_token("none") * tokens_step / step_s / world / 1e12
    device_peak = records[-1]["tflops_per_device"] / records[-1]["mfu"] if records[-1]["mfu"] else float("nan")
    fields = records[-1]["step_timers"]["fields"]
    per_rank = [
        [sum(r["step_timers"]["per_rank"][k][i] for r in records) / len(records) for i in range(len(fields))]
        for k in range(world)
    ]
    peak_mem = [
        max(r["step_timers"]["per_rank"][k][fields.index("peak_memory_bytes")] for r in records) for k in range(world)
    ]
    phases = [f for f in fields if f not in ("total", "peak_memory_bytes")]
    split = {f: sum(rank[fields.index(f)] for rank in per_rank) / world for f in phases}
    m = args.num_microbatches()
    name = "interleaved" if (args.vpp or 1) > 1 else args.schedule
    return {
        "layout": {
            "tp": args.tp,
            "pp": args.pp,
            "vpp": args.vpp,
            "dp": args.data_parallel_size(),
            "nproc": world,
            "micro_batch_size": args.micro_batch_size,
            "global_batch_size": args.global_batch_size,
            "microbatches": m,
            "sequence_parallel": args.sequence_parallel,
            "distributed_optimizer": args.distributed_optimizer,
            "recompute": args.recompute,
        },
        "steps": len(records),
        "step_s": step_s,
        "tokens_per_s": tokens_step / step_s,
        "tflops_per_device": tflops,
        "mfu": tflops / device_peak,
        "device_peak_tflops": device_peak,
        "peak_memory_bytes_per_rank": peak_mem,
        "time_split_s": split,
        "time_split_per_rank_s": [dict(zip(fields, rank)) for rank in per_rank],
        "schedule_bubble_fraction": bubble_fraction(name, args.pp, m, args.pipeline_chunks()) if args.pp > 1 else 0.0,
        "losses": [r["loss"] for r in records],
    }


def prepare(ns) -> list[tuple]:
    """Resolve and validate every requested model before anything runs: ``[(name, cfg, micro-batch, trainer
    args or None)]``. Fills in the defaults of ``ns.precision`` (and the quick mode's step counts).

    Raises:
        ValueError: an unknown preset, a family other than GPT and Llama, or (unless ``--no-baseline``) a model the
            eager baselines do not implement (each naming --e2e); ``ArgumentError`` (a ValueError): a layout rule
            broken.
    """
    _fill_layout(ns)
    ns.precision = ns.precision or ("bf16" if ns.device == "cuda" else "fp32")
    if ns.quick:
        ns.steps, ns.warmup = min(ns.steps, 2), min(ns.warmup, 1)
    for flag in ("steps", "warmup"):
        if getattr(ns, flag) < (1 if flag == "steps" else 0):
            raise ValueError(f"--{flag} must be >= {1 if flag == 'steps' else 0}, got {getattr(ns, flag)}")
    plan = []
    for name in presets_for(getattr(ns, "e2e", None), ns.device, ns.quick):
        cfg, mbs = model_config(name, ns.device)
        missing = None if ns.no_baseline else unsupported(cfg)
        if missing:
            raise ValueError(f"--e2e: {name} has no eager baseline: {missing}; pass --no-baseline")
        mbs = ns.micro_batch_size or mbs
        plan.append((name, cfg, mbs, None if ns.no_trainer else trainer_args(name, cfg, mbs, ns, None)))
    return plan


def rank_peak(peak: float, nproc: int, ns) -> float:
    """The peak one rank is held against. On the CPU, ``--nproc`` local ranks share the cores (``cpu_count //
    nproc`` threads each, as the launcher gives them), so a rank's peak is its share of the peak measured here on
    ``torch.get_num_threads()`` threads; then TFLOP/s per rank over it is the whole machine's utilisation. On a GPU
    (one per rank) or with ``--peak-tflops``: ``peak`` itself."""
    if ns.device == "cuda" or ns.peak_tflops or nproc == 1:
        return peak
    return peak * max(1, (os.cpu_count() or 1) // nproc) / torch.get_num_threads()


def run(ns, plan: list[tuple] | None = None, log=print) -> list[dict]:
    """Every model of ``plan`` (default ``prepare(ns)``): the trainer run (unless ``--no-trainer``) and the
    one-device baseline (unless ``--no-baseline``); prints the report and returns one entry per model.

    Raises:
        megakernels.parallel.launch.WorldFailed: a spawned rank failed.
    """
    from megakernels_models.training.mfu import device_peak_tflops

    plan = prepare(ns) if plan is None else plan
    device = torch.device(ns.device)
    peak, source = device_peak_tflops(ns.precision, device, ns.peak_tflops)
    log(f"# {ns.precision} on {ns.device}; MFU against {peak:.3g} TFLOP/s ({source})")
    out = []
    for name, cfg, mbs, targs in plan:
        entry = {
            "name": name,
            "precision": ns.precision,
            "device": ns.device,
            "micro_batch_size": mbs,
            "model": cfg.model,
            "shape": {k: getattr(cfg, k) for k in SHAPE},
        }
        if targs is not None:
            targs = trainer_args(name, cfg, mbs, ns, rank_peak(peak, targs.nproc, ns))
            entry["trainer"] = measure_trainer(targs, cfg, ns.warmup)
        if not ns.no_baseline:
            if ns.precision in BASELINE_PRECISIONS:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                entry["baseline"] = compare_single(cfg, device, ns.precision, mbs, ns.steps, peak)
            else:
                entry["baseline_note"] = f"no eager baseline in {ns.precision} (fp32 and bf16 only)"
        out.append(entry)
        for line in report_lines(entry):
            log(line)
    return out


def _gib(b) -> str:
    return "-" if b is None else f"{b / 2**30:.2f} GiB"


def report_lines(e: dict) -> list[str]:
    """The printed report of one ``run`` entry: a row per implementation, then the trainer's time split."""
    s = e["shape"]
    kv = s.get("num_kv_heads", s["num_heads"])
    lines = [
        f"\n## e2e {e['name']}: l{s['num_layers']} h{s['hidden_size']} a{s['num_heads']}"
        f"{f' kv{kv}' if kv != s['num_heads'] else ''} s{s['seq_length']} V{s['vocab_size']}, {e['precision']} on "
        f"{e['device']}",
        f"{'run':<24}{'layout':<26}{'step ms':>10}{'tokens/s':>11}{'TFLOP/s/dev':>13}{'MFU':>8}"
        f"{'peak mem/dev':>14}{'vs eager/dev':>14}",
    ]
    base = e.get("baseline")
    eager_tps = base["eager"]["tokens_per_s"] if base else None

    def line(label, layout, step_s, tps, tflops, mfu, mem, world=1):
        vs = f"{tps / world / eager_tps:.2f}x" if eager_tps else "-"
        lines.append(
            f"{label:<24}{layout:<26}{step_s * 1e3:>10.1f}{tps:>11.0f}{tflops:>13.3g}{mfu:>8.1%}{mem:>14}{vs:>14}"
        )

    if base:
        for impl, label in zip(("eager", "megakernels"), impl_labels(e.get("model", "gpt"))):
            r = base[impl]
            line(
                label, f"1 device, b{e['micro_batch_size']}", r["step_s"], r["tokens_per_s"], r["tflops"], r["mfu"], "-"
            )
    t = e.get("trainer")
    if t:
        lay = t["layout"]
        desc = (
            f"tp{lay['tp']} pp{lay['pp']}{'v' + str(lay['vpp']) if lay['vpp'] else ''} dp{lay['dp']}, "
            f"b{lay['micro_batch_size']}x{lay['microbatches']}"
        )
        line(
            "megakernels train",
            desc,
            t["step_s"],
            t["tokens_per_s"],
            t["tflops_per_device"],
            t["mfu"],
            _gib(max(t["peak_memory_bytes_per_rank"])),
            lay["nproc"],
        )
        total = sum(t["time_split_s"].values()) or float("nan")
        parts = " | ".join(f"{k} {v * 1e3:.1f} ms ({v / total:.0%})" for k, v in t["time_split_s"].items())
        lines.append(
            f"  trainer step split (mean over {lay['nproc']} rank(s)): {parts}; schedule's ideal bubble "
            f"fraction {t['schedule_bubble_fraction']:.3f}"
        )
        if e["device"] == "cpu" and lay["nproc"] > 1:
            lines.append(
                f"  the {lay['nproc']} ranks share this CPU: MFU per rank against its share of the cores, "
                f"{t['device_peak_tflops']:.3g} TFLOP/s"
            )
        if lay["nproc"] > 1:
            lines.append("  peak memory per rank: " + ", ".join(_gib(b) for b in t["peak_memory_bytes_per_rank"]))
    if base and base["megakernels"].get("step_memory_bytes") is not None:
        lines.append(
            f"  one-device step memory beyond weights and optimizer state: eager "
            f"{_gib(base['eager']['step_memory_bytes'])}, megakernels "
            f"{_gib(base['megakernels']['step_memory_bytes'])}"
        )
    if e.get("baseline_note"):
        lines.append(f"  note: {e['baseline_note']}")
    return lines
