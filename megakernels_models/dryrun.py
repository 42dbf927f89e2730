"""``megakernels train --dry-run``: what a run would cost, computed without allocating the model.

The model is built on the meta device (shapes only; seconds even for GPT-8.3B), so the parameter count is the real
model's. Per-device numbers follow the layout:

- parameters per device: sharded tensors (``params.is_tensor_parallel``) divided by tp (the vocabulary padded to 128·tp),
  replicated ones whole, layers split over pipeline stages; the most loaded stage is reported;
- weights + gradients + optimizer state per parameter, Megatron-LM's accounting: bf16/fp16 training keeps 2-byte
  weights, 4-byte fp32 gradients and 12 bytes of fp32 master weight + Adam moments (18 bytes), the distributed
  optimizer shards the 12 over dp (6 + 12/dp); fp32 training 4 + 4 + 8;
- activations per Korthikanti et al. 2022 (``ModelConfig.activation_bytes_per_layer``) for the layers of a stage,
  times the micro-batches the schedule keeps in flight on the first stage (1F1B: pp, so the whole model's layers'
  worth; interleaved: × (1 + (pp−1)/(pp·vpp)); GPipe: all m), plus the last stage's logits;
- FLOPs per step: model FLOPs (what MFU counts) and executed FLOPs (with recomputation).
"""

from __future__ import annotations

import json
import re
import time

import torch.distributed as dist

from megakernels.parallel.embedding import pad_vocab_size
from megakernels.parallel.params import is_tensor_parallel
from megakernels_models.arguments import ArgumentError, TrainArgs, validate
from megakernels_models.config import ModelConfig, human, stage_layers


def _meta_model(cfg: ModelConfig):
    from megakernels.parallel.launch import single_process_world
    from megakernels_models.tasks import task_for

    if dist.is_initialized():
        raise ArgumentError("--dry-run runs in one process; run it without torchrun")
    with single_process_world(parallel=True):
        return task_for(cfg).build_chunk(0, device="meta", attention="torch")


