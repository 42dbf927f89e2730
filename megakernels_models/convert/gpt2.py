"""GPT-2 (``GPT2LMHeadModel``) <-> megakernels GPT: the same architecture (pre-norm, learned positions, tanh-GeLU
MLP, the output layer tied to the word embedding or, with ``tie_word_embeddings=false``, its own ``lm_head``), so
both directions are exact. Only layouts differ: GPT-2's ``Conv1D`` weights are
``[in, out]``, and its fused QKV columns are ordered (q|k|v, head, head_dim) where megakernels orders the rows
(head, q|k|v, head_dim) so that a tensor-parallel shard holds whole heads."""

from __future__ import annotations

import torch

from megakernels_models.convert.common import ConversionError, Rule, copy, transposed
from megakernels_models.models.config import ModelConfig

MODEL_TYPE = "gpt2"
# Buffers some GPT-2 checkpoints hold that are no weights: the causal mask and its fill value of older transformers.
IGNORED = (r"\.attn\.(bias|masked_bias)$",)
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
_PREFIX = "transformer."


def qkv_rule(ours: str, theirs: str, heads: int, conv1d: bool) -> Rule:
    """A fused QKV tensor: HuggingFace (3, heads, d) rows (columns of a ``Conv1D`` weight) <-> ours (heads, 3, d)."""

    def regroup(t, a, b):
        rest = t.shape[1:]
        return t.reshape(a, b, -1, *rest).transpose(0, 1).reshape(-1, *rest).contiguous()

    def to_ours(ts):
        t = ts[0].t() if conv1d else ts[0]
        return [regroup(t, 3, heads)]

    def to_theirs(ts):
        t = regroup(ts[0], heads, 3)
        return [t.t().contiguous() if conv1d else t]

    return Rule((ours,), (theirs,), to_ours, to_theirs)


def rules(cfg: ModelConfig) -> list[Rule]:
    p, n = _PREFIX, cfg.num_heads
    out = [
        copy("embedding.word.weight", p + "wte.weight"),
        copy("embedding.position.weight", p + "wpe.weight"),
        copy("final_norm.weight", p + "ln_f.weight"),
        copy("final_norm.bias", p + "ln_f.bias"),
    ]
    if not cfg.tie_embeddings:
        out.append(copy("output_layer.weight", "lm_head.weight"))
    for i in range(cfg.num_layers):
        a, m = f"{p}h.{i}.", f"layers.{i}."
        out += [
            qkv_rule(m + "attention.qkv.weight", a + "attn.c_attn.weight", n, conv1d=True),
            qkv_rule(m + "attention.qkv.bias", a + "attn.c_attn.bias", n, conv1d=False),
            transposed(m + "attention.proj.weight", a + "attn.c_proj.weight"),
            transposed(m + "mlp.fc1.weight", a + "mlp.c_fc.weight"),
            transposed(m + "mlp.fc2.weight", a + "mlp.c_proj.weight"),
        ]
        for ours, theirs in (
            ("input_norm", "ln_1"),
            ("post_attention_norm", "ln_2"),
            ("attention.proj", "attn.c_proj"),
            ("mlp.fc1", "mlp.c_fc"),
            ("mlp.fc2", "mlp.c_proj"),
        ):
            out.append(copy(f"{m}{ours}.bias", f"{a}{theirs}.bias"))
        out += [
            copy(m + "input_norm.weight", a + "ln_1.weight"),
            copy(m + "post_attention_norm.weight", a + "ln_2.weight"),
        ]
    return out


def tied(cfg: ModelConfig) -> dict[str, str]:
    """A tied model's head, where a checkpoint stores it anyway: it must be the word embedding."""
    return {"lm_head.weight": _PREFIX + "wte.weight"} if cfg.tie_embeddings else {}


def normalize(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Names of a ``GPT2LMHeadModel`` (a bare ``GPT2Model`` saves them without the ``transformer.`` prefix)."""
    return {k if k.startswith((_PREFIX, "lm_head.")) else _PREFIX + k: v for k, v in tensors.items()}


def config_to_ours(hf: dict) -> ModelConfig:
    """The megakernels GPT of a GPT-2 config.

    Raises:
        ConversionError: where the architectures differ (naming the setting).
    """
    act = hf.get("activation_function", "gelu_new")
    if act not in _TANH_GELU:
        raise ConversionError(f"activation_function {act!r}: megakernels' MLP uses the tanh GeLU ({_TANH_GELU})")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if hf.get(flag):
            raise ConversionError(f"{flag}=True has no megakernels equivalent")
    if hf.get("scale_attn_weights", True) is False:
        raise ConversionError("scale_attn_weights=False has no megakernels equivalent")
    h = hf["n_embd"]
    return ModelConfig(
        "gpt",
        num_layers=hf["n_layer"],
        hidden_size=h,
        num_heads=hf["n_head"],
        seq_length=hf["n_positions"],
        vocab_size=hf["vocab_size"],
        ffn_hidden_size=hf.get("n_inner") or 4 * h,
        dropout=hf.get("resid_pdrop", 0.1),
        attention_dropout=hf.get("attn_pdrop", 0.1),
        layernorm_eps=hf.get("layer_norm_epsilon", 1e-5),
        init_std=hf.get("initializer_range", 0.02),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def config_to_theirs(cfg: ModelConfig) -> dict:
    """The GPT-2 config of a megakernels GPT.

    Raises:
        ConversionError: a GPT GPT-2 cannot express (post-norm or erf GeLU).
    """
    if cfg.norm_position != "pre" or cfg.activation != "gelu_tanh":
        raise ConversionError("GPT-2 is pre-norm with the tanh GeLU; this model is not")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.seq_length,
        "n_embd": cfg.hidden_size,
        "n_layer": cfg.num_layers,
        "n_head": cfg.num_heads,
        "n_inner": cfg.ffn_hidden_size,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.layernorm_eps,
        "initializer_range": cfg.init_std,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.attention_dropout,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": None,
    }
