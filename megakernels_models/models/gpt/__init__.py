"""The GPT family: a causal language model (GPT-2 / Megatron-LM): pre-norm LayerNorm, learned positions, tanh-GeLU
MLP with biases, the output layer tied to the word embedding; mixture-of-experts layers as an option.

Presets: ``gpt-tiny`` (the CPU default), the Megatron-LM paper's GPT sizes (Shoeybi et al. 2019, Table 1; GPT-2
vocabulary and context), the GPT-3 XL shape and a tiny MoE.
"""

from __future__ import annotations

import dataclasses

from megakernels_models.models.config import ModelConfig
from megakernels_models.models.registry import FamilySpec, register
from megakernels_models.models.tasks import CausalLMTask


@dataclasses.dataclass(frozen=True)
class GPTConfig(ModelConfig):
    """A GPT model (``ModelConfig``'s fields, GPT's defaults)."""

    model: str = "gpt"
    family = "gpt"
    DEFAULTS = dict(
        norm="layernorm", position_embedding="learned", activation="gelu_tanh", bias=True, tie_embeddings=True
    )


def _gpt(layers: int, hidden: int, heads: int, seq: int = 1024, vocab: int = 50257, **kw) -> GPTConfig:
    return GPTConfig(num_layers=layers, hidden_size=hidden, num_heads=heads, seq_length=seq, vocab_size=vocab, **kw)


_TINY = dict(seq=256, vocab=261, dropout=0.0, attention_dropout=0.0)
PRESETS = {
    "gpt-tiny": _gpt(4, 256, 8, **_TINY),  # byte-level vocabulary, for the CPU
    "gpt-1.2b": _gpt(40, 1536, 16),
    "gpt-2.5b": _gpt(54, 1920, 20),
    "gpt-4.2b": _gpt(64, 2304, 24),
    "gpt-8.3b": _gpt(72, 3072, 32),
    "gpt-1.3b": _gpt(24, 2048, 16, seq=2048),  # GPT-3 XL (the 1.3B single-GPU MFU benchmark)
    "gpt-moe-tiny": _gpt(4, 256, 8, **_TINY, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=512, moe_normalize=False),
}


def _model():
    from megakernels_models.models.gpt.model import GPTModel

    return GPTModel


def _hf(config):
    from megakernels_models.convert import gpt2

    return gpt2


SPEC = register(FamilySpec("gpt", "GPT", GPTConfig, _model, CausalLMTask, "tokens", PRESETS, hf=_hf))
