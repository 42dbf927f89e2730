"""``megakernels train --dry-run``: what a run would cost, computed without allocating the model.

The model is built on the meta device (shapes only; seconds even for GPT-8.3B), so the parameter count is the real
model's; memory per device follows the layout by ``costs.memory`` (weights, gradients, optimizer state and
activations, Megatron-LM's and Korthikanti et al.'s accounting). FLOPs per step: model FLOPs (what MFU counts) and
executed FLOPs (with recomputation). A layout that is likely poor gets a warning pointing to ``megakernels plan``:
a pipeline bubble over 25 %, tensor parallelism wider than a node (``--gpus-per-node``), or a device more than 90 %
full (on the ``--gpu`` it is planned for). With ``--precision fp8`` the memory is FP8 training's (the blocks' linears
keep FP8 copies of their inputs for backward: ``costs.activation_bytes_per_layer``) and the report names the
scaling recipe; a ``--gpu`` without FP8 tensor cores (A100, V100) is refused.
"""

from __future__ import annotations

import dataclasses
import json
import time

import torch.distributed as dist

from megakernels_models.arguments import ArgumentError, TrainArgs, validate
from megakernels_models.models.config import RECOMPUTE, ModelConfig, human
from megakernels_models.planning import costs, layout_rules


def _offload_seconds(meta: costs.MetaModel, layout: costs.Layout, args: TrainArgs) -> dict:
    """``costs.predict``'s optimizer-offload terms on ``--gpu`` (host AdamW at ``costs.HOST_ADAMW_NS_PER_PARAM``)."""
    pred = costs.predict(meta, layout, costs.DEVICES[args.gpu], args.gpus_per_node)
    terms = {k: pred[k] for k in ("offload_s", "host_adam_s", "d2h_s", "h2d_s")}
    return {"device": costs.DEVICES[args.gpu].name, **terms}


def warnings_for(args: TrainArgs, rep: dict) -> list[str]:
    """What looks poor about a layout (see the module docstring)."""
    out = []
    if rep.get("bubble_fraction", 0.0) > 0.25:
        out.append(
            f"the pipeline bubble is {rep['bubble_fraction']:.0%} of the step: raise the micro-batches per "
            "step (global batch / (micro batch × dp)), interleave (--vpp) or use fewer stages"
        )
    if args.tp > args.gpus_per_node:
        out.append(
            f"--tp {args.tp} spans more than a node ({args.gpus_per_node} GPUs): its per-layer all-reduces "
            "would cross the network"
        )
    device = costs.DEVICES[args.gpu]
    if rep["memory_per_device_bytes"] > 0.9 * device.memory_gb * 1e9:
        out.append(
            f"{human(rep['memory_per_device_bytes'], 'B')} per device is more than 90 % of an {device.name}'s "
            f"{device.memory_gb:g} GB"
        )
    out = [w + "; `megakernels plan` ranks the layouts that fit" for w in out]
    if args.precision == "fp8" and args.fp8_base_precision == "fp32":
        out.append(
            "--fp8-base-precision fp32: the memory above counts fp8 training on a bf16 base (2-byte weights and "
            "16-bit activations); an fp32 base takes 4 bytes for each"
        )
    return out


