"""``megakernels convert``: HuggingFace GPT-2 and BERT (safetensors + config.json) ↔ megakernels checkpoints.

    megakernels convert hf-to-megakernels --input HF_DIR --output CKPT_DIR     # then: train --load CKPT_DIR
    megakernels convert megakernels-to-hf --input CKPT_DIR --output HF_DIR     # then: GPT2LMHeadModel.from_pretrained

GPT-2 and megakernels' GPT are the same architecture (pre-norm, learned positions, tanh-GeLU MLP, tied output
embedding), so both directions are exact. Only the layouts differ: GPT-2's ``Conv1D`` weights are stored
``[in, out]`` (transposed), and its fused QKV columns are ordered (q|k|v, head, head_dim) where megakernels orders
the rows (head, q|k|v, head_dim) so that a tensor-parallel shard holds whole heads.

The megakernels side is a DCP checkpoint directory as ``megakernels train --save`` writes it (``DIR/step-N`` +
``latest``), holding the model only (the optimizer starts fresh when training resumes from it) at step 0. Nothing
is downloaded; ``transformers`` is not needed (only ``safetensors``).

BERT: HuggingFace's ``BertForPreTraining`` is the original post-norm BERT (LayerNorm after each residual sum and
after the embeddings, erf GeLU). It converts *to* megakernels exactly, as a BERT with ``norm_position="post"`` and
``activation="gelu"`` (its next-sentence head becomes the two-way ``sop_head``; fine-tuning with SOP then changes
only what the head is trained on). The way back is exact for such post-norm models only: megakernels' own BERT
presets are pre-norm (what lets BERT scale, see bert.py), which no ``BertForPreTraining`` can express, so
converting one to HuggingFace is refused rather than approximated.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import warnings

import torch

from megakernels_models.config import ModelConfig

_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


class ConversionError(ValueError):
    """An input that cannot be converted exactly (the message says why)."""


def _qkv_to_megakernels(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows (3, heads, d) -> (heads, 3, d), on dim 0 of a ``[3h, ...]`` tensor."""
    rest = w.shape[1:]
    return w.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(-1, *rest).contiguous()


def _qkv_to_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    rest = w.shape[1:]
    return w.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(-1, *rest).contiguous()


def _read_hf(hf_dir: str) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    cfg_path = os.path.join(hf_dir, "config.json")
    files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors")) if os.path.isdir(hf_dir) else []
    if not os.path.exists(cfg_path) or not files:
        raise ConversionError(f"--input {hf_dir!r}: expected a HuggingFace model directory with config.json and "
                              "*.safetensors")
    with open(cfg_path) as f:
        config = json.load(f)
    tensors = {}
    for name in files:
        tensors.update(load_file(os.path.join(hf_dir, name)))
    prefix = {"gpt2": "transformer.", "bert": "bert."}.get(config.get("model_type"), "")
    return config, {k[len(prefix):] if prefix and k.startswith(prefix) else k: v for k, v in tensors.items()}


def gpt2_config(hf: dict) -> ModelConfig:
    """The megakernels GPT of a GPT-2 config; raises ConversionError where the architectures differ."""
    if hf.get("model_type") != "gpt2":
        raise ConversionError(f"expected a GPT-2 (model_type 'gpt2') or BERT checkpoint, got "
                              f"{hf.get('model_type')!r}")
    act = hf.get("activation_function", "gelu_new")
    if act not in _TANH_GELU:
        raise ConversionError(f"activation_function {act!r}: megakernels' MLP uses the tanh GeLU ({_TANH_GELU})")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if hf.get(flag):
            raise ConversionError(f"{flag}=True has no megakernels equivalent")
    if hf.get("scale_attn_weights", True) is False:
        raise ConversionError("scale_attn_weights=False has no megakernels equivalent")
    h = hf["n_embd"]
    return ModelConfig("gpt", num_layers=hf["n_layer"], hidden_size=h, num_heads=hf["n_head"],
                       seq_length=hf["n_positions"], vocab_size=hf["vocab_size"],
                       ffn_hidden_size=hf.get("n_inner") or 4 * h, dropout=hf.get("resid_pdrop", 0.1),
                       attention_dropout=hf.get("attn_pdrop", 0.1),
                       layernorm_eps=hf.get("layer_norm_epsilon", 1e-5),
                       init_std=hf.get("initializer_range", 0.02))


