"""Scalar argument checks shared by the ops, the library and the trainer: one wording for every "must be a positive
int" or "must be a finite number" (docs/design.md §2: bad input gets an error naming the argument and the rule).

    integer(tp, "tp", where="initialize", minimum=1)   # ValueError: initialize: tp must be a positive int, got 0
    real(eps, "eps", where="rms_norm", minimum=0.0)    # TypeError for None: eps must be a real number, got None

Ops raise TypeError for a value of the wrong type and ValueError for one out of range (``type_error``); the
library's configuration and the trainer raise one error type for both (``error``, e.g. the trainer's
``ArgumentError``). Tensor checks live in ``megakernels.ops._checks``.
"""

from __future__ import annotations

import math
import numbers


def _prefix(where: str) -> str:
    return f"{where}: " if where else ""


def integer(
    value,
    name: str,
    *,
    where: str = "",
    minimum: int | None = None,
    allow_none: bool = False,
    error: type[Exception] = ValueError,
    type_error: type[Exception] | None = None,
):
    """``int(value)`` if it is an integral number (not a bool, not a float such as 2.0) >= ``minimum`` (or None
    when ``allow_none``).

    Raises:
        type_error (default ``error``): not an integer. error (ValueError by default): below ``minimum``. Both name
        ``where`` and ``name``, the rule and the value.
    """
    if value is None and allow_none:
        return None
    rule = "an int" if minimum is None else "a positive int" if minimum == 1 else f"an int >= {minimum}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise (type_error or error)(f"{_prefix(where)}{name} must be {rule}, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise error(f"{_prefix(where)}{name} must be {rule}, got {value!r}")
    return int(value)


def real(
    value,
    name: str,
    *,
    where: str = "",
    finite: bool = True,
    minimum: float | None = None,
    error: type[Exception] = ValueError,
    type_error: type[Exception] | None = None,
) -> float:
    """``float(value)`` if it is a real number (not a bool, not a tensor), finite unless ``finite=False``, and
    ``>= minimum`` (any when None).

    Raises:
        type_error (default ``error``): not a real number. error (ValueError by default): non-finite or below
        ``minimum``. Both name ``where`` and ``name``, the rule and the value.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise (type_error or error)(
            f"{_prefix(where)}{name} must be a real number, got {value!r} ({type(value).__name__})"
        )
    v = float(value)
    # abs(v) < inf rather than math.isfinite: a comparison a compiler can guard on when v is a symbolic float
    if (finite and not abs(v) < math.inf) or (minimum is not None and not v >= minimum):
        rule = ("a finite number" if finite else "a number") + ("" if minimum is None else f" >= {minimum:g}")
        raise error(f"{_prefix(where)}{name} must be {rule}, got {v}")
    return v


def positive_int(
    value,
    name: str,
    *,
    where: str = "",
    minimum: int = 1,
    allow_none: bool = False,
    error: type[Exception] = ValueError,
):
    """``integer`` with ``minimum`` 1 by default and one error type."""
    return integer(value, name, where=where, minimum=minimum, allow_none=allow_none, error=error)


def finite_number(
    value, name: str, *, where: str = "", minimum: float | None = 0.0, error: type[Exception] = ValueError
) -> float:
    """``real``, finite, ``>= 0`` by default, with one error type."""
    return real(value, name, where=where, minimum=minimum, error=error)