def report(args: TrainArgs, cfg: ModelConfig | None = None, out=print) -> dict:
    """Build the model on the meta device and report its costs (printed with ``out``; written to ``--log-jsonl`` as
    one JSON object). ``cfg`` is ``validate(args)``'s result (validated here when not given). Returns the report."""
    t0 = time.perf_counter()
    cfg = validate(args) if cfg is None else cfg
    if dist.is_initialized():
        raise ArgumentError("--dry-run runs in one process; run it without torchrun")
    L = costs.Layout.of(args, cfg)
    try:
        costs.check_precision(L, costs.DEVICES[args.gpu])
    except ValueError as e:
        raise ArgumentError(f"{e} (--gpu {args.gpu})") from None
    meta = costs.MetaModel(cfg)
    mem = costs.memory(meta, L)
    tokens = args.global_batch_size * cfg.seq_length
    world, tp, cp, dp = args.world_size(), L.tp, L.cp, L.dp
    parallel = layout_rules.layout_of(args)  # the rank order's one definition
    rep = {
        "model": cfg.model,
        "preset": args.preset_name(),
        "parameters": meta.parameters,
        "active_parameters": meta.active_parameters,
        # as some model cards count them: the input embedding is a lookup of one row a token, not a product
        "active_parameters_without_embedding": meta.active_parameters - cfg.vocab_size * cfg.hidden_size,
        "parameters_per_device": mem["parameters_per_device"],
        **({"trained_parameters_per_device": mem["trained_parameters_per_device"]} if L.frozen else {}),
        **({"expert_memory_per_device_bytes": mem["expert_bytes"]} if cfg.num_experts else {}),
        "flops_per_step": cfg.flops_per_token("none") * tokens,
        "flops_per_step_executed": cfg.flops_per_token(args.recompute) * tokens,
        **cfg.report()[0],
        "memory_per_device_bytes": mem["total"],
        "memory_breakdown_bytes": mem["breakdown"],
        **({"host_memory_per_rank_bytes": mem["host_optimizer_bytes"]} if args.offload_optimizer else {}),
        **(
            {
                "offload_seconds": _offload_seconds(meta, L, args),
                "device_bytes_per_param": sum(costs.bytes_per_param(L)),
                **({"fsdp_shard_ranks": L.shard_ranks()} if L.sharded else {}),
            }
            if args.offload_optimizer
            else {}
        ),
        "layout": {
            "tp": tp,
            "cp": cp,
            "ep": args.ep,
            "pp": L.pp,
            "vpp": L.vpp,
            "schedule": args.schedule if L.pp > 1 else None,
            "dp": dp,
            "world": world,
            "microbatches": L.microbatches,
            "sequence_parallel": args.sequence_parallel,
            "distributed_optimizer": args.distributed_optimizer,
            "zero": args.zero_stage(),
            "fsdp_degree": args.fsdp_degree,
            "offload_optimizer": args.offload_optimizer,
            "recompute": args.recompute,
            "precision": args.precision,
            "optimizer": args.optimizer,
            **({"fp8_recipe": L.fp8_recipe} if L.precision == "fp8" else {}),
            **({"frozen": list(L.frozen)} if L.frozen else {}),
        },
        "ranks": {r: parallel.rank_coordinates(r) for r in range(min(world, 4096))},
    }
    # The first stage's activations under every recompute / sequence-parallel choice (for choosing one).
    rep["activations_by_choice_bytes"] = {
        f"recompute={rc},sp={sp}": costs.activation_bytes_per_layer(
            cfg, dataclasses.replace(L, recompute=rc, sequence_parallel=sp)
        )
        * (cfg.num_layers // L.pp)
        * mem["in_flight"]
        for rc in RECOMPUTE
        for sp in (False, True)
    }
    if L.pp > 1:
        from megakernels.parallel.pipeline import format_schedule

        name = "interleaved" if L.vpp > 1 and L.placement == "interleaved" else args.schedule
        # the zero-bubble schedules' bubble at the model's forward / input- / weight-gradient times (FLOPs)
        rep["bubble_fraction"] = costs.pipeline_bubble(cfg, L)
        if L.pp <= 8 and L.microbatches * L.vpp <= 32:  # drawn at the paper's equal F, B and W times
            rep["schedule"] = format_schedule(name, L.pp, L.microbatches, L.vpp)
    rep["warnings"] = warnings_for(args, rep)
    rep["seconds"] = time.perf_counter() - t0
    _print(rep, cfg, out)
    if args.log_jsonl:
        with open(args.log_jsonl, "a", encoding="utf-8") as f:
            f.write(json.dumps({k: v for k, v in rep.items() if k != "ranks"}) + "\n")
    return rep


def _attention_kinds(cfg: ModelConfig) -> str:
    """The header's note on the layers' attention: windows (per layer type) and sinks."""
    note = ""
    if cfg.layer_types is not None:
        sliding = cfg.layer_types.count("sliding_attention")
        note = f", {sliding} sliding-window ({cfg.sliding_window}) and {cfg.num_layers - sliding} full attention layers"
    elif cfg.sliding_window:
        note = f", sliding window {cfg.sliding_window}"
    return note + (", attention sinks" if cfg.sinks else "")


def _print(rep: dict, cfg: ModelConfig, out) -> None:
    lay = rep["layout"]
    out(
        f"{rep['preset'] or cfg.model}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads, "
        f"seq {cfg.seq_length}, vocab {cfg.vocab_size}" + _attention_kinds(cfg)
    )
    out(
        f"parameters: {human(rep['parameters'])} total, {human(rep['parameters_per_device'])} on the most loaded "
        "device"
        + (
            f"; {human(rep['active_parameters'])} active per token "
            f"({human(rep['active_parameters_without_embedding'])} without the input embedding; "
            f"{cfg.num_experts} experts, top {cfg.moe_top_k})"
            if cfg.num_experts
            else ""
        )
        + (
            f"; {human(rep['trained_parameters_per_device'])} trained on it (--freeze {','.join(lay['frozen'])}: "
            "the frozen ones have no gradients or optimizer state)"
            if "trained_parameters_per_device" in rep
            else ""
        )
    )
    if "expert_memory_per_device_bytes" in rep:
        out(
            f"expert weights, gradients and optimizer state per device: "
            f"{human(rep['expert_memory_per_device_bytes'], 'B')} (ep={lay['ep']})"
        )
    for line in cfg.report()[1]:
        out(line)
    out(
        f"FLOPs per step: {human(rep['flops_per_step'], 'FLOP')} (model), "
        f"{human(rep['flops_per_step_executed'], 'FLOP')} executed with recompute={lay['recompute']}"
    )
    b = rep["memory_breakdown_bytes"]
    out(
        f"memory per device: {human(rep['memory_per_device_bytes'], 'B')} = weights {human(b['weights'], 'B')} "
        f"+ grads {human(b['grads'], 'B')} + optimizer {human(b['optimizer'], 'B')} "
        f"+ activations {human(b['activations'], 'B')}"
    )
    shards = rep.get("fsdp_shard_ranks")
    if "device_bytes_per_param" in rep:
        weight = 4 if lay["precision"] == "fp32" else 2
        dtype = "bf16" if lay["precision"] == "fp8" else lay["precision"]  # fp8 training keeps bf16 weights
        parts = (
            f"(4 + 4) / {shards} (the fp32 sharded parameters and gradients over the {shards} shard ranks, besides "
            "the gathered copies of the layers at work)"
            if shards
            else f"{weight} ({dtype} weights) + 4 (the fp32 gradient buffer, kept whole on the device for accumulation "
            "and the reduction, also under ZeRO-1)"
        )
        out(
            f"device memory per parameter (--offload-optimizer): {rep['device_bytes_per_param']:g} bytes = {parts}; "
            "no optimizer state"
        )
    if "host_memory_per_rank_bytes" in rep:
        over = f" / {shards} shard ranks" if shards else " / dp" if lay["distributed_optimizer"] else ""
        out(
            f"host memory per rank (--offload-optimizer: fp32 master, Adam moments and a gradient copy, 16 bytes per "
            f"parameter{over}): {human(rep['host_memory_per_rank_bytes'], 'B')}"
        )
        out(
            f"offloaded optimizer per step on an {rep['offload_seconds']['device']}: "
            f"{costs.describe_offload(rep['offload_seconds'], costs.HOST_ADAMW_NS_PER_PARAM)}"
        )
    out(
        f"layout: tp={lay['tp']} cp={lay['cp']} pp={lay['pp']} vpp={lay['vpp']} dp={lay['dp']} (world {lay['world']}), "
        + (f"schedule {lay['schedule']}, " if lay["schedule"] else "")
        + f"{lay['microbatches']} micro-batches per step, sequence_parallel={lay['sequence_parallel']}, "
        f"distributed_optimizer={lay['distributed_optimizer']}, zero={lay.get('zero', 0)}, "
        f"optimizer={lay.get('optimizer', 'adamw')}, precision={lay['precision']}"
        + (
            f" ({lay['fp8_recipe']} scaling: the blocks' linears in FP8, their inputs kept in FP8 for backward)"
            if "fp8_recipe" in lay
            else ""
        )
    )
    out(
        "activations on the first stage by choice (Korthikanti et al. 2022): "
        + ", ".join(f"{k} {human(v, 'B')}" for k, v in rep["activations_by_choice_bytes"].items())
    )
    if "bubble_fraction" in rep:
        out(f"pipeline bubble: {rep['bubble_fraction']:.3f} of the step's useful time")
    if "schedule" in rep:
        out(rep["schedule"])
    ranks = rep["ranks"]
    if len(ranks) <= 64:
        out(
            "rank -> (tp, cp, pp, dp): "
            + ", ".join(f"{r}:({c['tp']},{c['cp']},{c['pp']},{c['dp']})" for r, c in ranks.items())
        )
    for w in rep["warnings"]:
        out(f"warning: {w}")
    out(f"(computed in {rep['seconds']:.2f} s on the meta device)")
