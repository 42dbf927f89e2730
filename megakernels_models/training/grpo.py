"""``megakernels train --grpo``: group-relative policy optimisation, sampling with the KV-cache generator.

Each step, on every rank (one process, or tensor- and data-parallel layouts; the whole model on each rank):

1. the global batch's prompts: ``--global-batch-size / --grpo-group-size`` prompt numbers, this data-parallel rank
   taking its consecutive share (``datasets.global_batch_indices``) of the endless seeded order of the prompts
   (``data.prompts.PromptDataset``);
2. ``--grpo-group-size`` completions of each prompt, sampled at ``--temperature`` by
   ``inference.generate.generate`` on the policy (evaluation mode; under tensor parallelism the vocab-parallel
   logits gathered over the group) with up to ``--max-completion-tokens`` tokens, a completion ending at the
   tokenizer's end token (``tokenizer.end_token``, kept as its last target); the sampler of prompt number ``i`` is
   seeded by ``--seed``, the step and ``i``, so the completions do not depend on the layout;
3. rewards from ``--reward`` (``load_reward``) on the decoded prompts and completions (and, as TRL passes them,
   ``completion_ids``: each completion's token ids, its end token included), and the advantages
   ``ops.post_training.group_advantages`` (each completion's reward minus its group's mean, over the group's
   standard deviation);
4. the training batch: each completion with its prompt (``[b, seq_length]``, labels on the completion only), in
   micro-batches of ``--micro-batch-size`` completions; with ``--grpo-beta`` > 0 the frozen reference's per-token
   log-probabilities (``training.dpo.build_reference``: the weights the run starts from); then forward and
   backward through the trainer's ``PipelineStep`` with ``tasks.GRPOTask``'s loss.

Logged beside the loss: the global batch's mean ``reward`` and its standard deviation ``reward_std``, the mean
``completion_tokens``, and ``GRPOTask``'s ``kl``, ``entropy`` and ``clip_fraction``.
"""

from __future__ import annotations

import importlib

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import megakernels.parallel as mpu
from megakernels_models.data.datasets import global_batch_indices


