"""The training loop: one loop for GPT and BERT over any (tensor, pipeline, data)-parallel layout.

Per optimizer step (every rank):

1. take this data-parallel rank's share of global batch ``step`` (``data.datasets``: the same global batches for
   every layout) and cut it into micro-batches;
2. run the pipeline schedule (``megakernels.parallel.pipeline``): forward and backward of every micro-batch through
   this rank's model chunks, the data-parallel wrapper reducing each gradient bucket as soon as the last
   micro-batch's backward has produced it (overlapped with the rest of backward);
3. finish the gradient reduction, sum the tied word embedding's gradient over the first and last pipeline stage and
   the sequence-parallel replicated parameters' gradients over the tensor-parallel group (``finalize_model_grads``);
4. the optimizer step (``megakernels.parallel.optimizer``): loss-scale check, global grad-norm clipping, AdamW with
   fp32 master weights (sharded over data parallelism with ``--distributed-optimizer``), learning-rate schedule.

The loss is normalised by the number of target tokens in the whole global batch (not per micro-batch or per
rank), so its value and gradient do not depend on how the batch is split: with dropout 0 in fp32 every layout's
loss curve equals the single process's (DESIGN.md §4). The last rank (last pipeline stage) logs.

``train(args)`` runs on an initialised ``torch.distributed`` world; ``run(args)`` makes one (a single process,
``--nproc`` spawned local processes, or torchrun's) and calls it.
"""

from __future__ import annotations

import json
import math
import os
import time

import torch
import torch.distributed as dist

import megakernels.parallel as mpu
from megakernels.optim.loss_scaler import DynamicLossScaler
from megakernels_models import checkpoint, dryrun
from megakernels_models.arguments import TrainArgs, validate
from megakernels_models.bert import BertModel
from megakernels_models.config import ModelConfig, stage_layers
from megakernels_models.data.build import build_datasets
from megakernels_models.data.datasets import collate, global_batch_indices
from megakernels_models.gpt import GPTModel
from megakernels_models.timers import StepTimers


# ---- building blocks ------------------------------------------------------------------------------------------

def build_model_chunks(cfg: ModelConfig, args: TrainArgs, device) -> list[torch.nn.Module]:
    """This rank's model chunks (one per virtual pipeline stage), parameters in the training precision."""
    pp, pp_rank, vpp = mpu.pp_size(), mpu.pp_rank(), args.vpp or 1
    cls = GPTModel if cfg.model == "gpt" else BertModel
    chunks = []
    for c, layers in enumerate(stage_layers(cfg.num_layers, pp, vpp)[pp_rank]):
        m = cls(cfg, args.seed, layers=layers, pre_process=pp_rank == 0 and c == 0,
                post_process=pp_rank == pp - 1 and c == vpp - 1, sequence_parallel=args.sequence_parallel,
                attention=args.attention, recompute=args.recompute, device=device)
        chunks.append(m.to(args.param_dtype()))
    return chunks


def device_peak_tflops(args: TrainArgs, device: torch.device) -> float:
    """Peak dense TFLOP/s of one device in the training precision: ``--peak-tflops``, a table for datacenter GPUs,
    or measured on the CPU (a matmul timed on this process's threads)."""
    if args.peak_tflops:
        return float(args.peak_tflops)
    half = args.precision != "fp32"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (bf16, fp32) in {"H200": (989.0, 67.0), "H100": (989.0, 67.0), "A100": (312.0, 19.5)}.items():
            if key in name:
                return bf16 if half else fp32
        return float("nan")
    n, dtype = 512, args.param_dtype()
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    best = 0.0
    for _ in range(5):  # the best of a few short trials: a busy machine lowers single trials
        reps, t0 = 0, time.perf_counter()
        while reps < 2 or time.perf_counter() - t0 < 0.05:
            a @ b
            reps += 1
        best = max(best, 2.0 * n ** 3 * reps / (time.perf_counter() - t0) / 1e12)
    return best


# ---- the loop -------------------------------------------------------------------------------------------------

