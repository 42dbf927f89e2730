"""Qwen: the Llama chunk (``models/llama/model.py``) of a Qwen configuration; the q/k/v biases and the per-head
q/k norms are options of the shared grouped-query attention block."""

from __future__ import annotations

from megakernels_models.models.gpt.model import GPTModel


class QwenModel(GPTModel):
    """A Qwen pipeline chunk; ``forward`` as ``GPTModel``'s."""

    family = "qwen"
