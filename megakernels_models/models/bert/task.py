"""BERT's training objective (``models.tasks.Task``)."""

from __future__ import annotations

from megakernels_models.models.tasks import Task, count_labels


class BertTask(Task):
    """BERT pre-training: masked-LM cross-entropy averaged over the global batch's masked tokens, plus
    sentence-order prediction averaged over its samples."""

    def normalizers(self, micro, global_batch, device):
        return {"tokens": count_labels(micro, "mlm_labels"), "samples": global_batch}

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
