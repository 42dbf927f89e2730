"""The training loop: one loop for every model family over any (tensor, pipeline, data)-parallel layout.

Per optimizer step (every rank):

1. take this data-parallel rank's share of global batch ``step`` (``data.datasets``: the same global batches for
   every layout) and cut it into micro-batches;
2. run the pipeline schedule (``megakernels.parallel.pipeline``): forward and backward of every micro-batch through
   this rank's model chunks (the family's ``Task`` turns a micro-batch into a loss), the data-parallel wrapper
   reducing each gradient bucket as soon as the last micro-batch's backward has produced it (with the zero-bubble
   schedules, its last weight-gradient pass); under zb-v's V the loss is made on pipeline rank 0 and broadcast
   over the pipeline so that the last rank logs it;
3. finish the gradient reduction, sum the tied word embedding's gradient over the first and last pipeline stage and
   the sequence-parallel replicated parameters' gradients over the tensor-parallel group (``finalize_model_grads``);
4. the optimizer step (``megakernels.parallel.optimizer``): loss-scale check, global grad-norm clipping, AdamW with
   fp32 master weights (sharded over data parallelism with ``--distributed-optimizer``) — with ``--optimizer muon``
   Muon for the hidden matrices (``megakernels.parallel.muon``) —, learning-rate schedule.

The loss is normalised by the whole global batch (``Task.normalizers``), so its value and gradient do not depend on
how the batch is split: with dropout 0 in fp32 every layout's loss curve equals the single process's
(docs/parallelism.md). The last rank (last pipeline stage) logs.

``train(args)`` runs on an initialised ``torch.distributed`` world; ``run(args)`` validates once and launches one
(``megakernels.parallel.launch.launch``: this process, ``--nproc`` spawned processes, or torchrun's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import megakernels.parallel as mpu
from megakernels.optim.loss_scaler import DynamicLossScaler
from megakernels.optim.lr_schedule import LRSchedule
from megakernels.parallel import fp8, fsdp, watchdog
from megakernels.parallel.context import split_for_cp
from megakernels.parallel.ddp import finalize_model_grads, wrap_model
from megakernels.parallel.moe import set_aux_loss_scale
from megakernels.parallel.moe import stats as moe_stats
from megakernels.parallel.muon import MuonOptions
from megakernels.parallel.optimizer import ParallelOptimizer
from megakernels.parallel.optimizer_memory import grads_summed
from megakernels.parallel.pipeline.executor import forward_backward
from megakernels.parallel.pipeline.schedules import virtual_stage
from megakernels_models.arguments import ArgumentError, TrainArgs, validate
from megakernels_models.config_file import resolved
from megakernels_models.data.build import build_datasets
from megakernels_models.data.datasets import collate, global_batch_indices
from megakernels_models.models.config import ModelConfig, stage_layers, stage_times
from megakernels_models.models.registry import task_for
from megakernels_models.models.tasks import DPOTask, GRPOTask, Task
from megakernels_models.planning import dryrun
from megakernels_models.training import checkpoint, syncpoints
from megakernels_models.training.checkpoint_store import step_name
from megakernels_models.training.checkpointer import Checkpointer
from megakernels_models.training.logger import TrainLogger
from megakernels_models.training.mfu import MFUMeter
from megakernels_models.training.preemption import StopConditions, stop_signals
from megakernels_models.training.timers import StepTimers


def build_model_chunks(task: Task, args: TrainArgs, device) -> list[torch.nn.Module]:
    """This rank's model chunks (one per virtual pipeline stage), parameters in the training precision; those whose
    name contains a part of ``--freeze`` do not require grad (no gradient buffer, no optimizer state)."""
    pp, pp_rank, vpp = mpu.pp_size(), mpu.pp_rank(), args.pipeline_chunks()
    placement = args.pipeline_placement()
    chunks = []
    for c, layers in enumerate(stage_layers(task.config.num_layers, pp, vpp, placement)[pp_rank]):
        stage = virtual_stage(placement, pp, pp_rank, c, vpp)
        chunk = task.build_chunk(
            args.seed,
            layers=layers,
            pre_process=stage == 0,
            post_process=stage == pp * vpp - 1,
            sequence_parallel=args.sequence_parallel,
            attention=args.attention,
            recompute=args.recompute,
            fused_linear_ce=args.fused_head(task.config),
            device=device,
        )
        if args.precision == "fp8":
            fp8.enable(chunk, args.fp8_recipe)
        # FSDP keeps fp32 sharded masters and casts for compute (its mixed-precision policy)
        chunks.append(chunk if args.zero_stage() >= 2 else chunk.to(args.param_dtype()))
    frozen = list(args.frozen_parts())
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if task.is_frozen(name, frozen):
                p.requires_grad_(False)
    return chunks


class PipelineStep:
    """One global batch through this rank's chunks: micro-batching, the schedule, the summed loss."""

    def __init__(self, task: Task, chunks, wrappers, args: TrainArgs, device, timers: StepTimers):
        self.task, self.chunks, self.wrappers, self.args, self.device, self.timers = (
            task,
            chunks,
            wrappers,
            args,
            device,
            timers,
        )
        cfg = task.config
        seq = cfg.tokens_per_sample // mpu.cp_size()  # context parallelism: this rank's two chunks of each sequence
        seq = seq // mpu.tp_size() if args.sequence_parallel else seq
        self.shape = (seq, args.micro_batch_size, cfg.hidden_size)
        self.num_microbatches = args.num_microbatches()
        # zb-v plans its order for the model's forward, input- and weight-gradient times (FLOPs; every rank alike)
        self.durations = stage_times(cfg, args.recompute) if args.schedule == "zb-v" else None
        self.stats: dict | None = None  # a dict: the next step's activation memory (forward_backward's stats)
        self.metrics: dict[str, float] = {}  # the task's metrics of the last global batch (on the logging rank)

    def __call__(self, dataset, step: int, forward_only: bool = False, loss_scale: float = 1.0) -> torch.Tensor:
        """The global batch's loss (on the last stage; zero elsewhere), after forward (and backward)."""
        return self.run(*self.batches(dataset, step), forward_only=forward_only, loss_scale=loss_scale)

    def batches(self, dataset, step: int) -> tuple[list[dict], dict]:
        """This rank's micro-batches of global batch ``step`` of ``dataset`` (under context parallelism its chunks
        of each sequence) and the task's normalizers of the global batch."""
        args, mbs, m = self.args, self.args.micro_batch_size, self.num_microbatches
        dp, cp = mpu.dp_size(), mpu.cp_size()
        samples = [dataset[i] for i in global_batch_indices(step, args.global_batch_size, mpu.dp_rank(), dp)]
        micro = [collate(samples[i * mbs : (i + 1) * mbs], self.device) for i in range(m)]
        norm = self.task.normalizers(micro, args.global_batch_size, self.device)
        if cp > 1:  # this rank's two chunks of every sequence (packed documents' ids stay whole: the ring's keys)
            whole = self.task.whole_keys
            micro = [
                {k: v if k in whole else split_for_cp(v, 1, cp, mpu.cp_rank()) for k, v in b.items()} for b in micro
            ]
        return micro, norm

    def run(self, micro: list[dict], norm: dict, forward_only: bool = False, loss_scale: float = 1.0) -> torch.Tensor:
        """Forward (and backward) of ``micro`` through the schedule; the summed loss (see ``__call__``)."""
        args, dp, cp = self.args, mpu.dp_size(), mpu.cp_size()
        m = len(micro)
        # The gradient reduction averages over dp·cp, but the loss is already normalised by the whole global
        # batch: scale by dp·cp so the reduced gradient is that of the global loss.
        factor = loss_scale * dp * cp
        # the MoE auxiliary losses: each micro-batch's, averaged over the global batch's micro-batches
        set_aux_loss_scale(factor * args.micro_batch_size / args.global_batch_size)
        losses = []

        def forward_step(chunk: int, mb: int, hidden):
            model = self.chunks[chunk]
            out = self.task.forward(model, micro[mb], hidden, norm)
            if not model.post_process:
                return out
            losses.append(out.detach())
            return out * factor if factor != 1.0 else out

        if args.schedule == "zb-v":  # its V placement, also to evaluate (forward_only=True)
            schedule = "zb-v"
        elif (args.vpp or 1) > 1:
            schedule = "interleaved"
        else:
            schedule = "forward_only" if forward_only else args.schedule
        forward_backward(
            self.timers.wrap_forward(forward_step),
            m,
            schedule=schedule,
            tensor_shape=self.shape,
            dtype=args.param_dtype(),
            device=self.device,
            num_chunks=len(self.chunks),
            forward_only=forward_only,
            grad_sync=None if forward_only else (lambda c, on: [w.set_grad_sync(on) for w in self.wrappers[c]]),
            exchange_hook=self.timers.exchange_hook,
            durations=self.durations,
            stats=self.stats,
        )
        names = self.task.metric_names
        total = torch.stack(losses).sum().float() if losses else torch.zeros((), device=self.device)
        shares = self.task.take_metrics()
        if names:  # one collective for the loss and the task's metrics
            shares = torch.zeros(len(names), device=self.device) if shares is None else shares.float()
            total = torch.cat([total.reshape(1), shares.to(total.device)])
        if losses and dp * cp > 1:
            dist.all_reduce(total, group=mpu.dp_cp_group())
        if mpu.pipeline_placement() == "v":  # the last stage is on pipeline rank 0; the last rank logs
            dist.broadcast(total, mpu.pp_ranks()[0], group=mpu.pp_group())
        if names:
            self.metrics = dict(zip(names, total[1:].tolist()))
            total = total[0]
        return total


