"""Configuration files for ``megakernels train --config FILE`` (YAML or JSON) and ``--print-config``.

A file is a mapping of trainer settings by their names (``tp: 8``, ``global_batch_size: 512``; dashes or
underscores), optionally with an ``architecture:`` mapping of ``ModelConfig`` fields that defines the model itself
instead of a preset. Flags given on the command line override the file. Unknown names are refused with the
nearest valid one suggested. ``--print-config`` prints the resolved settings in this same format (the model's
architecture included), so its output is a file that reproduces the run; the same resolved configuration is saved
in every checkpoint and written at the top of the JSONL log.

``configs/`` in the repository ships every preset (``configs/presets/<name>.yaml``, the presets' architectures) and
example jobs (``configs/jobs/``).
"""

from __future__ import annotations

import dataclasses
import difflib
import json

from megakernels_models.settings import ArgumentError

ARCHITECTURE = "architecture"


def _suggest(name: str, valid) -> str:
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def load(path: str) -> dict:
    """The settings in the YAML/JSON file ``path``, names normalised to underscores, checked against ``TrainArgs``
    and ``ModelConfig``.

    Raises:
        ArgumentError: an unreadable or malformed file, or an unknown name (naming the file, the name and the
            nearest valid one).
    """
    from megakernels_models.arguments import TrainArgs
    from megakernels_models.config import ModelConfig

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ArgumentError(f"--config {path}: {e.strerror}") from None
    import yaml

    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise ArgumentError(f"--config {path}: not valid {'JSON' if path.endswith('.json') else 'YAML'}: {e}") \
            from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ArgumentError(f"--config {path}: expected a mapping of settings, got a {type(data).__name__}")
    valid = {f.name for f in dataclasses.fields(TrainArgs) if f.metadata.get("cli")} - {ARCHITECTURE}
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name == ARCHITECTURE:
            out[name] = _architecture(path, value, {f.name for f in dataclasses.fields(ModelConfig)})
        elif name not in valid:
            raise ArgumentError(f"--config {path}: unknown setting {key!r}{_suggest(name, valid | {ARCHITECTURE})}")
        else:
            out[name] = value
    return out


def _architecture(path: str, value, valid: set[str]) -> dict:
    if not isinstance(value, dict):
        raise ArgumentError(f"--config {path}: {ARCHITECTURE} must be a mapping of model fields")
    out = {}
    for key, v in value.items():
        name = str(key).replace("-", "_")
        if name not in valid:
            raise ArgumentError(f"--config {path}: unknown {ARCHITECTURE} field {key!r}{_suggest(name, valid)}")
        out[name] = v
    return out


def resolved(args, cfg) -> dict:
    """The settings of ``args`` (validated) with the model's full architecture: what ``--print-config`` prints, a
    checkpoint stores and the JSONL log starts with. Loading it with ``--config`` gives the same run."""
    from megakernels_models.arguments import TrainArgs

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainArgs) if f.metadata.get("cli")}
    for name in ("dry_run",):
        values.pop(name, None)
    # the architecture defines the model; the preset and size flags it came from are folded into it
    for name in ("preset", "model", "num_layers", "hidden_size", "num_heads", "seq_length", "vocab_size",
                 "ffn_hidden_size", "num_kv_heads", "rope_theta", "dropout", "num_experts", "moe_top_k",
                 "moe_ffn_hidden_size", "moe_layer_freq", "moe_aux_loss_coeff", "moe_z_loss_coeff",
                 "moe_capacity_factor", "moe_shared_experts"):
        values.pop(name, None)
    values[ARCHITECTURE] = dataclasses.asdict(cfg)
    return values


def dump(values: dict) -> str:
    """``values`` as YAML (keys in declaration order)."""
    import yaml

    return yaml.safe_dump(values, sort_keys=False, default_flow_style=False)