def bert_config(hf: dict) -> ModelConfig:
    """The megakernels (post-norm) BERT of a HuggingFace BERT config."""
    act = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}.get(hf.get("hidden_act"))
    if act is None:
        raise ConversionError(f"hidden_act {hf.get('hidden_act')!r}: megakernels' MLP uses GeLU (erf or tanh)")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ConversionError("position_embedding_type must be 'absolute' (learned positions)")
    return ModelConfig("bert", num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
                       num_heads=hf["num_attention_heads"], seq_length=hf["max_position_embeddings"],
                       vocab_size=hf["vocab_size"], ffn_hidden_size=hf["intermediate_size"],
                       dropout=hf.get("hidden_dropout_prob", 0.1),
                       attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
                       layernorm_eps=hf.get("layer_norm_eps", 1e-12), init_std=hf.get("initializer_range", 0.02),
                       num_token_types=hf.get("type_vocab_size", 2), norm_position="post", activation=act)


def _bert_to_megakernels(t: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``t``: HuggingFace tensors with the ``bert.`` prefix already removed."""
    n = cfg.num_heads
    out = {ours: t[theirs.removeprefix("bert.")] for ours, theirs in _bert_names(cfg).items()}
    for i in range(cfg.num_layers):
        a = f"encoder.layer.{i}.attention.self."
        for x in ("weight", "bias"):
            qkv = torch.cat([t[f"{a}{y}.{x}"] for y in ("query", "key", "value")])
            out[f"layers.{i}.attention.qkv.{x}"] = _qkv_to_megakernels(qkv, n)
    return out


def _megakernels_to_bert(t: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    n = cfg.num_heads
    out = {theirs: t[ours] for ours, theirs in _bert_names(cfg).items()}
    for i in range(cfg.num_layers):
        a = f"bert.encoder.layer.{i}.attention.self."
        for x in ("weight", "bias"):
            for y, part in zip(("query", "key", "value"), _qkv_to_hf(t[f"layers.{i}.attention.qkv.{x}"], n).chunk(3)):
                out[f"{a}{y}.{x}"] = part
    return out


def _bert_names(cfg: ModelConfig) -> dict[str, str]:
    """megakernels name -> HuggingFace name, for every BERT tensor that maps one to one."""
    names = {"embedding.word.weight": "bert.embeddings.word_embeddings.weight",
             "embedding.position.weight": "bert.embeddings.position_embeddings.weight",
             "embedding.token_type.weight": "bert.embeddings.token_type_embeddings.weight",
             "embedding.norm.weight": "bert.embeddings.LayerNorm.weight",
             "embedding.norm.bias": "bert.embeddings.LayerNorm.bias",
             "mlm_dense.weight": "cls.predictions.transform.dense.weight",
             "mlm_dense.bias": "cls.predictions.transform.dense.bias",
             "mlm_norm.weight": "cls.predictions.transform.LayerNorm.weight",
             "mlm_norm.bias": "cls.predictions.transform.LayerNorm.bias",
             "mlm_bias": "cls.predictions.bias", "pooler.weight": "bert.pooler.dense.weight",
             "pooler.bias": "bert.pooler.dense.bias", "sop_head.weight": "cls.seq_relationship.weight",
             "sop_head.bias": "cls.seq_relationship.bias"}
    for i in range(cfg.num_layers):
        a, m = f"bert.encoder.layer.{i}.", f"layers.{i}."
        for ours, theirs in (("attention.proj", "attention.output.dense"), ("input_norm", "attention.output.LayerNorm"),
                             ("mlp.fc1", "intermediate.dense"), ("mlp.fc2", "output.dense"),
                             ("post_attention_norm", "output.LayerNorm")):
            for x in ("weight", "bias"):
                names[f"{m}{ours}.{x}"] = f"{a}{theirs}.{x}"
    return names


def hf_to_megakernels(hf_dir: str, out_dir: str) -> str:
    """Convert a HuggingFace GPT-2 or BERT directory into a megakernels checkpoint directory; returns its path."""
    hf, t = _read_hf(hf_dir)
    if hf.get("model_type") == "bert":
        cfg = bert_config(hf)
        return write_checkpoint(_bert_to_megakernels(t, cfg), cfg, out_dir, "hf-bert")
    cfg = gpt2_config(hf)
    n = cfg.num_heads
    sd = {"model.embedding.word.weight": t["wte.weight"], "model.embedding.position.weight": t["wpe.weight"],
          "model.final_norm.weight": t["ln_f.weight"], "model.final_norm.bias": t["ln_f.bias"]}
    for i in range(cfg.num_layers):
        a, m = f"h.{i}.", f"model.layers.{i}."
        sd.update({
            m + "input_norm.weight": t[a + "ln_1.weight"], m + "input_norm.bias": t[a + "ln_1.bias"],
            m + "attention.qkv.weight": _qkv_to_megakernels(t[a + "attn.c_attn.weight"].t(), n),
            m + "attention.qkv.bias": _qkv_to_megakernels(t[a + "attn.c_attn.bias"], n),
            m + "attention.proj.weight": t[a + "attn.c_proj.weight"].t().contiguous(),
            m + "attention.proj.bias": t[a + "attn.c_proj.bias"],
            m + "post_attention_norm.weight": t[a + "ln_2.weight"],
            m + "post_attention_norm.bias": t[a + "ln_2.bias"],
            m + "mlp.fc1.weight": t[a + "mlp.c_fc.weight"].t().contiguous(), m + "mlp.fc1.bias": t[a + "mlp.c_fc.bias"],
            m + "mlp.fc2.weight": t[a + "mlp.c_proj.weight"].t().contiguous(),
            m + "mlp.fc2.bias": t[a + "mlp.c_proj.bias"]})
    return write_checkpoint({k[len("model."):]: v for k, v in sd.items()}, cfg, out_dir, "hf-gpt2")


def write_checkpoint(tensors: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str, source: str) -> str:
    """A model-only megakernels checkpoint (``out_dir/step-00000000`` + ``latest``) from full, unpadded tensors
    named as in the model (``layers.0.mlp.fc1.weight``); written in this process, no process group needed."""
    import torch.distributed.checkpoint as dcp

    from megakernels_models.checkpoint import _write_latest

    sd = {f"model.{k}": v.float().contiguous() for k, v in tensors.items()}
    sd["meta"] = json.dumps({"step": 0, "optimizer_step": 0, "config": dataclasses.asdict(cfg), "layout": {},
                             "loss_scaler": None, "converted_from": source})
    path = os.path.join(out_dir, "step-00000000")
    if os.path.exists(path):
        raise ConversionError(f"--output {out_dir!r} already holds a converted checkpoint ({path})")
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(sd, checkpoint_id=tmp, no_dist=True)
        os.rename(tmp, path)
        os.makedirs(tmp)  # TemporaryDirectory removes it again
    _write_latest(out_dir, os.path.basename(path))
    return path


def read_checkpoint(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, {name: full tensor}) of a megakernels checkpoint's model, loaded in this process (no process group)."""
    import torch.distributed.checkpoint as dcp

    from megakernels_models.checkpoint import read_latest

    path = read_latest(path)
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.items() if k.startswith("model.")}
    sd["meta"] = ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=path, no_dist=True)
    meta = json.loads(sd.pop("meta"))
    return meta, {k[len("model."):]: v for k, v in sd.items()}