def _balance_experts(chunks, args: TrainArgs, stepped: bool) -> float | None:
    """The auxiliary-loss-free balancing step (``moe.router.update_expert_biases``) after an optimizer step, the
    loads summed over the data-parallel ranks (the same layers, other tokens); a skipped step forgets its loads.
    Returns the largest bias norm over the pipeline's stages."""
    from megakernels.parallel.moe.router import update_expert_biases

    norms = [update_expert_biases(c, args.moe_bias_update_rate if stepped else 0.0, mpu.dp_group()) for c in chunks]
    norm = torch.tensor(max((n for n in norms if n is not None), default=0.0))
    if mpu.pp_size() > 1:
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=mpu.pp_group())
    return float(norm)


def train(args: TrainArgs, cfg: ModelConfig | None = None) -> list[dict] | None:
    """Train on the current ``torch.distributed`` world; returns the per-step records on the logging rank (the last
    rank), None elsewhere. ``cfg`` is ``validate(args)``'s result when the caller already validated."""
    cfg = validate(args) if cfg is None else cfg
    mpu.initialize(
        args.tp,
        args.pp,
        vpp=args.vpp,
        cp=args.cp,
        ep=args.ep,
        timeout=args.timeout,
        placement=args.pipeline_placement(),
    )
    try:
        from megakernels.parallel.moe import dispatcher

        dispatcher.configure(args.moe_dispatcher, args.moe_a2a_chunks, args.moe_fp8_dispatch)
        task = task_for(cfg)
        if args.dpo:
            task = DPOTask(task, args.dpo_beta, args.dpo_loss, args.dpo_label_smoothing)
        elif args.grpo:
            task = GRPOTask(
                task,
                loss_type=args.grpo_loss,
                beta=args.grpo_beta,
                epsilon=args.grpo_epsilon,
                epsilon_high=args.grpo_epsilon_high,
                max_completion_tokens=args.max_completion_tokens,
                temperature=args.temperature,
            )
        return _train(task, args)
    finally:
        mpu.destroy()


