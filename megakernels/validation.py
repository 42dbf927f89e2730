"""Argument checks shared by the library and the trainer: one wording for every "must be a positive int".

    positive_int(tp, "tp", where="initialize")      # ValueError: initialize: tp must be a positive int, got 0
"""

from __future__ import annotations

import math


def _prefix(where: str) -> str:
    return f"{where}: " if where else ""


def positive_int(value, name: str, *, where: str = "", minimum: int = 1, allow_none: bool = False,
                 error: type[Exception] = ValueError):
    """``value`` if it is an int (not a bool) >= ``minimum`` (or None when ``allow_none``).

    Raises:
        error (ValueError by default): naming ``where`` and ``name``, the rule and the value.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        rule = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise error(f"{_prefix(where)}{name} must be {rule}, got {value!r}")
    return value


def finite_number(value, name: str, *, where: str = "", minimum: float | None = 0.0,
                  error: type[Exception] = ValueError) -> float:
    """``float(value)`` if it is a finite real number (not a bool) >= ``minimum`` (any when None).

    Raises:
        error (ValueError by default): naming ``where`` and ``name``, the rule and the value.
    """
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or (minimum is not None and value < minimum)):
        rule = "a finite number" + ("" if minimum is None else f" >= {minimum:g}")
        raise error(f"{_prefix(where)}{name} must be {rule}, got {value!r}")
    return float(value)