class _Logger:
    """Progress bar, JSONL and TensorBoard on the logging rank; nothing elsewhere."""

    def __init__(self, args: TrainArgs, enabled: bool, start_step: int):
        self.enabled, self.records = enabled, []
        self.bar = self.jsonl = self.tb = None
        if not enabled:
            return
        if args.progress:
            from tqdm import tqdm
            self.bar = tqdm(total=args.steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
        if args.log_jsonl:
            os.makedirs(os.path.dirname(os.path.abspath(args.log_jsonl)), exist_ok=True)
            self.jsonl = open(args.log_jsonl, "a", encoding="utf-8")
        if args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(args.tensorboard)

    def log(self, rec: dict) -> None:
        if not self.enabled:
            return
        self.records.append(rec)
        if self.jsonl:
            self.jsonl.write(json.dumps(rec) + "\n")
            self.jsonl.flush()
        if self.tb:
            for k, v in rec.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self.tb.add_scalar(f"train/{k}" if not k.startswith("val_") else f"valid/{k[4:]}", v, rec["step"])
        if self.bar:
            post = {"loss": f"{rec['loss']:.4f}", "tok/s": f"{rec['tokens_per_s']:.0f}"}
            if "val_loss" in rec:
                post["val"] = f"{rec['val_loss']:.4f}"
            self.bar.set_postfix(post, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        for h in (self.bar, self.jsonl, self.tb):
            if h is not None:
                h.close()


def train(args: TrainArgs) -> list[dict] | None:
    """Train on the current ``torch.distributed`` world; returns the per-step records on the logging rank (the last
    rank), None elsewhere."""
    cfg = validate(args)
    mpu.initialize(args.tp, args.pp, vpp=args.vpp)
    try:
        return _train(cfg, args)
    finally:
        mpu.destroy()


def _train(cfg: ModelConfig, args: TrainArgs) -> list[dict] | None:
    from megakernels.optim.lr_schedule import WarmupCosineSchedule
    from megakernels.parallel.ddp import DistributedDataParallel, finalize_model_grads
    from megakernels.parallel.optimizer import ParallelOptimizer
    from megakernels.parallel.pipeline import forward_backward

    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    mpu.model_parallel_seed(args.seed, device.type)
    chunks = build_model_chunks(cfg, args, device)
    ddps = [DistributedDataParallel(c, reduce_scatter=args.distributed_optimizer) for c in chunks]
    opt = ParallelOptimizer(ddps, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=args.weight_decay,
                            distributed=args.distributed_optimizer, precision=args.precision, clip_grad=args.clip_grad,
                            loss_scaler=DynamicLossScaler() if args.precision == "fp16" else None)
    schedule = WarmupCosineSchedule(args.lr, args.min_lr, args.warmup_steps, args.steps)
    train_ds, valid_ds, _ = build_datasets(args, cfg)

    world, dp, dp_rank = dist.get_world_size(), mpu.dp_size(), mpu.dp_rank()
    m, mbs = args.num_microbatches(), args.micro_batch_size
    tp = mpu.tp_size()
    seq_shard = cfg.seq_length // tp if args.sequence_parallel else cfg.seq_length
    shape = (seq_shard, mbs, cfg.hidden_size)
    last_stage = mpu.is_pp_last_stage(ignore_virtual=True)
    log_rank = dist.get_rank() == world - 1
    flops_token = cfg.flops_per_token("none")
    peak = device_peak_tflops(args, device) if log_rank else float("nan")
    tokens_per_step = args.global_batch_size * cfg.seq_length
    timers = StepTimers(args.step_timers, device)  # off unless megakernels bench asks (per-phase times)

    def run_batches(dataset, step, forward_only):
        idx = global_batch_indices(step, args.global_batch_size, dp_rank, dp)
        samples = [dataset[i] for i in idx]
        micro = [collate(samples[i * mbs:(i + 1) * mbs], device) for i in range(m)]
        norm = _normalizers(cfg, micro, args.global_batch_size, device)
        losses = []
        scale = opt.loss_scale if not forward_only else 1.0

        def forward_step(chunk, mb, input_tensor):
            model, b = chunks[chunk], micro[mb]
            if cfg.model == "gpt":
                out = model(ids=b["ids"] if model.pre_process else None,
                            labels=b["labels"] if model.post_process else None, hidden=input_tensor)
                if not model.post_process:
                    return out
                loss = out.sum() / norm["tokens"]
            else:
                out = model(ids=b["ids"] if model.pre_process else None, token_types=b["token_types"],
                            padding_mask=b["padding_mask"], mlm_labels=b["mlm_labels"] if model.post_process else None,
                            sop_labels=b["sop_labels"], hidden=input_tensor)
                if not model.post_process:
                    return out
                mlm, sop = out
                loss = mlm.sum() / norm["tokens"] + sop.sum() / norm["samples"]
            losses.append(loss.detach())
            # The data-parallel reduction averages over dp, but the loss is already normalised by the whole
            # global batch: scale by dp so the reduced gradient is that of the global loss.
            factor = scale * dp
            return loss * factor if factor != 1.0 else loss

        forward_backward(timers.wrap_forward(forward_step), m, schedule="interleaved" if (args.vpp or 1) > 1 else
                         ("forward_only" if forward_only else args.schedule), tensor_shape=shape,
                         dtype=args.param_dtype(), device=device, num_chunks=len(chunks), forward_only=forward_only,
                         grad_sync=None if forward_only else (lambda c, on: ddps[c].set_grad_sync(on)))
        total = torch.stack(losses).sum().float() if losses else torch.zeros((), device=device)
        if last_stage and dp > 1:
            dist.all_reduce(total, group=mpu.dp_group())
        return total

    start = 0
    if args.load:
        start = checkpoint.load(checkpoint.read_latest(args.load), chunks, opt, cfg)
    log = _Logger(args, log_rank, start)
    t_start = time.perf_counter()
    try:
        for step in range(start, args.steps):
            t0 = time.perf_counter()
            timers.start()
            for c in chunks:
                c.train()
            opt.zero_grad()
            schedule.apply(opt, step + 1)
            loss = run_batches(train_ds, step, False)
            timers.mark("pipeline")
            finalize_model_grads(ddps)
            timers.mark("communication")
            stepped, grad_norm = opt.step()
            timers.mark("optimizer")
            rec = None
            if log_rank:
                dt = time.perf_counter() - t0
                tps = tokens_per_step / dt
                tflops = flops_token * tps / world / 1e12
                rec = {"step": step + 1, "loss": float(loss), "lr": opt.lr, "grad_norm": grad_norm,
                       "loss_scale": float(opt.loss_scale), "tokens": tokens_per_step * (step + 1),
                       "tokens_per_s": tps, "tflops_per_device": tflops, "mfu": tflops / peak,
                       "elapsed_s": time.perf_counter() - t_start, "skipped": not stepped}
                if step == start:  # measured on the tensors this rank holds (optimizer state exists after a step)
                    n = sum(p.numel() for c in chunks for p in c.parameters())
                    rec["memory_per_param_bytes"] = {k: v / n for k, v in opt.memory_bytes().items()}
            timers.finish(rec)
            if args.eval_interval and valid_ds is not None and ((step + 1) % args.eval_interval == 0
                                                               or step + 1 == args.steps):
                val = evaluate(chunks, lambda s: run_batches(valid_ds, s, True), args.eval_steps)
                if rec is not None:
                    rec["val_loss"], rec["val_ppl"] = val, math.exp(min(val, 700.0))
            if args.save and ((step + 1) % (args.save_interval or args.steps) == 0 or step + 1 == args.steps):
                checkpoint.save(args.save, step + 1, chunks, opt, cfg, args.keep_checkpoints)
            log.log(rec)
    finally:
        log.close()
    return log.records if log_rank else None


def evaluate(chunks, run_batch, steps: int) -> float:
    """Mean loss over ``steps`` global batches of the validation split (forward-only schedule)."""
    for c in chunks:
        c.eval()
    with torch.no_grad():
        total = sum(float(run_batch(s)) for s in range(steps))
    for c in chunks:
        c.train()
    return total / steps


def _normalizers(cfg: ModelConfig, micro: list[dict], global_batch: int, device) -> dict[str, torch.Tensor | int]:
    """Loss denominators of the whole global batch: target tokens (and samples for BERT's SOP)."""
    if cfg.model == "gpt":
        return {"tokens": global_batch * cfg.seq_length}
    count = torch.stack([(b["mlm_labels"] != -100).sum() for b in micro]).sum().to(torch.float32)
    if mpu.dp_size() > 1:
        dist.all_reduce(count, group=mpu.dp_group())
    return {"tokens": count.clamp(min=1.0), "samples": global_batch}


# ---- launching ------------------------------------------------------------------------------------------------

def _spawned(rank: int, world_size: int, args: TrainArgs):
    return train(args)


def run(args: TrainArgs):
    """Validate, then train: in this process (``--nproc 1``), under torchrun (its environment), or on ``--nproc``
    spawned local processes (gloo). ``--dry-run`` reports instead of training. Returns the logging rank's records
    (or the dry-run report).

    Raises:
        ArgumentError: invalid arguments (before any process starts).
        megakernels.parallel.launch.WorldFailed: a spawned rank failed (its error in the message).
    """
    validate(args)
    if args.dry_run:
        return dryrun.report(args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: its environment has the rendezvous
        import datetime
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=args.timeout))
        try:
            return train(args)
        finally:
            dist.destroy_process_group()
    from megakernels.parallel import launch

    if args.nproc == 1:
        if args.device == "cuda":
            torch.cuda.set_device(0)
        with launch.single_process_world(args.device, args.timeout):
            return train(args)
    if args.device == "cuda":
        raise ValueError("--nproc with --device cuda: launch with torchrun --nproc-per-node N instead (NCCL)")

    threads = max(1, (os.cpu_count() or 1) // args.nproc)
    results = launch.run_world(args.nproc, _spawned, args, timeout=args.timeout, threads=threads, world_timeout=None)
    return results[-1]
