"""DeepSeek-V3: the shared causal chunk (``models/gpt/model.py``) of a DeepSeek configuration; multi-head latent
attention (``megakernels.parallel.mla``) and the DeepSeek mixture of experts (sigmoid, group-limited routing, the
balancing bias, shared experts, dense first layers) are options of the shared layers (``models/transformer.py``,
``megakernels.parallel.moe``)."""

from __future__ import annotations

from megakernels_models.models.gpt.model import GPTModel


class DeepseekModel(GPTModel):
    """A DeepSeek pipeline chunk; ``forward`` as ``GPTModel``'s."""

    family = "deepseek"