def main_grad_dtype(args: TrainArgs, chunks: int) -> torch.dtype | None:
    """The dtype of the data-parallel gradient buffers: fp32 (they sum micro-batches, ranks and the copies of shared
    weights, exactly), except where nothing is ever summed into them — one process, one micro-batch, one model
    chunk, 16-bit params, the optimizer state on the device — where the param dtype (None) holds the very same
    values (each param's one 16-bit gradient of the step) in half the bytes, and the norm and the AdamW kernel read
    them without an fp32 copy: the same steps, bit for bit."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    half = args.base_precision() in ("bf16", "fp16")
    summed = grads_summed(world, args.num_microbatches(), chunks, half, args.offload_optimizer)
    return torch.float32 if summed else None


def _train(task: Task, args: TrainArgs) -> list[dict] | None:
    cfg = task.config
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    syncpoints.reach("start")  # before anything is built, the stop signals' handlers included
    watchdog.progress("setup")  # the watchdog's phases (megakernels.parallel.watchdog)
    mpu.model_parallel_seed(args.seed, device.type)
    chunks = build_model_chunks(task, args, device)
    if args.zero_stage() >= 2:  # FSDP2 over the data-parallel ranks (megakernels.parallel.fsdp)
        compute = args.param_dtype()
        wrappers = [
            [
                fsdp.shard_model(
                    c,
                    zero=args.zero_stage(),
                    degree=args.fsdp_degree,
                    param_dtype=None if compute == torch.float32 else compute,
                    reduce_dtype=torch.float32 if args.fsdp_reduce_dtype == "fp32" else torch.bfloat16,
                )
            ]
            for c in chunks
        ]
    else:
        grad_dtype = main_grad_dtype(args, len(chunks))
        wrappers = [
            wrap_model(c, reduce_scatter=args.distributed_optimizer, grad_dtype=grad_dtype) for c in chunks
        ]  # per chunk
    ddps = [d for ws in wrappers for d in ws]
    opt = ParallelOptimizer(
        ddps,
        lr=args.lr,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps,
        weight_decay=args.weight_decay,
        distributed=args.distributed_optimizer,
        precision=args.base_precision(),
        clip_grad=args.clip_grad,
        loss_scaler=DynamicLossScaler() if args.precision == "fp16" else None,
        no_decay=no_decay_rule(chunks, args.no_weight_decay),
        offload=args.offload_optimizer,
        optimizer=args.optimizer,
        muon=muon_options(args) if args.optimizer == "muon" else None,
        qk_clip_tau=args.muon_clip_tau,
    )
    lr_schedule = LRSchedule(
        args.lr,
        args.min_lr,
        args.warmup_steps,
        args.lr_decay_steps or args.steps,
        args.lr_decay_style,
        args.lr_wsd_decay_steps,
    )
    train_ds, valid_ds, _ = build_datasets(args, cfg)
    timers = StepTimers(args.step_timers, device)  # off unless megakernels bench asks (per-phase times)
    run_batch = PipelineStep(task, chunks, wrappers, args, device, timers)

    log_rank = dist.get_rank() == dist.get_world_size() - 1
    tokens_per_step = args.global_batch_size * cfg.seq_length
    meter = (
        MFUMeter(
            cfg.flops_per_token("none"),
            tokens_per_step,
            dist.get_world_size(),
            args.base_precision(),
            device,
            args.peak_tflops,
        )
        if log_rank
        else None
    )
    stop = StopConditions(args.exit_signal, args.exit_interval, args.exit_duration_mins, device)
    with stop:
        watchdog.progress("load")
        start, start_path = _resume(args, chunks, opt, cfg)
        if args.dpo:  # the frozen reference and the step that runs it before the policy (training/dpo.py)
            from megakernels_models.training import dpo

            run_batch, (train_ds, valid_ds) = dpo.make_step(
                task, run_batch, args, device, start_path, (train_ds, valid_ds), PipelineStep, build_model_chunks
            )
        elif args.grpo:  # sampling, rewards and advantages before the policy's step (training/grpo.py)
            from megakernels_models.training import grpo

            run_batch = grpo.make_step(task, run_batch, args, device, start_path, build_model_chunks)
        config = resolved(args, cfg)
        log = TrainLogger(
            log_rank,
            steps=args.steps,
            start_step=start,
            progress=args.progress,
            log_jsonl=args.log_jsonl,
            tensorboard=args.tensorboard,
            config=config,
        )
        saver = (
            Checkpointer(args.save, args.keep_checkpoints, args.async_save, config, args.timeout) if args.save else None
        )
        t_start = time.perf_counter()
        try:
            for step in range(start, args.steps):
                watchdog.progress("pipeline", step + 1)
                t0 = time.perf_counter()
                timers.start()
                lr_schedule.apply(opt, step + 1)
                opt.zero_grad()
                loss = run_batch(train_ds, step, loss_scale=opt.loss_scale)
                metrics = run_batch.metrics  # the task's (DPO's rewards), before an evaluation replaces them
                timers.mark("pipeline")
                watchdog.progress("gradient reduction")
                (fsdp.finalize_grads if args.zero_stage() >= 2 else finalize_model_grads)(ddps)
                timers.mark("communication")
                watchdog.progress("optimizer")
                stepped, grad_norm = opt.step()
                bias_norm = _balance_experts(chunks, args, stepped) if task.config.moe_expert_bias else None
                timers.mark("optimizer")
                watchdog.progress("step end")
                save_error = saver.poll() if saver is not None else None
                moe = moe_stats.summary(mpu.pp_group()) if task.config.num_experts else None
                rec = None
                if log_rank:
                    rec = {
                        "step": step + 1,
                        "loss": float(loss),
                        "lr": opt.lr,
                        "grad_norm": grad_norm,
                        "loss_scale": float(opt.loss_scale),
                        "tokens": tokens_per_step * (step + 1),
                        **meter.measure(time.perf_counter() - t0),
                        "elapsed_s": time.perf_counter() - t_start,
                        "skipped": not stepped,
                        **(moe or {}),
                        **({} if bias_norm is None else {"moe_expert_bias_norm": bias_norm}),
                        **(
                            {"max_logit": opt.max_logit, "clipped_heads": opt.clipped_heads}
                            if args.muon_clip_tau > 0
                            else {}
                        ),
                    }
                    if args.dpo:
                        rec["dpo_loss"] = rec["loss"]
                    rec.update(metrics)
                    if cfg.num_image_tokens:  # vision-language: images through the encoder per second
                        rec["image_tokens_per_s"] = (
                            args.global_batch_size * cfg.num_image_tokens / max(time.perf_counter() - t0, 1e-9)
                        )
                    if step == start:  # measured on the tensors this rank holds (optimizer state exists after a step)
                        n = sum(p.numel() for c in chunks for p in c.parameters())
                        rec["memory_per_param_bytes"] = {k: v / n for k, v in opt.memory_bytes().items()}
                        rec["layout"] = _layout(args)
                timers.finish(rec)
                if _due(step, args.eval_interval, args.steps) and valid_ds is not None:
                    val = evaluate(chunks, lambda s: run_batch(valid_ds, s, forward_only=True), args.eval_steps)
                    if rec is not None:
                        rec["val_loss"], rec["val_ppl"] = val, math.exp(min(val, 700.0))
                watchdog.progress("stop check")
                syncpoints.reach(f"step-{step + 1}")
                reason = stop.should_stop(step + 1)
                failed = None
                if saver is not None and (reason or _due(step, args.save_interval or args.steps, args.steps)):
                    watchdog.progress("save")
                    opt.wait_params()  # offload: the updated params may still be on their way to the device
                    save_error = saver.save(step + 1, chunks, opt, cfg) or save_error
                    if reason:  # the save of this step completes before the run stops
                        save_error = saver.wait() or save_error
                    # decided at save steps only: no collective or host sync added to the other steps
                    failed = _too_many_save_failures(saver, args.max_save_failures, device)
                if save_error and log_rank:
                    rec["checkpoint_error"] = save_error
                    print(f"megakernels train: warning: {save_error}", file=sys.stderr, flush=True)
                if rec is not None:
                    if reason:
                        rec["stopped"] = reason
                    if failed:
                        rec["failed"] = failed
                watchdog.progress("logging")
                log.log(rec)
                if reason or failed:
                    if log_rank and failed:
                        print(
                            f"megakernels train: error: stopped after step {step + 1}: {failed}",
                            file=sys.stderr,
                            flush=True,
                        )
                    elif log_rank:
                        where = (
                            "nothing saved (no --save)"
                            if saver is None
                            else f"the save failed, {_latest_name(args.save)} is the latest checkpoint"
                            if save_error
                            else f"saved checkpoint {os.path.join(args.save, step_name(step + 1))}"
                        )
                        print(
                            f"megakernels train: stopped after step {step + 1} ({reason}): {where}"
                            + (f"; relaunch with --load {args.save} to resume" if saver is not None else ""),
                            flush=True,
                        )
                    break
            watchdog.progress("save")
            if saver is not None:
                final_error = saver.wait()  # the last (asynchronous) save
                if final_error and log.records:
                    kind = "warning" if "failed" in log.records[-1] else "error"  # already stopping for failures
                    log.records[-1].setdefault("failed", f"the last checkpoint was not saved: {final_error}")
                    print(f"megakernels train: {kind}: {final_error}", file=sys.stderr, flush=True)
        finally:
            log.close()
            if saver is not None:
                saver.close(raise_error=False)
    return log.records if log_rank else None


def _too_many_save_failures(saver, limit: int, device) -> str | None:
    """Why the run stops for failed saves (the same answer on every rank), or None: ``limit`` saves in a row failed
    on some rank. Called after a save (which first waits for the previous one, so every rank has counted it); the
    counts are still combined, as an asynchronous failure may reach one rank's count at an earlier poll."""
    if saver is None or not limit:
        return None
    count = torch.tensor([float(saver.failures)], device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    n = int(count.item())
    if n < limit:
        return None
    return (
        f"{n} checkpoint saves in a row failed (--max-save-failures {limit}); the latest checkpoint is "
        f"{_latest_name(saver.save_dir)}"
    )


def _latest_name(save_dir: str) -> str:
    path = checkpoint.find_latest(save_dir)
    return os.path.basename(path) if path else "none"


def _layout(args: TrainArgs) -> dict:
    """This run's world as the first step's record reports it: an elastic restart may change the world size, and
    with it dp and the micro-batches per step, never the global batch."""
    return {
        "world_size": dist.get_world_size(),
        "tp": mpu.tp_size(),
        "cp": mpu.cp_size(),
        "pp": mpu.pp_size(),
        "dp": mpu.dp_size(),
        "num_microbatches": args.num_microbatches(),
        "restart": args.restart_count(),
    }


def _resume(args: TrainArgs, chunks, opt, cfg: ModelConfig) -> tuple[int, str | None]:
    """Load ``--load``'s latest checkpoint; returns its step and path (0 and None, with a note, when there is none
    yet: a first launch with ``--save DIR --load DIR``). After an elastic restart (torchrun brought the workers
    back, possibly with another world size) rank 0 says at which layout the run continues."""
    rank0, restarts = dist.get_rank() == 0, args.restart_count()
    if restarts and rank0:
        print(
            f"megakernels train: torchrun restart {restarts}: world size {dist.get_world_size()}, dp "
            f"{mpu.dp_size()}, {args.num_microbatches()} micro-batches per step (global batch "
            f"{args.global_batch_size})",
            flush=True,
        )
    if not args.load:
        if restarts and rank0:
            print(
                "megakernels train: warning: restarted without --load: training starts again from step 0 "
                "(give --save DIR --load DIR to resume from the latest checkpoint)",
                file=sys.stderr,
                flush=True,
            )
        return 0, None
    from megakernels_models.training.checkpoint_verify import select

    say = (
        (lambda line: print(f"megakernels train: {line}", file=sys.stderr, flush=True))
        if rank0
        else (lambda line: None)
    )
    path = select(args.load, say)  # the newest checkpoint that verifies (collective)
    if path is None:
        if rank0:
            print(f"megakernels train: no checkpoint in --load {args.load} yet; starting from scratch", flush=True)
        return 0, None
    step = checkpoint.load(path, chunks, opt, cfg)
    if restarts and rank0:
        print(f"megakernels train: resumed from {path} (step {step})", flush=True)
    return step, path


def muon_options(args: TrainArgs) -> MuonOptions:
    """The ``--muon-*`` settings as ``ParallelOptimizer``'s ``MuonOptions``."""
    return MuonOptions(
        momentum=args.muon_momentum,
        nesterov=args.muon_nesterov,
        ns_steps=args.muon_ns_steps,
        lr_scale=args.muon_lr_scale,
        split=args.muon_split,
        ns_dtype=args.muon_ns_dtype,
        tp_mode=args.muon_tp_mode,
    )


def no_decay_rule(chunks, names: str):
    """The params without weight decay: biases and norm weights (fewer than 2 dims), and those whose name contains
    one of the comma-separated ``names``."""
    parts = [n.strip() for n in names.split(",") if n.strip()]
    excluded = {id(p) for c in chunks for n, p in c.named_parameters() if any(part in n for part in parts)}
    return lambda p: p.dim() < 2 or id(p) in excluded


def _due(step: int, interval: int, steps: int) -> bool:
    """Whether an every-``interval``-steps action (0 = never) runs after ``step`` (it also runs after the last)."""
    return bool(interval) and ((step + 1) % interval == 0 or step + 1 == steps)


def evaluate(chunks, run_batch, steps: int) -> float:
    """Mean loss over ``steps`` global batches of the validation split (forward-only schedule)."""
    for c in chunks:
        c.eval()
    with torch.no_grad():
        total = 0.0
        for s in range(steps):
            watchdog.progress("evaluation")
            total += float(run_batch(s))
    for c in chunks:
        c.train()
    return total / steps


def run(args: TrainArgs):
    """Validate once, then train on the world ``launch`` makes (``--dry-run``: report instead). Returns the logging
    rank's records (or the dry-run report).

    Raises:
        ArgumentError: invalid arguments (before any process starts).
        megakernels.parallel.launch.WorldFailed: a spawned rank failed (its error in the message).
    """
    from megakernels.parallel.launch import launch

    with hf_import(args) as args, reference_import(args) as args:
        cfg = validate(args)
        if args.dry_run:
            return dryrun.report(args, cfg)
        signals = stop_signals(args.exit_signal)  # they reach every spawned rank once, through the launcher
        return launch(train, args, cfg, nproc=args.nproc, device=args.device, timeout=args.timeout, signals=signals)


@contextlib.contextmanager
def hf_import(args: TrainArgs):
    """``--load-hf DIR``: the arguments that fine-tune the HuggingFace model in DIR. It is converted (in this
    process, once) into ``--save``'s directory as its step-0 checkpoint — or, without ``--save``, into a temporary
    directory removed afterwards — unless that directory already holds a checkpoint (a relaunch resumes it); the run
    then loads it (``--load``: any layout, the learning-rate schedule from its start), takes its architecture
    (unless a preset or an architecture is given) and, with the default tokenizer, the tokenizer that came with it.

    Raises:
        ArgumentError: ``--load-hf`` with ``--load``, or a directory that does not convert (the reason named).
    """
    if not args.load_hf:
        yield args
        return
    from megakernels_models.convert import checkpoint_tokenizer, hf_to_megakernels
    from megakernels_models.convert.common import ConversionError

    if args.load is not None:
        raise ArgumentError("--load-hf DIR and --load DIR: give one (--load-hf converts into --save's directory)")
    target = args.save or tempfile.mkdtemp(prefix="megakernels-hf-")
    try:
        if checkpoint.find_latest(target) is None:
            try:
                hf_to_megakernels(args.load_hf, target)
            except (ConversionError, OSError) as e:
                raise ArgumentError(f"--load-hf {args.load_hf}: {e}") from None
        meta = checkpoint.read_meta(checkpoint.read_latest(target))
        changes = {"load": target}
        if args.preset is None and not args.architecture:
            changes["architecture"] = meta["config"]
        if args.tokenizer == "byte" and checkpoint_tokenizer(target):
            changes["tokenizer"] = checkpoint_tokenizer(target)
        yield dataclasses.replace(args, **changes)
    finally:
        if args.save is None:
            shutil.rmtree(target, ignore_errors=True)


@contextlib.contextmanager
def reference_import(args: TrainArgs):
    """``--dpo``: the arguments whose ``--dpo-ref`` is a megakernels checkpoint. A HuggingFace ``--dpo-ref`` is
    converted (in this process, once) into a temporary directory, removed afterwards; so is ``--load-hf``'s model
    when a ``--load-hf`` run resumes past step 0 without ``--dpo-ref`` (its reference is still that model).

    Raises:
        ArgumentError: a directory that does not convert (the reason named).
    """
    source = None
    if args.dpo and args.dpo_ref is not None:
        hf = os.path.isfile(os.path.join(args.dpo_ref, "config.json"))
        if hf and os.path.isdir(args.dpo_ref) and checkpoint.find_latest(args.dpo_ref) is None:
            source = ("--dpo-ref", args.dpo_ref)
    elif args.dpo and args.load_hf and args.load is not None:
        latest = checkpoint.find_latest(args.load)
        if latest is not None and checkpoint.read_meta(latest)["step"] > 0:
            source = ("--load-hf", args.load_hf)
    if source is None:
        yield args
        return
    from megakernels_models.convert import hf_to_megakernels
    from megakernels_models.convert.common import ConversionError

    target = tempfile.mkdtemp(prefix="megakernels-ref-")
    try:
        try:
            hf_to_megakernels(source[1], target)
        except (ConversionError, OSError) as e:
            raise ArgumentError(f"{source[0]} {source[1]}: {e}") from None
        yield dataclasses.replace(args, dpo_ref=target)
    finally:
        shutil.rmtree(target, ignore_errors=True)