def megakernels_to_hf(ckpt_dir: str, out_dir: str) -> str:
    """Write a megakernels checkpoint as a HuggingFace directory (config.json + model.safetensors): GPT-2 for a
    GPT, BertForPreTraining for a post-norm BERT (a pre-norm BERT is refused, see the module docstring)."""
    from safetensors.torch import save_file

    meta, t = read_checkpoint(ckpt_dir)
    cfg = ModelConfig(**meta["config"])
    if cfg.model == "bert":
        return _write_hf_bert(t, cfg, out_dir)
    if cfg.norm_position != "pre" or cfg.activation != "gelu_tanh":
        raise ConversionError("GPT-2 is pre-norm with the tanh GeLU; this model is not")
    n = cfg.num_heads
    out = {"wte.weight": t["embedding.word.weight"], "wpe.weight": t["embedding.position.weight"],
           "ln_f.weight": t["final_norm.weight"], "ln_f.bias": t["final_norm.bias"]}
    for i in range(cfg.num_layers):
        a, m = f"h.{i}.", f"layers.{i}."
        out.update({
            a + "ln_1.weight": t[m + "input_norm.weight"], a + "ln_1.bias": t[m + "input_norm.bias"],
            a + "attn.c_attn.weight": _qkv_to_hf(t[m + "attention.qkv.weight"], n).t(),
            a + "attn.c_attn.bias": _qkv_to_hf(t[m + "attention.qkv.bias"], n),
            a + "attn.c_proj.weight": t[m + "attention.proj.weight"].t(),
            a + "attn.c_proj.bias": t[m + "attention.proj.bias"],
            a + "ln_2.weight": t[m + "post_attention_norm.weight"], a + "ln_2.bias": t[m + "post_attention_norm.bias"],
            a + "mlp.c_fc.weight": t[m + "mlp.fc1.weight"].t(), a + "mlp.c_fc.bias": t[m + "mlp.fc1.bias"],
            a + "mlp.c_proj.weight": t[m + "mlp.fc2.weight"].t(), a + "mlp.c_proj.bias": t[m + "mlp.fc2.bias"]})
    os.makedirs(out_dir, exist_ok=True)
    save_file({"transformer." + k: v.contiguous() for k, v in out.items()},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
              "n_positions": cfg.seq_length, "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers,
              "n_head": cfg.num_heads, "n_inner": cfg.ffn_hidden_size, "activation_function": "gelu_new",
              "layer_norm_epsilon": cfg.layernorm_eps, "initializer_range": cfg.init_std,
              "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.attention_dropout,
              "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": None}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return out_dir


