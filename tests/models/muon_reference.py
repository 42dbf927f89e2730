"""An fp64 single-process reference of the trainer with ``--optimizer muon``, written without the optimizer code under
test: the model built by its family (same seed) in fp64 with the torch attention core, the trainer's global batches,
its learning-rate schedule and global-norm clipping, then Newton-Schulz per logical matrix (rows picked by explicit
indices from the parameter names) for the hidden matrices and torch.optim.AdamW for the rest."""

from __future__ import annotations

import math
from unittest import mock

import torch

A, B, C = 3.4445, -4.7750, 2.0315


def ns64(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Newton-Schulz of one fp64 matrix."""
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.t()
    x = x / max(torch.linalg.matrix_norm(x).item(), 1e-7)
    for _ in range(steps):
        gram = x @ x.t()
        x = A * x + (B * gram + C * gram @ gram) @ x
    return x.t() if tall else x


def logical_rows(name: str, rows: int, cfg) -> list[list[int]]:
    """The row indices of each logical matrix of weight ``name`` (``rows`` rows): Q, K, V of the GPT QKV weight
    (rows ordered head, {q, k, v}, head_dim), keys and values of ``kv``, gate and up of a SwiGLU ``fc1``."""
    if name.endswith("attention.qkv.weight"):
        d = cfg.hidden_size // cfg.num_heads
        heads = rows // (3 * d)
        return [[h * 3 * d + j * d + i for h in range(heads) for i in range(d)] for j in range(3)]
    two = name.endswith("attention.kv.weight") or (cfg.activation == "swiglu" and name.endswith("fc1.weight"))
    two = two or (cfg.activation == "swiglu" and name.endswith("experts.fc1"))
    if two:
        return [list(range(rows // 2)), list(range(rows // 2, rows))]
    return [list(range(rows))]


def tp_blocks(name: str, rows: list[int], cols: int, tp: int) -> list[tuple[list[int], slice]]:
    """``(rows, columns)`` of each TP rank's shard of one logical matrix: a row-parallel weight (the attention and MLP
    output projections) split by columns, the others by rows (each rank's heads, or its part of gate and up)."""
    if tp == 1:
        return [(rows, slice(None))]
    if name.endswith(("attention.proj.weight", "fc2.weight", "experts.fc2")):
        w = cols // tp
        return [(rows, slice(r * w, (r + 1) * w)) for r in range(tp)]
    h = len(rows) // tp
    return [(rows[r * h : (r + 1) * h], slice(None)) for r in range(tp)]


def is_matrix(name: str, p: torch.Tensor) -> bool:
    if p.dim() < 2:
        return False
    return not any(part in name for part in ("embedding.", "output_layer", "router"))


def ce64(logits, target, vocab_size, ignore_index=-100, label_smoothing=0.0, softcap=None):
    """The per-token loss of the model's (unsplit) logits in fp64 by torch (the fused kernel takes no fp64), capped
    to ``softcap * tanh(logits / softcap)`` first when given."""
    flat = logits[..., :vocab_size].reshape(-1, vocab_size)
    if softcap is not None:
        flat = softcap * torch.tanh(flat / softcap)
    return torch.nn.functional.cross_entropy(
        flat, target.reshape(-1), ignore_index=ignore_index, reduction="none"
    ).view(target.shape)


def run(args, steps: int, tp_shards: int = 1) -> tuple[list[float], list[float]]:
    """``(losses, grad_norms)`` of ``steps`` steps of ``args`` (fp32 settings, dropout 0) computed in fp64;
    ``tp_shards``: each logical matrix orthogonalised per shard of that many TP ranks (``--muon-tp-mode
    shard``)."""
    import megakernels.parallel as mpu
    from megakernels.optim.lr_schedule import LRSchedule
    from megakernels.parallel.launch import single_process_world
    from megakernels.parallel.moe import set_aux_loss_scale
    from megakernels_models.arguments import validate
    from megakernels_models.data.build import build_datasets
    from megakernels_models.data.datasets import collate, global_batch_indices
    from megakernels_models.models.registry import task_for

    cfg = validate(args)
    task = task_for(cfg)
    from megakernels_models.models.gpt import model as gpt_model

    with single_process_world(parallel=True), mock.patch.object(gpt_model, "vocab_parallel_cross_entropy", ce64):
        mpu.model_parallel_seed(args.seed, "cpu")
        model = task.build_chunk(
            args.seed,
            layers=range(cfg.num_layers),
            pre_process=True,
            post_process=True,
            sequence_parallel=False,
            attention="torch",
            recompute="none",
            fused_linear_ce=False,
            device="cpu",
        ).double()
        train_ds, _, _ = build_datasets(args, cfg)
        named = list(model.named_parameters())
        mats = [(n, p) for n, p in named if is_matrix(n, p)]
        rest = [p for n, p in named if not is_matrix(n, p)]
        adam = torch.optim.AdamW(
            [
                {"params": [p for p in rest if p.dim() > 1], "weight_decay": args.weight_decay},
                {"params": [p for p in rest if p.dim() <= 1], "weight_decay": 0.0},
            ],
            lr=args.lr,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_eps,
        )
        schedule = LRSchedule(
            args.lr, args.min_lr, args.warmup_steps, args.lr_decay_steps or args.steps, args.lr_decay_style
        )
        mu = args.muon_momentum
        bufs = {n: torch.zeros_like(p) for n, p in mats}
        losses, norms = [], []
        mbs = args.micro_batch_size
        set_aux_loss_scale(mbs / args.global_batch_size)  # the MoE auxiliary losses, as the trainer weighs them
        for step in range(steps):
            lr = schedule.lr_at(step + 1)
            for g in adam.param_groups:
                g["lr"] = lr
            model.zero_grad()
            samples = [train_ds[i] for i in global_batch_indices(step, args.global_batch_size)]
            micro = [collate(samples[i : i + mbs]) for i in range(0, len(samples), mbs)]
            norm = task.normalizers(micro, args.global_batch_size, torch.device("cpu"))
            total = 0.0
            for mb in micro:
                loss = task.forward(model, mb, None, norm)
                loss.backward()
                total += float(loss.detach())
            losses.append(total)
            with torch.no_grad():
                gnorm = math.sqrt(sum(float(p.grad.pow(2).sum()) for _, p in named if p.grad is not None))
                norms.append(gnorm)
                coef = min(1.0, args.clip_grad / (gnorm + 1e-6)) if args.clip_grad > 0 else 1.0
                for _, p in named:
                    if p.grad is not None:
                        p.grad.mul_(coef)
                for n, p in mats:
                    g = p.grad
                    bufs[n] = mu * bufs[n] + (1 - mu) * g
                    u = (1 - mu) * g + mu * bufs[n] if args.muon_nesterov else bufs[n]
                    out = torch.zeros_like(u)
                    stack = u.dim() == 3  # experts: each matrix on its own
                    for e in range(u.shape[0] if stack else 1):
                        ue = u[e] if stack else u
                        oe = out[e] if stack else out
                        for logical in logical_rows(n, ue.shape[0], cfg):
                            for rows, cols in tp_blocks(n, logical, ue.shape[1], tp_shards):
                                part = ue[rows][:, cols]
                                m_, n_ = part.shape
                                oe[rows, cols] = 0.2 * math.sqrt(max(m_, n_)) * ns64(part, args.muon_ns_steps)
                    p.mul_(1 - lr * args.weight_decay).sub_(lr * out)
            adam.step()
        return losses, norms
