"""Configuration files for ``megakernels train --config FILE`` (YAML or JSON) and ``--print-config``.

A file is a mapping of trainer settings by their names (``tp: 8``, ``global_batch_size: 512``; dashes or
underscores), optionally with an ``architecture:`` mapping of ``ModelConfig`` fields that defines the model itself
instead of a preset. Unknown names are refused with the nearest valid one suggested. Every value is checked
against its field's declared type by the rule the flags use (``settings.field_value``): numbers are numbers however
they are written (YAML 1.2's ``1e-3``, ``3e4`` and ``.1`` included, which YAML 1.1 reads as text), an integer
setting takes a whole float (``steps: 3e2`` is 300) but not ``2.5``, and a mistake is one line naming the file and
the key (``--config job.yaml: save_interval: expected an integer, got 'x' (str)``).

Precedence: flags > file > preset. A flag replaces the file's value of the same setting; the file's settings
replace the defaults. The model comes from ``--preset`` (flag or file) or from the file's ``architecture:``; when
both are given the architecture must agree with the preset field by field (a file written by ``--print-config``
for that preset does), else the run is refused naming the fields that differ: one of the two would be silently
ignored. Size settings (``--num-layers``, ``--hidden-size``, ... as flags or top-level keys of the file) then
replace the architecture's or the preset's fields, as they replace a preset's without a file.

``--print-config`` prints the resolved settings in this same format (the model's architecture included, the preset
and size settings folded into it), so its output is a file that reproduces the run; the same resolved configuration
is saved in every checkpoint and written at the top of the JSONL log.

``configs/`` in the repository ships every preset (``configs/presets/<name>.yaml``, the presets' architectures) and
example jobs (``configs/jobs/``).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import re

from megakernels_models.settings import ArgumentError, field_value

ARCHITECTURE = "architecture"
# What ``load`` adds to the settings: the file's path and the values it gave, so that ``arguments.validate`` can name
# the file in a range error about one of them (TrainArgs fields without flags).
CONFIG_FILE, CONFIG_SETTINGS = "config_file", "config_settings"

# YAML 1.2's floats that YAML 1.1 (PyYAML) reads as text: an exponent without a dot or without a sign.
_FLOAT_12 = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$")


@functools.cache
def _yaml(kind: str):
    """A ``yaml.SafeLoader`` (``kind="Loader"``) or ``yaml.SafeDumper`` subclass that also resolves YAML 1.2's floats
    (PyYAML's own classes are left as they are). The dumper needs it too: it quotes a string only when the
    resolver would read it as something else, so without it ``--data 3e2`` would print unquoted and read back as
    a number."""
    import yaml

    cls = type(f"Yaml12{kind}", (getattr(yaml, f"Safe{kind}"),), {})
    # add_implicit_resolver copies the inherited table into the subclass before adding to it
    cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))
    return cls


def _suggest(name: str, valid) -> str:
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _one_line(e: Exception) -> str:
    """A YAML parser's multi-line message as one line: the problem and where."""
    problem = getattr(e, "problem", None)
    mark = getattr(e, "problem_mark", None)
    if problem is None:
        return " ".join(str(e).split())
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context = getattr(e, "context", None)
    return f"{problem}{where}" + (f" ({context})" if context else "")


def parse(path: str, text: str):
    """The document ``text`` of the file ``path``: JSON when the name ends in ``.json``, else YAML (with YAML 1.2's
    floats).

    Raises:
        ArgumentError: not valid JSON/YAML, in one line naming the file, the problem and where.
    """
    import yaml

    kind = "JSON" if path.endswith(".json") else "YAML"
    try:
        return json.loads(text) if kind == "JSON" else yaml.load(text, Loader=_yaml("Loader"))  # noqa: S506 (a SafeLoader)
    except RecursionError:
        raise ArgumentError(f"--config {path}: not valid {kind}: nested too deeply") from None
    except Exception as e:  # noqa: BLE001 -- PyYAML's constructors let Python's own errors out for some explicitly
        # tagged garbage (``!!timestamp x``: AttributeError); whatever the parser raises, the file is not valid
        raise ArgumentError(f"--config {path}: not valid {kind}: {_one_line(e)}") from None


def load(path: str) -> dict:
    """The settings in the YAML/JSON file ``path``, names normalised to underscores, each checked against its
    ``TrainArgs`` field (``architecture:`` fields against ``ModelConfig``'s) and converted to its type; with
    ``config_file`` (the path) and ``config_settings`` (the file's values) added when it holds any.

    Raises:
        ArgumentError: an unreadable or malformed file, an unknown name (with the nearest valid one) or a value of
            the wrong type; one line naming the file and the key.
    """
    from megakernels_models.arguments import TrainArgs

    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
    except OSError as e:
        raise ArgumentError(f"--config {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ArgumentError(f"--config {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    data = parse(path, text)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ArgumentError(f"--config {path}: expected a mapping of settings, got a {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(TrainArgs) if f.metadata.get("cli")}
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name == ARCHITECTURE:
            out[name] = _architecture(path, value)
        elif name not in fields:
            raise ArgumentError(f"--config {path}: unknown setting {key!r}{_suggest(name, [*fields, ARCHITECTURE])}")
        else:
            try:
                out[name] = field_value(TrainArgs, fields[name], value)
            except ValueError as e:
                raise ArgumentError(f"--config {path}: {key}: {e}") from None
    if out:
        out[CONFIG_SETTINGS] = dict(out)
        out[CONFIG_FILE] = path
    return out


def _architecture(path: str, value) -> dict:
    from megakernels_models.models.config import RETIRED
    from megakernels_models.models.registry import DEFAULT, family

    if not isinstance(value, dict):
        raise ArgumentError(
            f"--config {path}: {ARCHITECTURE} must be a mapping of model fields, got a {type(value).__name__}"
        )
    model = value.get("model", DEFAULT)
    if not isinstance(model, str):
        raise ArgumentError(
            f"--config {path}: {ARCHITECTURE}: model must be a family name (a string), got {model!r} "
            f"({type(model).__name__})"
        )
    try:
        config_class = family(model).config_class
    except ValueError as e:
        raise ArgumentError(f"--config {path}: {ARCHITECTURE}: {e}") from None
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    out = {}
    for key, v in value.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            if name in RETIRED and v == RETIRED[name]:
                continue  # written before each family owned its fields, at the default it had then
            raise ArgumentError(
                f"--config {path}: unknown {ARCHITECTURE} field {key!r} for a {config_class.family} model"
                f"{_suggest(name, fields)}"
            )
        try:
            out[name] = field_value(config_class, fields[name], v)
        except ValueError as e:
            raise ArgumentError(f"--config {path}: {ARCHITECTURE}: {key}: {e}") from None
    return out


def resolved(args, cfg) -> dict:
    """The settings of ``args`` (validated) with the model's full architecture: what ``--print-config`` prints, a
    checkpoint stores and the JSONL log starts with. Loading it with ``--config`` gives the same run."""
    from megakernels_models.arguments import ARCHITECTURE_SETTINGS, TrainArgs

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainArgs) if f.metadata.get("cli")}
    for name in ("dry_run",):
        values.pop(name, None)
    # the architecture defines the model; the preset and the model settings it came from are folded into it
    for name in ARCHITECTURE_SETTINGS:
        values.pop(name, None)
    # tuples (layer_types) as lists: YAML's safe dumper writes lists, and the config reads them back as tuples
    values[ARCHITECTURE] = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()}
    return values


def dump(values: dict) -> str:
    """``values`` as YAML (keys in declaration order)."""
    import yaml

    return yaml.dump(values, Dumper=_yaml("Dumper"), sort_keys=False, default_flow_style=False)
