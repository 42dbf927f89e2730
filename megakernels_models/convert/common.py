"""What every conversion shares: reading and writing HuggingFace directories, megakernels checkpoints, and the
name/layout mapping between them written once and applied in both directions.

A family's mapping is a list of ``Rule``: megakernels tensor names ``ours``, HuggingFace names ``theirs``, and a
pair of inverse functions between the two lists of tensors (``copy``, ``transposed``, or a family's own, e.g. the
fused QKV re-ordering). ``apply(rules, tensors, "to_ours")`` and ``apply(rules, tensors, "to_theirs")`` run the
same table forwards and backwards, so a name can never be mapped one way and forgotten the other.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
import warnings
from collections.abc import Callable

import torch

from megakernels_models.models.config import ModelConfig

Tensors = list[torch.Tensor]


class ConversionError(ValueError):
    """An input that cannot be converted exactly (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Rule:
    """``ours`` (megakernels names) <-> ``theirs`` (HuggingFace names) through two inverse functions."""

    ours: tuple[str, ...]
    theirs: tuple[str, ...]
    to_ours: Callable[[Tensors], Tensors]
    to_theirs: Callable[[Tensors], Tensors]


def copy(ours: str, theirs: str) -> Rule:
    return Rule((ours,), (theirs,), list, list)


def transposed(ours: str, theirs: str) -> Rule:
    """HuggingFace ``Conv1D`` weights are ``[in, out]``; ours ``[out, in]`` (``nn.Linear``)."""
    flip = lambda ts: [ts[0].t().contiguous()]  # noqa: E731
    return Rule((ours,), (theirs,), flip, flip)


def apply(
    rules: list[Rule],
    tensors: dict[str, torch.Tensor],
    direction: str,
    ignored: tuple[str, ...] = (),
    tied: dict[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """Map ``tensors`` by ``rules`` in ``direction`` (``"to_ours"`` or ``"to_theirs"``). Strict: every input tensor
    is consumed by exactly one rule, or matches one of the ``ignored`` patterns (regular expressions, searched: a
    family's documented buffers that hold no weights, e.g. an old GPT-2's causal-mask ``attn.bias``), or is a copy
    its model ties to another input tensor (``tied``: name -> the tensor it must equal).

    Raises:
        ConversionError: a tensor a rule needs is missing, a tensor no rule consumes (naming them), a tensor two
            rules consume, or a tied copy that differs from its source.
    """
    src, dst = ("theirs", "ours") if direction == "to_ours" else ("ours", "theirs")
    out, used = {}, set()
    for rule in rules:
        names = getattr(rule, src)
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ConversionError(f"the input has no tensor {missing[0]!r}")
        twice = used.intersection(names)
        if twice:
            raise ConversionError(f"two rules map the input tensor {sorted(twice)[0]!r}")
        used.update(names)
        for name, t in zip(getattr(rule, dst), getattr(rule, direction)([tensors[n] for n in names])):
            out[name] = t
    for name, source in (tied or {}).items():
        if name in tensors and name not in used:
            if source not in tensors or not torch.equal(tensors[name], tensors[source]):
                raise ConversionError(
                    f"the input's {name!r} differs from {source!r}, but the model ties them (one tensor); "
                    "a model with its own output layer sets tie_word_embeddings=false"
                )
            used.add(name)
    left = sorted(n for n in tensors if n not in used and not any(re.search(p, n) for p in ignored))
    if left:
        shown = ", ".join(repr(n) for n in left[:8]) + (f" and {len(left) - 8} more" if len(left) > 8 else "")
        raise ConversionError(
            f"{len(left)} input tensor(s) that no rule of this model maps: {shown} (a setting of the model that "
            "the conversion does not know would drop them)"
        )
    return out


# ---- HuggingFace directories ------------------------------------------------------------------------------------


def deepseek_routing(cfg: ModelConfig) -> list[str]:
    """The DeepSeek-V3 routing settings ``cfg`` uses (sigmoid scores, group-limited top-k, routed scaling, the
    balancing bias, dense first layers), by name: what a softmax-routed family's converter must refuse."""
    used = {
        "moe_score='sigmoid'": cfg.moe_score != "softmax",
        "moe_n_group > 1": cfg.moe_n_group != 1,
        "moe_routed_scaling != 1": cfg.moe_routed_scaling != 1.0,
        "moe_expert_bias": cfg.moe_expert_bias,
        "moe_first_dense > 0": cfg.moe_first_dense != 0,
    }
    return [name for name, on in used.items() if on]


def read_hf(hf_dir: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config.json, {name: tensor})`` of a HuggingFace model directory: one ``*.safetensors`` file or several
    named by ``model.safetensors.index.json`` (sharded).

    Raises:
        ConversionError: not such a directory, or an index naming a missing file.
    """
    from safetensors.torch import load_file

    cfg_path = os.path.join(hf_dir, "config.json")
    files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors")) if os.path.isdir(hf_dir) else []
    if not os.path.exists(cfg_path) or not files:
        raise ConversionError(
            f"--input {hf_dir!r}: expected a HuggingFace model directory with config.json and *.safetensors"
        )
    with open(cfg_path) as f:
        config = json.load(f)
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    tensors = {}
    for name in files:
        path = os.path.join(hf_dir, name)
        if not os.path.exists(path):
            raise ConversionError(f"--input {hf_dir!r}: the index names {name}, which is missing")
        tensors.update(load_file(path))
    return config, tensors


def write_hf(tensors: dict[str, torch.Tensor], config: dict, out_dir: str, max_shard_bytes: int = 5 << 30) -> str:
    """Write ``config.json`` and the tensors as safetensors: one ``model.safetensors``, or shards of at most
    ``max_shard_bytes`` with a ``model.safetensors.index.json`` (as ``save_pretrained`` does)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    shards, size = [{}], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return out_dir


# ---- megakernels checkpoints --------------------------------------------------------------------------------------


def write_checkpoint(tensors: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str, source: str) -> str:
    """A model-only megakernels checkpoint (``out_dir/step-00000000`` + ``latest``) from full, unpadded tensors
    named as in the model (``layers.0.mlp.fc1.weight``); written in this process, no process group needed.

    Raises:
        ConversionError: ``out_dir`` already holds a converted checkpoint.
    """
    import torch.distributed.checkpoint as dcp

    from megakernels_models.training.checkpoint import Writer
    from megakernels_models.training.checkpoint_store import write_latest

    sd = {f"model.{k}": v.float().contiguous() for k, v in tensors.items()}
    sd["meta"] = json.dumps(
        {
            "step": 0,
            "optimizer_step": 0,
            "config": dataclasses.asdict(cfg),
            "layout": {},
            "loss_scaler": None,
            "converted_from": source,
        }
    )
    path = os.path.join(out_dir, "step-00000000")
    if os.path.exists(path):
        raise ConversionError(f"--output {out_dir!r} already holds a converted checkpoint ({path})")
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(sd, storage_writer=Writer(tmp, 0), no_dist=True)  # with its digests
        os.rename(tmp, path)
        os.makedirs(tmp)  # TemporaryDirectory removes it again
    write_latest(out_dir, os.path.basename(path))
    return path


def read_checkpoint(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, {name: full tensor}) of a megakernels checkpoint's model, loaded in this process (no process group)."""
    import torch.distributed.checkpoint as dcp

    from megakernels_models.training.checkpoint import read_latest

    path = read_latest(path)
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.items() if k.startswith("model.")}
    sd["meta"] = ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=path, no_dist=True)
    meta = json.loads(sd.pop("meta"))
    return meta, {k[len("model.") :]: v for k, v in sd.items()}
