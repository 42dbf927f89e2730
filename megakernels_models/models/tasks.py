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


class CausalLMTask(Task):
    """Next-token prediction (the causal language models): mean cross-entropy over every labelled token of the
    global batch.

    A batch of packed sequences also holds ``documents`` (int ``[b, s]``: each token's document, non-decreasing)
    and/or ``positions`` (``[b, s]``: each token's position in its document); attention then stays within each
    document and positions restart per document. Labels of -100 (a document's last token, prompts in supervised
    fine-tuning, padding) are not counted: the loss is the sum over the labelled tokens divided by their number in
    the whole global batch, so it does not depend on how samples were packed or split over micro-batches and
    ranks."""

    def normalizers(self, micro, global_batch, device):
        return {"tokens": count_labels(micro, "labels")}  # every token of the global batch when none is -100

    def forward(self, model, batch, hidden, norm):
        packed = {}
        if "documents" in batch or "positions" in batch:
            packed["documents"] = (batch.get("documents"), batch.get("positions"))
        out = model(
            ids=batch["ids"] if model.pre_process else None,
            labels=batch["labels"] if model.post_process else None,
            hidden=hidden,
            **packed,
        )
        return out.sum() / norm["tokens"] if model.post_process else out


def count_labels(micro: list[dict], key: str) -> torch.Tensor:
    """The global batch's labelled tokens (``key`` other than -100), from this rank's micro-batches (collective
    over dp); at least 1."""
    count = torch.stack([(b[key] != -100).sum() for b in micro]).sum().to(torch.float32)
    if mpu.dp_size() > 1:
        dist.all_reduce(count, group=mpu.dp_group())
    return count.clamp(min=1.0)
