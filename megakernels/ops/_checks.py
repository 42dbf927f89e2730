"""Argument checks shared by every public op, module and optimizer: one place for the rules of docs/design.md §2
(bad input gets an error naming the argument and the rule, never a crash or a silent wrong answer).

Where each rule is enforced, and why there:

- **Type and layout** (:func:`tensor`): in the Python entry points, before dispatch. A sparse (or other
  non-strided) tensor would otherwise reach the dispatcher, which has no kernel for ``SparseCPU`` and says so in
  its own words.
- **One device** (:func:`same_device`): for CPU/CUDA mixes the C++ bindings check it (csrc/bindings/common.cpp).
  But when any argument is a *meta* tensor the dispatcher routes the whole call to the fake implementation, so
  the C++ never runs: a CPU ``x`` with a meta ``weight`` would "succeed" with an uninitialised CPU output. So every
  fake implementation checks devices too (all-meta calls stay fine: that is how shapes are traced).
- **Python scalars** (:func:`real`, :func:`integer`, the op-named forms of ``megakernels.validation``'s): at the
  entry points, so that ``eps=None`` says ``eps`` instead of ``float() argument must be ...``.
"""

from __future__ import annotations

import torch

from megakernels import validation


def tensor(op: str, name: str, t, *, optional: bool = False) -> None:
    """``t`` is a dense (strided) ``torch.Tensor`` (or None when ``optional``).

    Raises:
        TypeError: not a tensor. ValueError: a sparse or other non-strided layout (named).
    """
    if t is None and optional:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(
            f"{op}: {name} is a {t.layout} tensor; only dense (torch.strided) tensors are supported "
            f"(convert with {name}.to_dense())"
        )


def same_device(op: str, ref_name: str, ref: torch.Tensor, *named) -> None:
    """Every tensor in ``named`` (``(name, tensor_or_None)`` pairs, or ``(name, list_of_tensors)``) is on
    ``ref``'s device.

    Raises:
        ValueError: naming the first tensor on another device, its device and ``ref``'s.
    """
    for name, t in named:
        if isinstance(t, (list, tuple)):
            same_device(op, ref_name, ref, *((f"{name}[{i}]", u) for i, u in enumerate(t)))
        elif t is not None and t.device != ref.device:
            raise ValueError(
                f"{op}: {name} is on {t.device} but {ref_name} is on {ref.device}; every tensor "
                "argument must be on one device"
            )


def real(op: str, name: str, value, *, finite: bool = True, minimum: float | None = None) -> float:
    """``value`` as a float: a real number (not a bool), finite unless ``finite=False``, and ``>= minimum``
    (``megakernels.validation.real``).

    Raises:
        TypeError: not a real number (None, a string, a tensor, a bool). ValueError: non-finite or too small.
    """
    return validation.real(value, name, where=op, finite=finite, minimum=minimum, type_error=TypeError)


def integer(op: str, name: str, value, *, minimum: int | None = None) -> int:
    """``value`` as an int: an integral number (not a bool, not a float such as 2.5 or 2.0), ``>= minimum``
    (``megakernels.validation.integer``).

    Raises:
        TypeError: not an integer. ValueError: below ``minimum``.
    """
    return validation.integer(value, name, where=op, minimum=minimum, type_error=TypeError)
