"""What a model family trains on: how a pipeline chunk is built, and how a micro-batch becomes a loss.

The trainer (``training/train.py``) is the same for every family; a ``Task`` (the family's, from its spec:
``registry.task_for``) holds what differs:

- ``build_chunk``: one pipeline chunk of the family's model;
- ``normalizers``: the loss denominators of the whole global batch (so a loss does not depend on how the batch is
  split over micro-batches and data-parallel ranks);
- ``forward``: one chunk on one micro-batch — the hidden state to send on, or, on the last stage, the micro-batch's
  share of the global loss.

Losses are sums over the micro-batch divided by the global batch's denominators, so summing the micro-batches'
losses over every data-parallel rank gives exactly the single-process loss of the global batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

import megakernels.parallel as mpu

if TYPE_CHECKING:
    from megakernels_models.models.config import ModelConfig


class Task:
    """A model family's training objective (see the module docstring)."""

    def __init__(self, config: ModelConfig, model_class: type):
        self.config, self.model_class = config, model_class

    def build_chunk(self, seed: int, **kwargs) -> torch.nn.Module:
        """One pipeline chunk (kwargs: ``layers``, ``pre_process``, ``post_process``, ``sequence_parallel``,
        ``attention``, ``recompute``, ``fused_linear_ce``, ``device``)."""
        return self.model_class(self.config, seed, **kwargs)

    def is_frozen(self, name: str, parts: list[str]) -> bool:
        """Whether parameter ``name`` is frozen by ``--freeze``'s ``parts`` (a part anywhere in the name)."""
        return any(part in name for part in parts)

    def normalizers(self, micro: list[dict], global_batch: int, device) -> dict:
        """Loss denominators of the whole global batch, from this rank's micro-batches (collective over dp)."""
        raise NotImplementedError

    def forward(self, model, batch: dict, hidden: torch.Tensor | None, norm: dict) -> torch.Tensor:
        """The hidden state for the next stage, or on the last stage this micro-batch's scalar loss share."""
        raise NotImplementedError

    # The batch keys that context parallelism leaves whole (every other ``[b, s]`` key is cut to the rank's chunks).
    whole_keys: tuple[str, ...] = ("documents",)
    # The names of what ``take_metrics`` returns (logged beside the loss).
    metric_names: tuple[str, ...] = ()

    def take_metrics(self) -> torch.Tensor | None:
        """The shares of ``metric_names`` that this rank's forwards produced since the last call, summed (fp32
        ``[len(metric_names)]``; summed over data and context parallelism they are the global batch's values), or
        None."""
        return None


class CausalLMTask(Task):
    """Next-token prediction (the causal language models): mean cross-entropy over every labelled token of the
    global batch.

    A batch of packed sequences also holds ``documents`` (int ``[b, s]``: each token's document, non-decreasing)
    and/or ``positions`` (``[b, s]``: each token's position in its document); attention then stays within each
    document and positions restart per document. Labels of -100 (a document's last token, prompts in supervised
    fine-tuning, padding) are not counted: the loss is the sum over the labelled tokens divided by their number in
    the whole global batch, so it does not depend on how samples were packed or split over micro-batches and
    ranks."""

    _mtp_shares: list[torch.Tensor] | None = None

    @property
    def metric_names(self) -> tuple[str, ...]:
        return ("mtp_loss",) if self.config.mtp_layers else ()

    def normalizers(self, micro, global_batch, device):
        return {"tokens": count_labels(micro, "labels")}  # every token of the global batch when none is -100

    def forward(self, model, batch, hidden, norm):
        """The micro-batch's share of the loss. With multi-token prediction (``ModelConfig.mtp_layers``) the
        share's value is the main head's alone and its gradient that of ``main + λ · mtp_loss``, ``mtp_loss`` the
        depths' mean loss, each over the global batch's labelled tokens (as DeepSeek-V3 weighs them), logged as
        ``mtp_loss``."""
        if not model.post_process:
            return self.run_model(model, batch, hidden)
        if getattr(model, "mtp", None) is None:
            return self.run_model(model, batch, hidden).sum() / norm["tokens"]
        out, depths = self.run_model(model, batch, hidden, mtp=True)
        mtp = torch.stack([d.sum() for d in depths]).mean() / norm["tokens"]
        self._mtp_shares = [*(self._mtp_shares or []), mtp.detach().float().reshape(1)]
        extra = self.config.mtp_loss_weight * mtp
        return out.sum() / norm["tokens"] + (extra - extra.detach())

    def take_metrics(self):
        if not self._mtp_shares:
            return None
        out, self._mtp_shares = torch.cat(self._mtp_shares).sum().reshape(1), None
        return out

    @staticmethod
    def run_model(model, batch, hidden, mtp: bool = False):
        """The chunk on the micro-batch: the hidden state to send on, or on the last stage the per-token fp32 loss
        ``[s, b]`` (minus each labelled token's log-probability; 0 where the label is -100); with ``mtp`` (a
        last stage with multi-token prediction) ``(loss, [each depth's loss])``."""
        packed = {}
        if "documents" in batch or "positions" in batch:
            packed["documents"] = (batch.get("documents"), batch.get("positions"))
        return model(
            ids=batch["ids"] if model.pre_process or mtp else None,
            labels=batch["labels"] if model.post_process else None,
            hidden=hidden,
            **packed,
            **({"mtp": True} if mtp else {}),
        )


