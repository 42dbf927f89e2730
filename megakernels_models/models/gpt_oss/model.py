"""gpt-oss: the shared causal chunk (``models/gpt/model.py``) of a gpt-oss configuration; the experts' biases and
clamped SwiGLU, the router's softmax over the chosen logits, the sinks and the alternating windows are options of
the shared layers (``models/transformer.py``, ``megakernels.parallel.moe``)."""

from __future__ import annotations

from megakernels_models.models.gpt.model import GPTModel


class GptOssModel(GPTModel):
    """A gpt-oss pipeline chunk; ``forward`` as ``GPTModel``'s."""

    family = "gpt_oss"
