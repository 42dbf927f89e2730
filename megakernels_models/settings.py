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
import functools
import typing


class ArgumentError(ValueError):
    """An invalid setting or combination of settings (the message names the flag and the rule)."""


def setting(
    default,
    help: str,
    group: str,
    *,
    choices=None,
    flag: str | None = None,
    metavar: str | None = None,
    type=None,
    cli: bool = True,
):
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
    return dataclasses.field(
        default=default,
        metadata={
            "help": help,
            "group": group,
            "choices": choices,
            "flag": flag,
            "metavar": metavar,
            "type": type,
            "cli": cli,
        },
    )


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


@functools.cache
def _hints(cls) -> dict:
    """``typing.get_type_hints(cls)``, once a class: it evaluates every annotation of the class and its bases, and
    building a parser asks it of every field (quadratic in the number of settings without the cache)."""
    return typing.get_type_hints(cls)


def _type(cls, f):
    if f.metadata.get("type") is not None:
        return f.metadata["type"]
    if f.default is not None and f.default is not dataclasses.MISSING:
        return type(f.default)
    hint = _hints(cls)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if len(args) == 1 and args[0] in (int, float, str, bool):
        return args[0]
    raise TypeError(f"setting {f.name}: give type= (the default is None and the annotation is {hint})")


def _optional(cls, f) -> bool:
    """Whether ``f`` of ``cls`` may be None (its default is, or its annotation says so)."""
    return f.default is None or type(None) in typing.get_args(_hints(cls)[f.name])


_EXPECTED = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def convert(value, typ: type, *, optional: bool = False):
    """``value`` as a setting of type ``typ`` (int, float, str or bool; other types pass through): the one rule for
    a flag's text and a configuration file's value, so both accept and refuse the same things.

    An int is an integer, a float that is integral (``3e2``, which YAML and JSON read as 300.0) or text that reads
    as either; a float is any real number or text that reads as one (the range, e.g. finiteness, is
    ``arguments.validate``'s); a str is text; a bool is true or false. Booleans are never numbers. None is accepted
    only when ``optional``.

    Raises:
        ValueError: anything else, saying what was expected and what was given (``expected an integer, got 'x'
            (str)``).
    """
    if value is None and optional:
        return None
    if typ not in _EXPECTED:
        return value
    got = f"got {value!r} ({type(value).__name__})"
    if typ is bool or typ is str:
        if isinstance(value, typ):
            return value
        raise ValueError(f"expected {_EXPECTED[typ]}, {got}")
    number = value
    if isinstance(value, str):
        try:
            number = int(value)
        except ValueError:
            try:
                number = float(value)
            except ValueError:
                raise ValueError(f"expected {_EXPECTED[typ]}, {got}") from None
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise ValueError(f"expected {_EXPECTED[typ]}, {got}")
    if typ is float:
        try:
            return float(number)
        except OverflowError:  # an integer past 1e308
            raise ValueError(f"expected {_EXPECTED[typ]}, {got}: too large for a float") from None
    if isinstance(number, float):
        if not number.is_integer():  # also nan and inf
            raise ValueError(f"expected {_EXPECTED[typ]}, {got}")
        return int(number)
    return number


def field_value(cls, f: dataclasses.Field, value):
    """``value`` checked and converted as field ``f`` of dataclass ``cls`` (its declared type, None when it is
    optional, and its choices): how a configuration file's values are read, by the rule the flags use.

    Raises:
        ValueError: the wrong type or not one of the choices (the message says which, without the field's name).
    """
    try:
        typ = _type(cls, f)
    except TypeError:
        return value  # a field without a scalar type (a mapping): its reader checks it
    value = convert(value, typ, optional=_optional(cls, f))
    choices = _choices(f)
    if value is not None and choices and value not in choices:
        raise ValueError(f"expected one of {', '.join(map(str, choices))}, got {value!r}")
    return value


def _flag_type(typ):
    """argparse's ``type=`` for ``typ``: ``convert`` with argparse's error type (its message becomes the error)."""
    if typ not in (int, float):
        return typ

    def parse(text: str):
        try:
            return convert(text, typ)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = typ.__name__
    return parse


_METAVARS = {int: "N", float: "X"}


def add_settings(
    parser: argparse.ArgumentParser, cls, names=None, defaults: dict | None = None, group: str | None = None
) -> None:
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
        elif _type(cls, f) is bool:  # an optional switch (None: the preset's): --x and --no-x
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            typ = _type(cls, f)
            kwargs.update(type=_flag_type(typ), choices=_choices(f), metavar=md.get("metavar") or _METAVARS.get(typ))
        grp.add_argument(flag_of(f), **kwargs)


def given(ns: argparse.Namespace, cls) -> dict:
    """The fields of ``cls`` the user gave on the command line (the parser was built by ``add_settings``)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(ns).items() if k in names}