def load_reward(spec: str):
    """The function ``MODULE:FUNCTION`` names (imported).

    Raises:
        ValueError: a spec not of that form, a module that does not import, a missing or uncallable attribute.
    """
    module, _, name = str(spec).partition(":")
    if not module or not name:
        raise ValueError(f"--reward {spec}: expected MODULE:FUNCTION (e.g. megakernels_models.rewards:arithmetic)")
    try:
        fn = getattr(importlib.import_module(module), name, None)
    except Exception as e:  # noqa: BLE001 - whatever the module raises while importing
        raise ValueError(f"--reward {spec}: importing {module} failed: {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise ValueError(f"--reward {spec}: {module} has no function {name}")
    return fn


class Sampler(nn.Module):
    """A policy chunk (the whole model) as ``generate`` takes a model: ``forward(ids [b, s], kv_cache)`` -> fp32
    logits ``[b, s, vocab_size]``, gathered over the tensor-parallel group."""

    def __init__(self, chunk: nn.Module):
        super().__init__()
        self.chunk, self.config = chunk, chunk.config

    def forward(self, input_ids: torch.Tensor, kv_cache=None) -> torch.Tensor:
        from megakernels.parallel.mappings import gather_from_tensor_model_parallel_region

        logits = gather_from_tensor_model_parallel_region(self.chunk(input_ids, kv_cache=kv_cache), mpu.tp_group())
        return logits.transpose(0, 1)[..., : self.config.vocab_size].float()


def sample_seed(seed: int, step: int, prompt: int) -> int:
    """The sampler's seed of prompt number ``prompt`` at ``step`` (independent of the layout)."""
    return int(np.random.SeedSequence([seed, step, prompt]).generate_state(1)[0])


class GRPOStep:
    """One GRPO global batch (module docstring). Called as the trainer's ``PipelineStep``; ``metrics`` are the last
    step's (on the logging rank)."""

    def __init__(self, task, policy, reference_chunks, args, device, tokenizer, reward_fn, end: int | None):
        self.task, self.policy, self.reference = task, policy, reference_chunks
        self.args, self.device, self.tok, self.reward_fn, self.end = args, device, tokenizer, reward_fn, end
        self.group = args.grpo_group_size
        self.metrics: dict[str, float] = {}
        self.last: dict | None = None  # this rank's last batch: prompts, completions, rewards, advantages, rows

    @property
    def stats(self):
        return self.policy.stats

    @stats.setter
    def stats(self, value):
        self.policy.stats = value

    def sample(self, dataset, step: int) -> dict:
        """This rank's prompts of global batch ``step`` and their completions (module docstring, 1-2)."""
        from megakernels_models.inference.generate import generate

        args, g = self.args, self.group
        prompts = global_batch_indices(step, args.global_batch_size // g, mpu.dp_rank(), mpu.dp_size())
        chunk = self.policy.chunks[0]
        sampler = Sampler(chunk)
        was_training = chunk.training
        chunk.eval()
        rows = []
        try:
            for i in prompts:
                ids, text, fields = dataset[i]
                prompt = torch.as_tensor(ids, device=self.device)[None].expand(g, -1)
                out = generate(
                    sampler, prompt, args.max_completion_tokens, temperature=args.temperature,
                    seed=sample_seed(args.seed, step, i), eos_token_id=self.end,
                )  # fmt: skip
                for completion in out[:, len(ids) :].tolist():
                    if self.end is not None and self.end in completion:
                        completion = completion[: completion.index(self.end) + 1]
                    rows.append((ids.tolist(), completion, text, fields))
        finally:
            chunk.train(was_training)
        return {"rows": rows}

    def rewards(self, rows) -> torch.Tensor:
        """The reward of each completion (``--reward`` on this rank's rows), fp32 ``[len(rows)]``.

        Raises:
            ValueError: the function returns something other than one finite number a completion.
        """
        fields = {}
        for k in dict.fromkeys(k for _, _, _, f in rows for k in f):
            fields[k] = [f.get(k) for _, _, _, f in rows]
        completions = [self.tok.decode([t for t in c if t != self.end]) for _, c, _, _ in rows]
        got = self.reward_fn(
            prompts=[p for _, _, p, _ in rows],
            completions=completions,
            completion_ids=[list(c) for _, c, _, _ in rows],
            **fields,
        )
        try:
            out = torch.tensor([float(r) for r in got], dtype=torch.float32)
        except (TypeError, ValueError):
            raise ValueError(f"--reward {self.args.reward}: returned {type(got).__name__}, not numbers") from None
        if out.shape != (len(rows),) or not torch.isfinite(out).all():
            raise ValueError(
                f"--reward {self.args.reward}: {len(rows)} completions need {len(rows)} finite rewards, got "
                f"{out.tolist()[:8]}"
            )
        return out

    def micro_batches(self, rows, advantages: torch.Tensor) -> list[dict]:
        """The training micro-batches of ``rows`` (module docstring, 4)."""
        args, s = self.args, self.task.config.seq_length
        pad = self.end if self.end is not None else 0
        ids = torch.full((len(rows), s), pad, dtype=torch.long)
        labels = torch.full((len(rows), s), -100, dtype=torch.long)
        for r, (prompt, completion, _, _) in enumerate(rows):
            seq = prompt + completion
            ids[r, : len(seq)] = torch.as_tensor(seq)
            labels[r, len(prompt) - 1 : len(seq) - 1] = torch.as_tensor(completion)
        mbs = args.micro_batch_size
        return [
            {
                "ids": ids[a : a + mbs].to(self.device),
                "labels": labels[a : a + mbs].to(self.device),
                "advantages": advantages[a : a + mbs].to(self.device),
            }
            for a in range(0, len(rows), mbs)
        ]

    def __call__(self, dataset, step: int, forward_only: bool = False, loss_scale: float = 1.0) -> torch.Tensor:
        from megakernels.ops.post_training import group_advantages

        rows = self.sample(dataset, step)["rows"]
        rewards = self.rewards(rows)
        advantages = group_advantages(rewards, self.group)
        micro = self.micro_batches(rows, advantages)
        if self.reference is not None:
            with torch.no_grad():
                for b in micro:
                    b["ref_logps"] = self.task.logprobs(self.reference[0], b)
        norm = self.task.normalizers(micro, self.args.global_batch_size, self.device)
        loss = self.policy.run(micro, norm, forward_only=forward_only, loss_scale=loss_scale)
        lengths = torch.tensor([float(len(c)) for _, c, _, _ in rows])
        stats = torch.stack([rewards.sum(), (rewards**2).sum(), lengths.sum()]).to(self.device)
        if mpu.dp_size() > 1:
            dist.all_reduce(stats, group=mpu.dp_group())
        n = float(self.args.global_batch_size)
        mean, sq, tokens = (float(x) for x in stats.tolist())
        self.metrics = {
            "reward": mean / n,
            "reward_std": max(sq / n - (mean / n) ** 2, 0.0) ** 0.5,
            "completion_tokens": tokens / n,
            **self.policy.metrics,
        }
        self.last = {"rows": rows, "rewards": rewards, "advantages": advantages}
        return loss


def make_step(task, policy_step, args, device, start_path, build_chunks):
    """The GRPO step of the trainer (its reference built when ``--grpo-beta`` > 0)."""
    from megakernels_models.data.build import tokenizer_for
    from megakernels_models.data.tokenizer import end_token
    from megakernels_models.training.dpo import build_reference

    tok = tokenizer_for(args)
    reference = None
    if args.grpo_beta > 0:
        reference = build_reference(task, args, device, start_path, build_chunks)
    return GRPOStep(task, policy_step, reference, args, device, tok, load_reward(args.reward), end_token(tok))
