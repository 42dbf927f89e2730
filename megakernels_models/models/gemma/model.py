"""Gemma: the shared causal chunk (``models/gpt/model.py``) of a Gemma configuration; the sandwich norms, the
scaled embedding, the scores' scale, the GeGLU MLP and the per-layer windows and rotary bases are options of the
shared layers (``models/transformer.py``)."""

from __future__ import annotations

from megakernels_models.models.gpt.model import GPTModel


class GemmaModel(GPTModel):
    """A Gemma pipeline chunk; ``forward`` as ``GPTModel``'s."""

    family = "gemma"
