"""The BERT family: a bidirectional encoder pre-trained with masked-LM and sentence-order prediction (Megatron-LM's
BERT: pre-norm; post-norm for models converted from HuggingFace), learned positions and segment (token-type)
embeddings, GeLU MLP with biases, the MLM head tied to the word embedding.

Presets: ``bert-tiny`` (the CPU default) and the Megatron-LM paper's BERT sizes (Shoeybi et al. 2019, §4;
WordPiece vocabulary).
"""

from __future__ import annotations

import dataclasses

from megakernels.validation import positive_int
from megakernels_models.models.config import ModelConfig
from megakernels_models.models.registry import FamilySpec, register, titles


@dataclasses.dataclass(frozen=True)
class BertConfig(ModelConfig):
    """A BERT model: ``ModelConfig``'s fields and the segment embeddings' count (``num_token_types``)."""

    model: str = "bert"
    num_token_types: int = 2
    family = "bert"
    DEFAULTS = dict(
        norm="layernorm", position_embedding="learned", activation="gelu_tanh", bias=True, tie_embeddings=True
    )

    def _check_family(self) -> None:
        positive_int(self.num_token_types, "num_token_types", where="ModelConfig")
        if self.num_experts:
            raise ValueError("ModelConfig: a BERT model is dense (num_experts=0; experts are for the decoders)")

    def _check_architecture(self) -> None:
        if self.position_embedding != "learned" or self.activation == "swiglu":
            raise ValueError("ModelConfig: the BERT family has learned positions and a GeLU MLP")

    def _layout_limits(self) -> dict:
        lms = titles(lambda s: s.text_generation)
        return {
            "context_parallel": f": context parallelism is for causal language models ({lms}); BERT's padding masks "
            "are not split over the ring"
        }

    def main_forward_flops_per_token(self) -> dict[str, float]:
        """As every family's, plus the MLM head's transform (a dense h×h layer before the output layer)."""
        out = super().main_forward_flops_per_token()
        return {**out, "head": out["head"] + 2.0 * self.hidden_size**2}


def _bert(layers: int, hidden: int, heads: int, seq: int = 512, vocab: int = 30522, **kw) -> BertConfig:
    return BertConfig(num_layers=layers, hidden_size=hidden, num_heads=heads, seq_length=seq, vocab_size=vocab, **kw)


PRESETS = {
    "bert-tiny": _bert(4, 192, 6, seq=128, vocab=261, dropout=0.0, attention_dropout=0.0),  # for the CPU
    "bert-336m": _bert(24, 1024, 16),
    "bert-1.3b": _bert(24, 2048, 32),
    "bert-3.9b": _bert(48, 2560, 40),
}


def _model():
    from megakernels_models.models.bert.model import BertModel

    return BertModel


def _task(config, model_class):
    from megakernels_models.models.bert.task import BertTask

    return BertTask(config, model_class)


def _hf(config):
    from megakernels_models.convert import bert

    return bert


SPEC = register(
    FamilySpec(
        "bert", "BERT", BertConfig, _model, _task, "sentences", PRESETS, causal=False, text_generation=False, hf=_hf
    )
)