def _write_hf_bert(t: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str) -> str:
    from safetensors.torch import save_file

    if cfg.norm_position != "post":
        raise ConversionError("this BERT is pre-norm (megakernels' own BERT): HuggingFace's BertForPreTraining is "
                              "post-norm and cannot express it; only post-norm BERTs (converted from HuggingFace) "
                              "convert back")
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in _megakernels_to_bert(t, cfg).items()},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["BertForPreTraining"], "model_type": "bert", "vocab_size": cfg.vocab_size,
              "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
              "num_attention_heads": cfg.num_heads, "intermediate_size": cfg.ffn_hidden_size,
              "hidden_act": "gelu" if cfg.activation == "gelu" else "gelu_new",
              "max_position_embeddings": cfg.seq_length, "type_vocab_size": cfg.num_token_types,
              "layer_norm_eps": cfg.layernorm_eps, "initializer_range": cfg.init_std,
              "hidden_dropout_prob": cfg.dropout, "attention_probs_dropout_prob": cfg.attention_dropout,
              "position_embedding_type": "absolute", "tie_word_embeddings": True}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return out_dir


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="HuggingFace GPT-2 / BERT <-> megakernels checkpoint")
    p.add_argument("direction", choices=["hf-to-megakernels", "megakernels-to-hf"])
    p.add_argument("--input", required=True, help="HF model directory, or megakernels checkpoint directory")
    p.add_argument("--output", required=True, help="megakernels checkpoint directory, or HF model directory")
    p.set_defaults(_run=main)


def main(ns) -> int:
    import sys

    from megakernels_models.checkpoint import CheckpointError

    try:
        if ns.direction == "hf-to-megakernels":
            out = hf_to_megakernels(ns.input, ns.output)
        else:
            out = megakernels_to_hf(ns.input, ns.output)
    except (ConversionError, CheckpointError, KeyError) as e:
        print(f"megakernels convert: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
