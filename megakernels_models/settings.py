"""Settings declared once: a dataclass field carries its help, group, choices and flag, and the command-line parser
is generated from the fields.

    @dataclasses.dataclass
    class Args:
        steps: int = setting(300, "optimizer steps", "optimisation")

    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    add_settings(parser, Args)
    args = Args(**given(parser.parse_args()))

Flags are parsed with ``argparse.SUPPRESS`` defaults, so the namespace holds only the flags the user gave; the
dataclass fills in the rest. The help shows each default once, taken from the field (or said in the help text).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing


class ArgumentError(ValueError):
    """An invalid setting or combination of settings (the message names the flag and the rule)."""


def setting(default, help: str, group: str, *, choices=None, flag: str | None = None, metavar: str | None = None,
            type=None, cli: bool = True):
    """A dataclass field with its command-line description.

    Args:
        default: the value when the flag is not given (a mutable default is not supported).
        help: one line for ``--help``; mention the default in it when it is not a plain value.
        group: the ``--help`` section.
        choices: allowed values (a tuple, or a callable returning one, evaluated when the parser is built).
        flag: the option string (default ``--field-name``); ``--no-x`` for a True-by-default bool.
        metavar, type: as argparse's; ``type`` defaults to the default's type (needed when the default is None).
        cli: False for a setting only code sets (no flag).
    """
    return dataclasses.field(default=default, metadata={
        "help": help, "group": group, "choices": choices, "flag": flag, "metavar": metavar, "type": type, "cli": cli})


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions keep their line breaks; options are listed in aligned columns."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=32, width=110)


def cli_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli")]


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _choices(f):
    c = f.metadata.get("choices")
    return tuple(c()) if callable(c) else c


def _type(cls, f):
    if f.metadata.get("type") is not None:
        return f.metadata["type"]
    if f.default is not None:
        return type(f.default)
    hint = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(args) == 1 and args[0] in (int, float, str):
        return args[0]
    raise TypeError(f"setting {f.name}: give type= (the default is None and the annotation is {hint})")


_METAVARS = {int: "N", float: "X"}


def add_settings(parser: argparse.ArgumentParser, cls, names=None, defaults: dict | None = None,
                 group: str | None = None) -> None:
    """Add a flag to ``parser`` for every command-line field of dataclass ``cls`` (or those in ``names``), grouped
    as declared (or all in ``group``); ``defaults`` replaces field defaults in the help text (the values themselves
    still come from the dataclass or the caller)."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    defaults = defaults or {}
    for f in cli_fields(cls):
        if names is not None and f.name not in names:
            continue
        md = f.metadata
        title = group or md["group"]
        grp = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
        default = defaults.get(f.name, f.default)
        help_ = md["help"]
        if default is not None and not isinstance(default, bool) and "default" not in help_:
            help_ += f" (default: {default})"
        kwargs = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_}
        if isinstance(f.default, bool):
            kwargs["action"] = "store_false" if f.default else "store_true"
        else:
            typ = _type(cls, f)
            kwargs.update(type=typ, choices=_choices(f), metavar=md.get("metavar") or _METAVARS.get(typ))
        grp.add_argument(flag_of(f), **kwargs)


def given(ns: argparse.Namespace, cls) -> dict:
    """The fields of ``cls`` the user gave on the command line (the parser was built by ``add_settings``)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(ns).items() if k in names}