class DPOTask(CausalLMTask):
    """Direct preference optimisation of a causal language model on packed preference pairs
    (``data.preference``: pair ``j`` of a sample is its documents ``2j``, chosen, and ``2j + 1``, rejected).

    On the last stage the model's per-token loss gives each document's summed log-probability over its labelled
    (completion) tokens; under context parallelism each rank holds two chunks of every sequence, so the sums are
    completed over the context-parallel group (differentiably: each rank then computes every pair's loss and
    takes ``1/cp`` of it). ``ops.post_training.dpo_pair_losses`` turns them, with the reference's sums of the same
    documents (``batch["ref_logps"]``, ``[b, s + 1]`` in the same layout: put there by the reference's pass,
    ``ReferenceTask``, or by a precomputed dataset), into each pair's loss; the micro-batch's share is their sum
    over the global batch's number of pairs (``normalizers``), so the loss is the mean over pairs whatever the
    layout. Logged beside it: the mean implicit rewards ``β (log π − log π_ref)`` of the chosen and the rejected
    completions, their mean margin and the share of pairs whose chosen reward is the larger (TRL's
    ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies``)."""

    whole_keys = ("documents", "ref_logps", "sample")
    metric_names = ("chosen_rewards", "rejected_rewards", "reward_margin", "reward_accuracy")

    def __init__(self, base: Task, beta: float, loss_type: str, label_smoothing: float):
        from megakernels.ops.post_training import check_dpo

        super().__init__(base.config, base.model_class)
        self.base = base
        self.beta, self.label_smoothing = check_dpo("DPOTask", beta, loss_type, label_smoothing)
        self.loss_type = loss_type
        self._metrics: list[torch.Tensor] = []

    def build_chunk(self, seed: int, **kwargs) -> torch.nn.Module:
        return self.base.build_chunk(seed, **kwargs)

    def is_frozen(self, name: str, parts: list[str]) -> bool:
        return self.base.is_frozen(name, parts)

    def normalizers(self, micro, global_batch, device):
        count = torch.stack([pair_counts(b["documents"]).sum() for b in micro]).sum().to(torch.float32)
        if mpu.dp_size() > 1:
            dist.all_reduce(count, group=mpu.dp_group())
        return {"pairs": count.clamp(min=1.0)}

    def sequence_logps(self, model, batch, hidden) -> tuple[torch.Tensor, torch.Tensor]:
        """On the last stage: each document's summed log-probability and its labelled-token count, fp32 ``[b, s +
        1]`` (column ``d``: document ``d`` of the sample), complete under context parallelism."""
        from megakernels.parallel.context import split_for_cp

        out = self.run_model(model, batch, hidden)
        docs, cp = batch["documents"], mpu.cp_size()
        b, width = docs.shape[0], docs.shape[1] + 1
        local = split_for_cp(docs, 1, cp, mpu.cp_rank()).long() if cp > 1 else docs.long()
        mask = batch["labels"] != -100
        idx = (local + width * torch.arange(b, device=docs.device)[:, None]).reshape(-1)
        zeros = torch.zeros(b * width, dtype=torch.float32, device=docs.device)
        sums = zeros.index_add(0, idx, (-out.t().float() * mask).reshape(-1)).view(b, width)
        counts = zeros.index_add(0, idx, mask.float().reshape(-1)).view(b, width)
        if cp > 1:
            from torch.distributed.nn.functional import all_reduce

            dist.all_reduce(counts, group=mpu.cp_group())
            sums = all_reduce(sums, group=mpu.cp_group()) if sums.requires_grad else _summed(sums, mpu.cp_group())
        return sums, counts

    def forward(self, model, batch, hidden, norm):
        from megakernels.ops.post_training import dpo_pair_losses

        if not model.post_process:
            return self.run_model(model, batch, hidden)
        if "ref_logps" not in batch:
            raise RuntimeError("DPOTask: the micro-batch has no reference log-probabilities (batch['ref_logps'])")
        sums, counts = self.sequence_logps(model, batch, hidden)
        ref = batch["ref_logps"].to(sums.device, torch.float32)[:, : sums.shape[1]]
        pairs = sums.shape[1] // 2
        valid = torch.arange(pairs, device=sums.device)[None, :] < pair_counts(batch["documents"])[:, None]
        chosen, rejected = sums[:, 0 : 2 * pairs : 2][valid], sums[:, 1 : 2 * pairs : 2][valid]
        ref_c, ref_r = ref[:, 0 : 2 * pairs : 2][valid], ref[:, 1 : 2 * pairs : 2][valid]
        len_c, len_r = counts[:, 0 : 2 * pairs : 2][valid], counts[:, 1 : 2 * pairs : 2][valid]
        losses, ratio_c, ratio_r = dpo_pair_losses(
            chosen,
            rejected,
            ref_c,
            ref_r,
            len_c,
            len_r,
            beta=self.beta,
            loss_type=self.loss_type,
            label_smoothing=self.label_smoothing,
        )
        scale = norm["pairs"] * mpu.cp_size()
        with torch.no_grad():
            rc, rr = self.beta * ratio_c, self.beta * ratio_r
            self._metrics.append(torch.stack([rc.sum(), rr.sum(), (rc - rr).sum(), (rc > rr).float().sum()]) / scale)
        return losses.sum() / scale

    def take_metrics(self):
        if not self._metrics:
            return None
        out, self._metrics = torch.stack(self._metrics).sum(0), []
        return out


