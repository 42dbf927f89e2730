"""HuggingFace ``BertForPreTraining`` <-> megakernels BERT.

HuggingFace's BERT is the original post-norm BERT (LayerNorm after each residual sum and after the embeddings, erf
GeLU). It converts *to* megakernels exactly, as a BERT with ``norm_position="post"`` and ``activation="gelu"``
(its next-sentence head becomes the two-way ``sop_head``; fine-tuning with SOP then changes only what the head is
trained on). The way back is exact for such post-norm models only: megakernels' own BERT presets are pre-norm
(what lets BERT scale, see bert.py), which no ``BertForPreTraining`` can express, so converting one is refused
rather than approximated.
"""

from __future__ import annotations

import torch

from megakernels_models.convert.common import ConversionError, Rule, copy
from megakernels_models.models.config import ModelConfig

MODEL_TYPE = "bert"
# The position ids buffer (arange) some checkpoints hold: no weight.
IGNORED = (r"\.position_ids$",)
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def split_qkv_rule(ours: str, theirs: tuple[str, str, str], heads: int) -> Rule:
    """Separate query/key/value tensors <-> our fused rows ordered (head, q|k|v, head_dim)."""

    def to_ours(ts):
        rest = ts[0].shape[1:]
        return [torch.stack([t.reshape(heads, -1, *rest) for t in ts], 1).reshape(-1, *rest).contiguous()]

    def to_theirs(ts):
        rest = ts[0].shape[1:]
        return [t.reshape(-1, *rest).contiguous() for t in ts[0].reshape(heads, 3, -1, *rest).unbind(1)]

    return Rule((ours,), theirs, to_ours, to_theirs)


def rules(cfg: ModelConfig) -> list[Rule]:
    out = [
        copy(ours, theirs)
        for ours, theirs in (
            ("embedding.word.weight", "bert.embeddings.word_embeddings.weight"),
            ("embedding.position.weight", "bert.embeddings.position_embeddings.weight"),
            ("embedding.token_type.weight", "bert.embeddings.token_type_embeddings.weight"),
            ("embedding.norm.weight", "bert.embeddings.LayerNorm.weight"),
            ("embedding.norm.bias", "bert.embeddings.LayerNorm.bias"),
            ("mlm_dense.weight", "cls.predictions.transform.dense.weight"),
            ("mlm_dense.bias", "cls.predictions.transform.dense.bias"),
            ("mlm_norm.weight", "cls.predictions.transform.LayerNorm.weight"),
            ("mlm_norm.bias", "cls.predictions.transform.LayerNorm.bias"),
            ("mlm_bias", "cls.predictions.bias"),
            ("pooler.weight", "bert.pooler.dense.weight"),
            ("pooler.bias", "bert.pooler.dense.bias"),
            ("sop_head.weight", "cls.seq_relationship.weight"),
            ("sop_head.bias", "cls.seq_relationship.bias"),
        )
    ]
    for i in range(cfg.num_layers):
        a, m = f"bert.encoder.layer.{i}.", f"layers.{i}."
        for x in ("weight", "bias"):
            out.append(
                split_qkv_rule(
                    f"{m}attention.qkv.{x}",
                    tuple(f"{a}attention.self.{y}.{x}" for y in ("query", "key", "value")),
                    cfg.num_heads,
                )
            )
            for ours, theirs in (
                ("attention.proj", "attention.output.dense"),
                ("input_norm", "attention.output.LayerNorm"),
                ("mlp.fc1", "intermediate.dense"),
                ("mlp.fc2", "output.dense"),
                ("post_attention_norm", "output.LayerNorm"),
            ):
                out.append(copy(f"{m}{ours}.{x}", f"{a}{theirs}.{x}"))
    return out


def tied(cfg: ModelConfig) -> dict[str, str]:
    """The MLM decoder's weight and bias, where a checkpoint stores them: the word embedding and the MLM bias."""
    return {
        "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias",
    }


def normalize(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Names of a ``BertForPreTraining`` (a bare ``BertModel`` saves them without the ``bert.`` prefix)."""
    return {k if k.startswith(("bert.", "cls.")) else "bert." + k: v for k, v in tensors.items()}


def config_to_ours(hf: dict) -> ModelConfig:
    """The megakernels (post-norm) BERT of a HuggingFace BERT config."""
    act = HF_ACTIVATIONS.get(hf.get("hidden_act"))
    if act is None:
        raise ConversionError(f"hidden_act {hf.get('hidden_act')!r}: megakernels' MLP uses GeLU (erf or tanh)")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ConversionError("position_embedding_type must be 'absolute' (learned positions)")
    return ModelConfig(
        "bert",
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_heads=hf["num_attention_heads"],
        seq_length=hf["max_position_embeddings"],
        vocab_size=hf["vocab_size"],
        ffn_hidden_size=hf["intermediate_size"],
        dropout=hf.get("hidden_dropout_prob", 0.1),
        attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
        layernorm_eps=hf.get("layer_norm_eps", 1e-12),
        init_std=hf.get("initializer_range", 0.02),
        num_token_types=hf.get("type_vocab_size", 2),
        norm_position="post",
        activation=act,
    )


def config_to_theirs(cfg: ModelConfig) -> dict:
    if cfg.norm_position != "post":
        raise ConversionError(
            "this BERT is pre-norm (megakernels' own BERT): HuggingFace's BertForPreTraining is "
            "post-norm and cannot express it; only post-norm BERTs (converted from HuggingFace) "
            "convert back"
        )
    return {
        "architectures": ["BertForPreTraining"],
        "model_type": "bert",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.ffn_hidden_size,
        "hidden_act": "gelu" if cfg.activation == "gelu" else "gelu_new",
        "max_position_embeddings": cfg.seq_length,
        "type_vocab_size": cfg.num_token_types,
        "layer_norm_eps": cfg.layernorm_eps,
        "initializer_range": cfg.init_std,
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.attention_dropout,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": True,
    }
