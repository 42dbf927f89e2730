"""``megakernels convert``: HuggingFace GPT-2 (safetensors + config.json) ↔ megakernels checkpoints.

    megakernels convert hf-to-megakernels --input HF_DIR --output CKPT_DIR     # then: train --load CKPT_DIR
    megakernels convert megakernels-to-hf --input CKPT_DIR --output HF_DIR     # then: GPT2LMHeadModel.from_pretrained

GPT-2 and megakernels' GPT are the same architecture (pre-norm, learned positions, tanh-GeLU MLP, tied output
embedding), so both directions are exact. Only the layouts differ: GPT-2's ``Conv1D`` weights are stored
``[in, out]`` (transposed), and its fused QKV columns are ordered (q|k|v, head, head_dim) where megakernels orders
the rows (head, q|k|v, head_dim) so that a tensor-parallel shard holds whole heads.

The megakernels side is a DCP checkpoint directory as ``megakernels train --save`` writes it (``DIR/step-N`` +
``latest``), holding the model only (the optimizer starts fresh when training resumes from it) at step 0. Nothing
is downloaded; ``transformers`` is not needed (only ``safetensors``).

BERT: megakernels' BERT is pre-norm (see bert.py); HuggingFace's ``BertForPreTraining`` is the original post-norm
BERT, so no conversion between them preserves the function in either direction, and none is offered: converting
would silently give a different model.
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
    return config, {k[len("transformer."):] if k.startswith("transformer.") else k: v for k, v in tensors.items()}


def gpt2_config(hf: dict) -> ModelConfig:
    """The megakernels GPT of a GPT-2 config; raises ConversionError where the architectures differ."""
    if hf.get("model_type") != "gpt2":
        raise ConversionError(f"only GPT-2 checkpoints convert (model_type 'gpt2'), got {hf.get('model_type')!r}"
                              + (" — BERT is post-norm in HuggingFace and pre-norm here" if hf.get("model_type")
                                 == "bert" else ""))
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


def hf_to_megakernels(hf_dir: str, out_dir: str) -> str:
    """Convert a HuggingFace GPT-2 directory into a megakernels checkpoint directory; returns the checkpoint path."""
    hf, t = _read_hf(hf_dir)
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
    """Write a megakernels GPT checkpoint as a HuggingFace GPT-2 directory (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    meta, t = read_checkpoint(ckpt_dir)
    cfg = ModelConfig(**meta["config"])
    if cfg.model != "gpt":
        raise ConversionError(f"--input {ckpt_dir!r} holds a {cfg.model} model; only GPT converts to HuggingFace "
                              "(GPT-2)")
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


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="HuggingFace GPT-2 <-> megakernels checkpoint")
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
