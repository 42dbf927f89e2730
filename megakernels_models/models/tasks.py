"""What a model family trains on: how a pipeline chunk is built, and how a micro-batch becomes a loss.

The trainer (``train.py``) is the same for every family; a ``Task`` holds what differs:

- ``build_chunk``: one pipeline chunk of the family's model;
- ``normalizers``: the loss denominators of the whole global batch (so a loss does not depend on how the batch is
  split over micro-batches and data-parallel ranks);
- ``forward``: one chunk on one micro-batch — the hidden state to send on, or, on the last stage, the micro-batch's
  share of the global loss.

Losses are sums over the micro-batch divided by the global batch's denominators, so summing the micro-batches'
losses over every data-parallel rank gives exactly the single-process loss of the global batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import megakernels.parallel as mpu
from megakernels_models.models.config import ModelConfig


class Task:
    """A model family's training objective (see the module docstring)."""

    model_class: type

    def __init__(self, config: ModelConfig):
        self.config = config

    def build_chunk(self, seed: int, **kwargs) -> torch.nn.Module:
        """One pipeline chunk (kwargs: ``layers``, ``pre_process``, ``post_process``, ``sequence_parallel``,
        ``attention``, ``recompute``, ``device``)."""
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
    """Next-token prediction (GPT, Llama): mean cross-entropy over every token of the global batch."""

    def __init__(self, config: ModelConfig):
        from megakernels_models.models.gpt.model import GPTModel
        from megakernels_models.models.llama.model import LlamaModel

        super().__init__(config)
        self.model_class = LlamaModel if config.model == "llama" else GPTModel

    def normalizers(self, micro, global_batch, device):
        return {"tokens": global_batch * self.config.seq_length}

    def forward(self, model, batch, hidden, norm):
        out = model(
            ids=batch["ids"] if model.pre_process else None,
            labels=batch["labels"] if model.post_process else None,
            hidden=hidden,
        )
        return out.sum() / norm["tokens"] if model.post_process else out


class BertTask(Task):
    """BERT pre-training: masked-LM cross-entropy averaged over the global batch's masked tokens, plus
    sentence-order prediction averaged over its samples."""

    def __init__(self, config: ModelConfig):
        from megakernels_models.models.bert.model import BertModel

        super().__init__(config)
        self.model_class = BertModel

    def normalizers(self, micro, global_batch, device):
        return {"tokens": _count_labels(micro, "mlm_labels"), "samples": global_batch}

    def forward(self, model, batch, hidden, norm):
        out = model(
            ids=batch["ids"] if model.pre_process else None,
            token_types=batch["token_types"],
            padding_mask=batch["padding_mask"],
            mlm_labels=batch["mlm_labels"] if model.post_process else None,
            sop_labels=batch["sop_labels"],
            hidden=hidden,
        )
        if not model.post_process:
            return out
        mlm, sop = out
        return mlm.sum() / norm["tokens"] + sop.sum() / norm["samples"]


class VisionLanguageTask(Task):
    """Captioning (``vlm``): cross-entropy averaged over the global batch's caption tokens (labels other than
    -100), plus ``contrastive_coeff`` × the CLIP-style image–caption loss averaged over its samples."""

    def __init__(self, config: ModelConfig):
        from megakernels_models.models.vlm.model import VLMModel

        super().__init__(config)
        self.model_class = VLMModel

    # --freeze's groups: the top-level modules each names (the usual two-stage recipe freezes vision and lm,
    # training the projector, then unfreezes the language model)
    GROUPS = {
        "vision": ("vision",),
        "projector": ("projector",),
        "cross": ("cross",),
        "lm": ("embedding", "layers", "final_norm", "output_layer", "output_embedding"),
    }

    def is_frozen(self, name, parts):
        top = name.split(".", 1)[0]
        return any(top in self.GROUPS[p] if p in self.GROUPS else p in name for p in parts)

    def normalizers(self, micro, global_batch, device):
        return {"tokens": _count_labels(micro, "labels"), "samples": global_batch}

    def forward(self, model, batch, hidden, norm):
        first = model.pre_process
        out = model(
            images=batch["images"] if first else None,
            ids=batch["ids"] if first else None,
            labels=batch["labels"] if model.post_process else None,
            hidden=hidden,
        )
        if not model.post_process:
            return out
        if isinstance(out, tuple):
            lm, contrastive = out
            return lm.sum() / norm["tokens"] + self.config.contrastive_coeff * contrastive.sum() / norm["samples"]
        return out.sum() / norm["tokens"]


def _count_labels(micro: list[dict], key: str) -> torch.Tensor:
    """The global batch's labelled tokens (``key`` other than -100), from this rank's micro-batches (collective
    over dp); at least 1."""
    count = torch.stack([(b[key] != -100).sum() for b in micro]).sum().to(torch.float32)
    if mpu.dp_size() > 1:
        dist.all_reduce(count, group=mpu.dp_group())
    return count.clamp(min=1.0)


TASKS: dict[str, type[Task]] = {"gpt": CausalLMTask, "llama": CausalLMTask, "bert": BertTask, "vlm": VisionLanguageTask}


def task_for(config: ModelConfig) -> Task:
    """The task of ``config.model``."""
    return TASKS[config.model](config)