class ReferenceTask(Task):
    """The frozen reference of a ``DPOTask``: its pass (forward only) puts each document's summed log-probability
    into the micro-batch as ``batch["ref_logps"]`` on the last stage, where the policy's pass reads it, and gives a
    zero loss."""

    metric_names = ()

    def __init__(self, dpo: DPOTask):
        super().__init__(dpo.config, dpo.model_class)
        self.dpo, self.whole_keys = dpo, dpo.whole_keys

    def normalizers(self, micro, global_batch, device):
        return {}

    def forward(self, model, batch, hidden, norm):
        if not model.post_process:
            return self.dpo.run_model(model, batch, hidden)
        with torch.no_grad():
            batch["ref_logps"], _ = self.dpo.sequence_logps(model, batch, hidden)
        return torch.zeros((), device=batch["ref_logps"].device)


class GRPOTask(CausalLMTask):
    """Group-relative policy optimisation of a causal language model (``training/grpo.py`` samples the
    completions): a micro-batch holds whole sequences, prompt then completion then padding (``ids``, ``labels``
    -100 outside the completion, ``[b, s]``), each completion's group-normalised ``advantages`` ``[b]`` and, when
    ``beta`` > 0, the reference's per-token log-probabilities ``ref_logps`` ``[b, s]``. The loss is
    ``ops.post_training.grpo_loss`` on the last hidden states and the LM head (vocab-parallel under tensor
    parallelism), its aggregation made global: ``grpo`` and ``dr_grpo`` weigh each micro-batch by its share of the
    global batch's completions, ``bnpo`` by its share of their tokens, ``dapo`` and ``cispo`` divide by the global
    token count themselves. Logged beside it: the tokens' mean ``kl`` to the reference, ``entropy`` and
    ``clip_fraction``. One optimisation step per generation: the sampling policy is this one (ratio 1).
    Pipeline and context parallelism are not supported (the sampler decodes with the whole model on a rank)."""

    metric_names = ("kl", "entropy", "clip_fraction")

    def __init__(
        self, base: Task, *, loss_type: str, beta: float, epsilon: float, epsilon_high: float | None,
        max_completion_tokens: int, temperature: float,
    ):  # fmt: skip
        super().__init__(base.config, base.model_class)
        self.base, self.loss_type, self.beta = base, loss_type, float(beta)
        self.epsilon, self.epsilon_high = float(epsilon), epsilon_high
        self.max_completion_tokens, self.temperature = int(max_completion_tokens), float(temperature)
        self._metrics: list[torch.Tensor] = []

    def build_chunk(self, seed: int, **kwargs) -> torch.nn.Module:
        return self.base.build_chunk(seed, **kwargs)

    def is_frozen(self, name: str, parts: list[str]) -> bool:
        return self.base.is_frozen(name, parts)

    def normalizers(self, micro, global_batch, device):
        return {"tokens": count_labels(micro, "labels"), "sequences": float(global_batch)}

    def logprobs(self, model, batch) -> torch.Tensor:
        """The model's per-token log-probabilities of ``labels`` at the sampling temperature, fp32 ``[b, s]`` (0
        outside the completions)."""
        from megakernels.ops.logprobs import linear_logprobs

        return linear_logprobs(
            self._hidden(model, batch),
            model.output_weight,
            batch["labels"],
            group=mpu.tp_group(),
            vocab_size=self.config.vocab_size,
            temperature=self.temperature,
        )

    @staticmethod
    def _hidden(model, batch) -> torch.Tensor:
        """The last hidden states of the whole model, ``[b, s, h]`` (the LM head's input)."""
        if not (model.pre_process and model.post_process):
            raise ValueError("GRPOTask: the whole model on each rank (no pipeline parallelism)")
        return model.encode(batch["ids"]).transpose(0, 1)

    def forward(self, model, batch, hidden, norm):
        from megakernels.ops.post_training import grpo_loss

        labels = batch["labels"]
        out = grpo_loss(
            self._hidden(model, batch),
            model.output_weight,
            labels,
            batch["advantages"],
            ref_logps=batch.get("ref_logps"),
            loss_type=self.loss_type,
            beta=self.beta,
            epsilon_low=self.epsilon,
            epsilon_high=self.epsilon_high,
            max_completion_length=self.max_completion_tokens,
            num_items_in_batch=norm["tokens"],
            temperature=self.temperature,
            group=mpu.tp_group(),
            vocab_size=self.config.vocab_size,
        )
        tokens = (labels != -100).sum().float()
        if self.loss_type in ("grpo", "dr_grpo"):
            share = out.loss * (labels.shape[0] / norm["sequences"])
        elif self.loss_type == "bnpo":
            share = out.loss * (tokens / norm["tokens"])
        else:
            share = out.loss
        self._metrics.append(torch.stack([out.kl, out.entropy, out.clip_fraction]).float() * (tokens / norm["tokens"]))
        return share

    def take_metrics(self):
        if not self._metrics:
            return None
        out, self._metrics = torch.stack(self._metrics).sum(0), []
        return out


def pair_counts(documents: torch.Tensor) -> torch.Tensor:
    """The preference pairs of each sample (int ``[b]``) from its document ids ``[b, s]``: documents ``2j`` and
    ``2j + 1`` are pair ``j``, a last odd document is padding."""
    return (documents.max(dim=1).values.long() + 1) // 2


def _summed(t: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(t, group=group)
    return t


def count_labels(micro: list[dict], key: str) -> torch.Tensor:
    """The global batch's labelled tokens (``key`` other than -100), from this rank's micro-batches (collective
    over dp); at least 1."""
    count = torch.stack([(b[key] != -100).sum() for b in micro]).sum().to(torch.float32)
    if mpu.dp_size() > 1:
        dist.all_reduce(count, group=mpu.dp_group())
    return count.clamp(min=1.0)