def _params_per_stage(model, cfg: ModelConfig, tp: int, pp: int, vpp: int) -> list[int]:
    owner = {}
    for r, chunks in enumerate(stage_layers(cfg.num_layers, pp, vpp)):
        for layers in chunks:
            for i in layers:
                owner[i] = r
    vocab_local = pad_vocab_size(cfg.vocab_size, tp) // tp
    stages = [0] * pp
    kv_copies = max(1, tp // cfg.num_kv_heads)  # key/value heads replicated when tp exceeds them
    for name, p in model.named_parameters():
        if name in ("embedding.word.weight", "output_layer.weight"):
            n = vocab_local * cfg.hidden_size
        elif name == "mlm_bias":
            n = vocab_local
        elif name.endswith("attention.kv.weight") or name.endswith("attention.kv.bias"):
            n = p.numel() * kv_copies // tp
        elif is_tensor_parallel(p):
            n = p.numel() // tp
        else:
            n = p.numel()
        layer = re.match(r"layers\.(\d+)\.", name)
        if layer:
            stages[owner[int(layer.group(1))]] += n
        elif name.startswith("embedding."):
            stages[0] += n
        else:
            stages[-1] += n
    if pp > 1 and cfg.tie_embeddings:
        stages[-1] += vocab_local * cfg.hidden_size  # the last stage's copy of the tied word embedding
    return stages


def report(args: TrainArgs, cfg: ModelConfig | None = None, out=print) -> dict:
    """Build the model on the meta device and report its costs (printed with ``out``; written to ``--log-jsonl`` as
    one JSON object). ``cfg`` is ``validate(args)``'s result (validated here when not given). Returns the report."""
    t0 = time.perf_counter()
    cfg = validate(args) if cfg is None else cfg
    tp, pp, vpp, dp, cp = args.tp, args.pp, args.vpp or 1, args.data_parallel_size(), args.cp
    world, m, mbs = args.world_size(), args.num_microbatches(), args.micro_batch_size
    model = _meta_model(cfg)
    total = sum(p.numel() for p in model.parameters())
    stages = _params_per_stage(model, cfg, tp, pp, vpp)
    half = args.precision != "fp32"
    weight_b, grad_b, opt_b = (2, 4, 12) if half else (4, 4, 8)
    if args.distributed_optimizer:
        opt_b = opt_b / (dp * cp)  # ZeRO-1 shards over the data- and context-parallel ranks
    bytes_el = 2 if half else 4
    flash = args.attention == "flash"
    per_layer = cfg.activation_bytes_per_layer(mbs, tp, args.sequence_parallel, args.recompute, bytes_el, flash, cp)
    layers_per_stage = cfg.num_layers // pp
    if vpp > 1:
        in_flight = pp * (1 + (pp - 1) / (pp * vpp))
    elif args.schedule == "gpipe":
        in_flight = m
    else:
        in_flight = min(pp, m)
    act_first = per_layer * layers_per_stage * in_flight
    logits = cfg.seq_length // cp * mbs * pad_vocab_size(cfg.vocab_size, tp) / tp * 4  # fp32, kept for backward
    mem = []
    for r, n in enumerate(stages):
        act = act_first if r == 0 else per_layer * layers_per_stage * max(1.0, in_flight - r)
        if r == pp - 1:
            act += logits
        mem.append({"weights": n * weight_b, "grads": n * grad_b, "optimizer": n * opt_b, "activations": act})
    totals = [sum(x.values()) for x in mem]
    worst = max(range(pp), key=lambda r: totals[r])
    tokens = args.global_batch_size * cfg.seq_length
    rep = {
        "model": cfg.model, "preset": args.preset_name(), "parameters": total,
        "parameters_per_device": max(stages),
        "flops_per_step": cfg.flops_per_token("none") * tokens,
        "flops_per_step_executed": cfg.flops_per_token(args.recompute) * tokens,
        "memory_per_device_bytes": totals[worst],
        "memory_breakdown_bytes": mem[worst],
        "layout": {"tp": tp, "cp": cp, "pp": pp, "vpp": vpp, "dp": dp, "world": world, "microbatches": m,
                   "sequence_parallel": args.sequence_parallel, "distributed_optimizer": args.distributed_optimizer,
                   "recompute": args.recompute, "precision": args.precision},
        "ranks": {r: {"tp": r % tp, "cp": (r // tp) % cp, "dp": (r // (tp * cp)) % dp, "pp": r // (tp * cp * dp)}
                  for r in range(min(world, 4096))},
    }
    # The same stage's activations under every recompute / sequence-parallel choice (for choosing one).
    rep["activations_by_choice_bytes"] = {
        f"recompute={rc},sp={sp}": cfg.activation_bytes_per_layer(mbs, tp, sp, rc, bytes_el, flash, cp)
        * layers_per_stage * in_flight for rc in ("none", "selective", "full") for sp in (False, True)}
    if pp > 1:
        from megakernels.parallel.pipeline import bubble_fraction, format_schedule
        name = "interleaved" if vpp > 1 else args.schedule
        rep["bubble_fraction"] = bubble_fraction(name, pp, m, vpp)
        if pp <= 8 and m * vpp <= 32:
            rep["schedule"] = format_schedule(name, pp, m, vpp)
    rep["seconds"] = time.perf_counter() - t0
    _print(rep, cfg, out)
    if args.log_jsonl:
        with open(args.log_jsonl, "a", encoding="utf-8") as f:
            f.write(json.dumps({k: v for k, v in rep.items() if k != "ranks"}) + "\n")
    return rep


def _print(rep: dict, cfg: ModelConfig, out) -> None:
    lay = rep["layout"]
    out(f"{rep['preset'] or cfg.model}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads, "
        f"seq {cfg.seq_length}, vocab {cfg.vocab_size}")
    out(f"parameters: {human(rep['parameters'])} total, {human(rep['parameters_per_device'])} on the most loaded "
        "device")
    out(f"FLOPs per step: {human(rep['flops_per_step'], 'FLOP')} (model), "
        f"{human(rep['flops_per_step_executed'], 'FLOP')} executed with recompute={lay['recompute']}")
    b = rep["memory_breakdown_bytes"]
    out(f"memory per device: {human(rep['memory_per_device_bytes'], 'B')} = weights {human(b['weights'], 'B')} "
        f"+ grads {human(b['grads'], 'B')} + optimizer {human(b['optimizer'], 'B')} "
        f"+ activations {human(b['activations'], 'B')}")
    out(f"layout: tp={lay['tp']} cp={lay['cp']} pp={lay['pp']} vpp={lay['vpp']} dp={lay['dp']} (world {lay['world']}), "
        f"{lay['microbatches']} micro-batches per step, sequence_parallel={lay['sequence_parallel']}, "
        f"distributed_optimizer={lay['distributed_optimizer']}, precision={lay['precision']}")
    out("activations on the first stage by choice (Korthikanti et al. 2022): " + ", ".join(
        f"{k} {human(v, 'B')}" for k, v in rep["activations_by_choice_bytes"].items()))
    if "bubble_fraction" in rep:
        out(f"pipeline bubble: {rep['bubble_fraction']:.3f} of the step's useful time")
    if "schedule" in rep:
        out(rep["schedule"])
    ranks = rep["ranks"]
    if len(ranks) <= 64:
        out("rank -> (tp, cp, pp, dp): " + ", ".join(f"{r}:({c['tp']},{c['cp']},{c['pp']},{c['dp']})"
                                                     for r, c in ranks.items()))
    out(f"(computed in {rep['seconds']:.2f} s on the meta device)")
