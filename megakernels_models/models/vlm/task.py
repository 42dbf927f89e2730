"""A vision-language model's training objective (``models.tasks.Task``)."""

from __future__ import annotations

from megakernels_models.models.tasks import Task, count_labels


class VisionLanguageTask(Task):
    """Captioning: cross-entropy averaged over the global batch's caption tokens (labels other than -100), plus
    ``contrastive_coeff`` × the CLIP-style image–caption loss averaged over its samples."""

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
        return {"tokens": count_labels(micro, "labels"), "samples": global_batch}

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
