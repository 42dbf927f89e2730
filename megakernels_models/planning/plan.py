"""``megakernels plan``: choose a parallel layout for a model on a cluster.

    megakernels plan --preset gpt-8.3b --gpus 512 [--gpus-per-node 8] [--gpu h200|h100|a100|v100]
                     [--seq-length S] [--global-batch-size B] [--precision bf16|fp16|fp32|fp8
                     [--fp8-recipe tensorwise|blockwise]] [--offload-optimizer [--host-adamw-ns NS]]
                     [--optimizer adamw|muon] [--top K] [--json]
    megakernels plan --config job.yaml --gpus 64
    megakernels plan --reproduce runs.csv [more.csv ...] [--json]

Enumerates every layout of the GPUs — tensor parallelism (dividing the heads, at most a node), pipeline stages
(dividing the layers) with 1F1B, interleaving or a zero-bubble schedule (zb-h1, zb-v), context parallelism for
long sequences, expert parallelism for mixtures of experts, data parallelism over the rest — with every micro-batch
size that divides the batch, recomputation none / selective / full, sequence parallelism with tp, and the
distributed optimizer; drops the ones
that break a rule ``megakernels train`` checks or that do not fit the GPU's memory (``costs.memory`` plus the
allowance of ``costs.RESERVED_GB`` and ``costs.FRAGMENTATION``); and ranks the rest by predicted step time
(``costs.predict``, every constant documented there). For each of the best ``--top`` it prints memory per GPU,
predicted step time, tokens/s, MFU, the pipeline bubble and the ``megakernels train`` command that runs it — over
several nodes, torchrun's command for every node and the ``sbatch`` line of ``examples/slurm_train.sbatch``.
``--precision fp8`` ranks FP8 layouts (the blocks' linears in FP8, ``--fp8-recipe``'s scaling: costs.py) and is
refused on a GPU without FP8 tensor cores; ``fp8_speedup`` compares a model's best bf16 and fp8 layouts.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys

from megakernels.parallel.layout import LayoutError, ParallelLayout
from megakernels.parallel.optimizer import OPTIMIZERS
from megakernels.precisions import PRECISIONS
from megakernels_models.models.config import RECOMPUTE, ModelConfig, human
from megakernels_models.planning import costs
from megakernels_models.settings import ArgumentError


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    cfg: ModelConfig,
    gpus: int,
    global_batch_size: int,
    gpus_per_node: int,
    precision: str = "bf16",
    offload: bool = False,
    fp8_recipe: str = "tensorwise",
    optimizer: str = "adamw",
) -> list[costs.Layout]:
    """Every layout of ``gpus`` GPUs the trainer accepts for ``cfg`` (before the memory check): the degrees and
    micro-batch sizes worth ranking, kept when ``megakernels.parallel.layout`` — the rules ``megakernels train``
    validates with — finds nothing broken. ``offload``: with the optimizer state in host memory
    (``--offload-optimizer``); ``fp8_recipe``: the scaling with ``precision`` fp8; ``optimizer``: adamw or muon
    (``--optimizer``: its optimizer state and step time)."""
    shapes = cfg.layout_shapes()
    sequence_parallel = shapes.sequence_parallel is None  # with tp > 1, whenever the family supports it
    out = []
    for tp, pp in itertools.product(_divisors(min(gpus_per_node, gpus)), _divisors(gpus)):
        # context parallelism pays off only for long sequences: 8k tokens a rank at least
        for cp in [c for c in (1, 2, 4, 8) if cfg.seq_length >= 8192 * c or c == 1]:
            if gpus % (tp * pp * cp):
                continue
            dp = gpus // (tp * pp * cp)
            pipelines = [(None, "1f1b")]
            if pp > 1:  # interleaved 1F1B, and the zero-bubble schedules (zb-v: its two chunks per rank in a V)
                pipelines += [(2, "1f1b"), (4, "1f1b"), (None, "zb-h1"), (None, "zb-v")]
            for ep, (vpp, schedule) in itertools.product(_divisors(dp) if cfg.num_experts else [1], pipelines):
                try:
                    layout = ParallelLayout.build(
                        gpus,
                        tp=tp,
                        cp=cp,
                        pp=pp,
                        ep=ep,
                        vpp=vpp,
                        sequence_parallel=sequence_parallel and tp > 1,
                        placement="v" if schedule == "zb-v" else "interleaved",
                    )
                except LayoutError:
                    continue
                if layout.model_problem(shapes):
                    continue
                for mbs in _divisors(max(1, global_batch_size // dp)):
                    if mbs > 16 or layout.batch_problem(mbs, global_batch_size):
                        continue
                    stages = (0, 1, 2, 3) if dp * cp > 1 else (0,)  # ZeRO-1, FSDP2's ZeRO-2 and ZeRO-3
                    if schedule != "1f1b":  # the zero-bubble schedules defer weight gradients past FSDP's hooks
                        stages = tuple(z for z in stages if z < 2)
                    for recompute, zero in itertools.product(RECOMPUTE, stages):
                        out.append(
                            costs.Layout(
                                tp=tp,
                                pp=pp,
                                dp=dp,
                                cp=cp,
                                ep=ep,
                                vpp=layout.vpp or 1,
                                schedule=schedule,
                                micro_batch_size=mbs,
                                global_batch_size=global_batch_size,
                                sequence_parallel=layout.sequence_parallel,
                                distributed_optimizer=zero == 1,
                                zero2=zero == 2,
                                fsdp=zero == 3,
                                recompute=recompute,
                                precision=precision,
                                fp8_recipe=fp8_recipe,
                                offload_optimizer=offload,
                                optimizer=optimizer,
                            )
                        )
    return list(dict.fromkeys(out))


def rank(
    cfg: ModelConfig,
    gpus: int,
    global_batch_size: int,
    device: costs.Device,
    gpus_per_node: int = 8,
    precision: str = "bf16",
    offload: bool = False,
    host_adamw_ns: float = costs.HOST_ADAMW_NS_PER_PARAM,
    fp8_recipe: str = "tensorwise",
    optimizer: str = "adamw",
) -> list[dict]:
    """Every layout that fits, fastest first: ``{"layout", "memory_bytes", "prediction"}`` (``host_adamw_ns``: the
    host AdamW's ns per parameter, with ``offload``; ``fp8_recipe``: the scaling with ``precision`` fp8;
    ``optimizer``: adamw or muon).

    Raises:
        ArgumentError: no layout of the GPUs fits (the message says the smallest memory any layout needs).
        ValueError: ``precision`` or ``fp8_recipe`` unknown, or fp8 on a GPU without FP8 (``costs.check_precision``).
    """
    costs.check_precision(costs.Layout(precision=precision, fp8_recipe=fp8_recipe), device)
    meta = costs.MetaModel(cfg)
    fitting, smallest = [], None
    for layout in candidates(cfg, gpus, global_batch_size, gpus_per_node, precision, offload, fp8_recipe, optimizer):
        mem = costs.memory(meta, layout)
        smallest = mem["total"] if smallest is None else min(smallest, mem["total"])
        if costs.fits(mem["total"], device):
            fitting.append(
                {
                    "layout": layout,
                    "memory_bytes": mem["total"],
                    "prediction": costs.predict(meta, layout, device, gpus_per_node, host_adamw_ns),
                }
            )
    if not fitting:
        need = f"; the leanest needs {human(smallest, 'B')} per GPU" if smallest is not None else ""
        raise ArgumentError(
            f"no layout of {gpus} GPUs fits {cfg.model} ({human(meta.parameters)} parameters) on "
            f"{device.name} ({device.memory_gb:g} GB){need}: use more GPUs or a smaller model"
        )
    # ties (layouts predicted equal) go to the less memory-hungry one
    fitting.sort(key=lambda r: (round(r["prediction"]["step_s"], 9), r["memory_bytes"]))
    return fitting


COMPUTE_SPLIT = ("gemm_16_s", "gemm_fp8_s", "elementwise_s", "quantize_s", "optimizer_s")


def fp8_speedup(
    cfg: ModelConfig,
    gpus: int,
    global_batch_size: int,
    device: costs.Device,
    gpus_per_node: int = 8,
    fp8_recipe: str = "tensorwise",
) -> dict:
    """The predicted bf16 over fp8 step time of ``cfg`` on ``gpus`` GPUs: ``{"best": the fastest bf16 layout's
    step over the fastest fp8 layout's, "same_layout": the fastest bf16 layout's step over the same layout's in fp8,
    "bf16", "fp8": each precision's fastest (``rank``'s rows), "fp8_same_layout": ``costs.predict`` of the bf16
    layout in fp8, "fp8_same_layout_memory_bytes"}``.

    Raises:
        ValueError: the GPU has no FP8 (``costs.check_precision``); ArgumentError: nothing fits.
    """
    bf16 = rank(cfg, gpus, global_batch_size, device, gpus_per_node, "bf16")[0]
    fp8 = rank(cfg, gpus, global_batch_size, device, gpus_per_node, "fp8", fp8_recipe=fp8_recipe)[0]
    meta = costs.MetaModel(cfg)
    same = dataclasses.replace(bf16["layout"], precision="fp8", fp8_recipe=fp8_recipe)
    same_prediction = costs.predict(meta, same, device, gpus_per_node)
    return {
        "best": bf16["prediction"]["step_s"] / fp8["prediction"]["step_s"],
        "same_layout": bf16["prediction"]["step_s"] / same_prediction["step_s"],
        "bf16": bf16,
        "fp8": fp8,
        "fp8_same_layout": same_prediction,
        "fp8_same_layout_memory_bytes": costs.memory(meta, same)["total"],
    }


def _zero(layout: dict) -> str:
    """The ZeRO stage of a JSON layout, as the table prints it: 0, 1 (ZeRO-1), 2 or 3 (FSDP2)."""
    stage = 3 if layout.get("fsdp") else 2 if layout.get("zero2") else 1 if layout["distributed_optimizer"] else 0
    return str(stage)


def _train_flags(layout: costs.Layout, source: list[str]) -> list[str]:
    """The ``megakernels train`` flags of a layout (``source``: the model flags), without the device."""
    flags = [*source, "--tp", str(layout.tp), "--pp", str(layout.pp)]
    flags += ["--cp", str(layout.cp)] if layout.cp > 1 else []
    flags += ["--ep", str(layout.ep)] if layout.ep > 1 else []
    if layout.schedule != "1f1b":
        flags += ["--schedule", layout.schedule]
    flags += ["--vpp", str(layout.vpp)] if layout.vpp > 1 and layout.placement == "interleaved" else []
    flags += [
        "--micro-batch-size",
        str(layout.micro_batch_size),
        "--global-batch-size",
        str(layout.global_batch_size),
        "--precision",
        layout.precision,
    ]
    if layout.precision == "fp8" and layout.fp8_recipe != "tensorwise":
        flags += ["--fp8-recipe", layout.fp8_recipe]
    flags += ["--sequence-parallel"] if layout.sequence_parallel else []
    flags += ["--distributed-optimizer"] if layout.distributed_optimizer and not layout.sharded else []
    flags += ["--fsdp"] if layout.fsdp else ["--zero", "2"] if layout.zero2 else []
    flags += ["--fsdp-degree", str(layout.fsdp_degree)] if layout.sharded and layout.fsdp_degree else []
    flags += ["--offload-optimizer"] if layout.offload_optimizer else []
    flags += ["--optimizer", "muon"] if layout.optimizer == "muon" else []
    flags += ["--recompute", layout.recompute] if layout.recompute != "none" else []
    return flags


def nodes_of(layout: costs.Layout, gpus_per_node: int = 8) -> tuple[int, int]:
    """(nodes, GPUs per node) a layout runs on: whole nodes, or part of one."""
    per_node = min(layout.world, gpus_per_node)
    return -(-layout.world // per_node), per_node


def command(layout: costs.Layout, source: list[str], device: str = "cuda", gpus_per_node: int = 8) -> str:
    """The command that runs a layout (``source``: the model flags, e.g. ``--preset NAME``): on GPUs, torchrun with
    one process per GPU — over several nodes, the same command on every node, joining a c10d rendezvous on the first
    (``$MASTER_ADDR``: its address; ``$JOB_ID``: any name the nodes share, new for each job); on the CPU,
    ``megakernels train --nproc N``."""
    flags = [*source, "--device", device, *_train_flags(layout, [])]
    if device != "cuda":
        return "megakernels train " + " ".join(["--nproc", str(layout.world), *flags])
    nodes, per_node = nodes_of(layout, gpus_per_node)
    launcher = f"torchrun --nproc-per-node {per_node}"
    if nodes > 1:
        launcher = (
            f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --rdzv-backend c10d "
            "--rdzv-endpoint $MASTER_ADDR:29500 --rdzv-id $JOB_ID"
        )
    return f"{launcher} -m megakernels_models.cli train " + " ".join(flags)


SBATCH_SCRIPT = "examples/slurm_train.sbatch"


def sbatch_command(layout: costs.Layout, source: list[str], gpus_per_node: int = 8) -> str:
    """The ``sbatch`` line that runs a layout under Slurm with the shipped script (which starts one torchrun per
    node, one rank per GPU, ``--device cuda``, and saves and resumes in ``checkpoints/<job name>``)."""
    nodes, per_node = nodes_of(layout, gpus_per_node)
    return f"sbatch --nodes {nodes} --gpus-per-node {per_node} {SBATCH_SCRIPT} " + " ".join(
        _train_flags(layout, source)
    )


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="rank the parallel layouts of a model on N GPUs by predicted step time")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", metavar="NAME", help="a preset model")
    src.add_argument("--config", metavar="FILE", help="a megakernels train configuration file")
    src.add_argument(
        "--reproduce",
        metavar="CSV",
        nargs="+",
        help="published training runs (one a row: model, layout, GPU, published metric) through the step-time "
        "model: predicted beside published, the error per row and its median and 90th percentile "
        "(planning/reproduce.py names the columns)",
    )
    p.add_argument("--gpus", type=int, help="GPUs in the job (required with --preset/--config)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu", choices=sorted(costs.DEVICES), default="h200")
    p.add_argument("--seq-length", type=int, default=None, help="overrides the model's")
    p.add_argument("--global-batch-size", type=int, default=None, help="default: the config's, else 8 × gpus")
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="bf16",
        help="fp8: the transformer blocks' linears in FP8 at the GPU's FP8 peak (H100/H200; refused on A100/V100), "
        "the rest in bf16",
    )
    p.add_argument(
        "--fp8-recipe",
        choices=costs.FP8_RECIPES,
        default="tensorwise",
        help="with --precision fp8: one scale per tensor (tensorwise) or per 1×128 tile / 128×128 block "
        "(blockwise, slower GEMMs: costs.FP8_BLOCKWISE_GEMM)",
    )
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adamw",
        help="muon: the hidden matrices keep one fp32 momentum (not AdamW's two moments) and pay Newton-Schulz's "
        "GEMMs in the step (over tp and the ZeRO-1 / FSDP owners)",
    )
    p.add_argument(
        "--offload-optimizer",
        action="store_true",
        help="plan with the optimizer state in host memory "
        "(device memory drops by the optimizer state; the host AdamW and the transfers not hidden are "
        "added to the step time)",
    )
    p.add_argument(
        "--host-adamw-ns",
        type=float,
        default=costs.HOST_ADAMW_NS_PER_PARAM,
        metavar="NS",
        help="with --offload-optimizer: the host AdamW's ns per parameter of a rank, as `megakernels "
        f"bench --ops adamw_offload` measures it on the target host (default "
        f"{costs.HOST_ADAMW_NS_PER_PARAM})",
    )
    p.add_argument("--top", type=int, default=5, help="how many layouts to print")
    p.add_argument("--json", action="store_true", help="print the ranking as JSON")
    p.set_defaults(_run=main)


def _model(ns) -> tuple[ModelConfig, list[str], int | None]:
    from megakernels_models.arguments import TrainArgs
    from megakernels_models.cli import parse_train_args

    if ns.preset is not None:
        args = parse_train_args(["--preset", ns.preset, "--dry-run"])
        source = ["--preset", ns.preset]
        gbs = None
    else:
        args = parse_train_args(["--config", ns.config, "--dry-run"])
        source = ["--config", ns.config]
        gbs = args.global_batch_size if args.global_batch_size != TrainArgs().global_batch_size else None
    if ns.seq_length is not None:
        args = dataclasses.replace(args, seq_length=ns.seq_length)
        source += ["--seq-length", str(ns.seq_length)]
    try:
        cfg = args.model_config()
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    return cfg, source, gbs


def _reproduce(ns) -> int:
    from megakernels_models.planning import reproduce

    try:
        report = reproduce.reproduce(*ns.reproduce)
    except reproduce.ReproduceError as e:
        print(f"megakernels plan: error: {e}", file=sys.stderr)
        return 2
    if ns.json:
        print(json.dumps(report, indent=1))
    else:
        reproduce.print_report(report)
    return 0 if report["rows"] else 1  # the rows not reproduced are listed with their reasons


def main(ns) -> int:
    if ns.reproduce is not None:
        return _reproduce(ns)
    try:
        if ns.gpus is None:
            raise ArgumentError("--gpus is required with --preset or --config")
        for name in ("gpus", "gpus_per_node", "top"):
            if getattr(ns, name) < 1:
                raise ArgumentError(f"--{name.replace('_', '-')} must be a positive int, got {getattr(ns, name)}")
        if not ns.host_adamw_ns >= 0 or ns.host_adamw_ns == float("inf"):
            raise ArgumentError(f"--host-adamw-ns must be a finite number >= 0, got {ns.host_adamw_ns}")
        cfg, source, gbs = _model(ns)
        gbs = ns.global_batch_size or gbs or 8 * ns.gpus
        device = costs.DEVICES[ns.gpu]
        if ns.optimizer == "muon" and ns.offload_optimizer:
            raise ArgumentError("--offload-optimizer steps AdamW on the host; --optimizer muon runs on the device")
        if ns.fp8_recipe != "tensorwise" and ns.precision != "fp8":
            raise ArgumentError(f"--fp8-recipe {ns.fp8_recipe} needs --precision fp8, got --precision {ns.precision}")
        ranked = rank(
            cfg,
            ns.gpus,
            gbs,
            device,
            ns.gpus_per_node,
            ns.precision,
            ns.offload_optimizer,
            ns.host_adamw_ns,
            ns.fp8_recipe,
            ns.optimizer,
        )
    except (ArgumentError, ValueError) as e:
        print(f"megakernels plan: error: {e}", file=sys.stderr)
        return 2
    best = ranked[: ns.top]
    rows = [
        {
            "rank": i + 1,
            "layout": dataclasses.asdict(r["layout"]),
            "memory_per_gpu_bytes": r["memory_bytes"],
            **{k: r["prediction"][k] for k in ("step_s", "tokens_per_s", "mfu", "bubble_fraction")},
            "time_split_s": {
                k: r["prediction"][k]
                for k in ("compute_s", "bubble_s", "tp_s", "pp_s", "cp_s", "dp_s", "ep_s", "offload_s")
            },
            "compute_split_s": {k: r["prediction"][k] for k in COMPUTE_SPLIT},
            "command": command(r["layout"], source, gpus_per_node=ns.gpus_per_node),
            "sbatch": sbatch_command(r["layout"], source, gpus_per_node=ns.gpus_per_node),
            "nodes": nodes_of(r["layout"], ns.gpus_per_node)[0],
        }
        for i, r in enumerate(best)
    ]
    if ns.json:
        print(
            json.dumps(
                {
                    "gpus": ns.gpus,
                    "gpu": device.name,
                    "global_batch_size": gbs,
                    "precision": ns.precision,
                    **({"fp8_recipe": ns.fp8_recipe} if ns.precision == "fp8" else {}),
                    "layouts_fitting": len(ranked),
                    "ranking": rows,
                },
                indent=1,
            )
        )
        return 0
    print(
        f"{cfg.model} {human(costs.MetaModel(cfg).parameters)} parameters on {ns.gpus} × {device.name} "
        f"({ns.gpus_per_node} per node), global batch {gbs} × {cfg.seq_length} tokens, {ns.precision}"
        + (f" ({ns.fp8_recipe} scaling)" if ns.precision == "fp8" else "")
        + f": {len(ranked)} layouts fit"
    )
    print(
        f"{'#':>2} {'tp':>3} {'pp':>3} {'vpp':>3} {'schedule':>8} {'cp':>3} {'ep':>3} {'dp':>5} {'mbs':>4} "
        f"{'recompute':>9} {'zero':>4} {'GB/GPU':>7} {'step s':>8} {'tok/s':>10} {'MFU':>6} {'bubble':>7}"
    )
    for row in rows:
        L = row["layout"]
        print(
            f"{row['rank']:>2} {L['tp']:>3} {L['pp']:>3} {L['vpp']:>3} {L['schedule']:>8} {L['cp']:>3} {L['ep']:>3} "
            f"{L['dp']:>5} {L['micro_batch_size']:>4} {L['recompute']:>9} {_zero(L):>4} "
            f"{row['memory_per_gpu_bytes'] / 1e9:>7.1f} {row['step_s']:>8.3f} {row['tokens_per_s']:>10.0f} "
            f"{row['mfu']:>6.1%} {row['bubble_fraction']:>7.1%}"
        )
    if ns.offload_optimizer:
        best_prediction = ranked[0]["prediction"]
        line = costs.describe_offload(best_prediction, ns.host_adamw_ns)
        print(f"\noffloaded optimizer in the best layout's step: {line}")
    best_row = rows[0]
    if best_row["nodes"] > 1:
        print(
            f"\nrun the best on {best_row['nodes']} nodes of {min(ns.gpus, ns.gpus_per_node)} GPUs: the same command "
            "on every node ($MASTER_ADDR: the first node's address, $JOB_ID: a name for the job)\n  "
            + best_row["command"]
            + "\nor under Slurm, with the shipped script:\n  "
            + best_row["sbatch"]
        )
    else:
        print("\nrun the best:\n  " + best_row["command"])
    return 0
