"""Activation memory of a pipeline step, measured: what autograd saves for backward plus what deferred weight
gradients hold, each storage counted once for as long as anything holds it, and its peak.

``forward_backward(..., stats={})`` measures with it: the forwards run under ``saved_tensors()`` (autograd's
saved-tensor hooks: each tensor a backward will need is counted from its forward until its graph is freed), and
the closures of ``wgrad.push`` are counted from their B until their W. Parameters (and views of them) are not
activations and are left out. What a custom autograd function keeps as a plain attribute of its context instead of
``save_for_backward`` is not seen (the FP8 linears' FP8 copies): measure such models another way.
"""

from __future__ import annotations

import contextlib

import torch

_ledger: Ledger | None = None


class Ledger:
    """Bytes held now and at most, by storage (``(device, data pointer)``: views of one storage count once)."""

    def __init__(self) -> None:
        self.refs: dict[tuple, list[int]] = {}  # storage -> [holders, bytes]
        self.current = 0
        self.peak = 0

    def add(self, t: torch.Tensor) -> None:
        key, n = _key(t), t.untyped_storage().nbytes()
        entry = self.refs.get(key)
        if entry is not None:
            entry[0] += 1
            return
        self.refs[key] = [1, n]
        self.current += n
        self.peak = max(self.peak, self.current)

    def remove(self, key: tuple) -> None:
        entry = self.refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self.refs[key]
            self.current -= entry[1]


def _key(t: torch.Tensor) -> tuple:
    return (str(t.device), t.untyped_storage().data_ptr())


def _is_parameter(t: torch.Tensor) -> bool:
    base = t._base if t._base is not None else t
    return isinstance(base, torch.nn.Parameter) or isinstance(t, torch.nn.Parameter)


class _Held:
    """A saved tensor counted in ``ledger`` until autograd drops it."""

    __slots__ = ("tensor", "ledger", "key")

    def __init__(self, tensor: torch.Tensor, ledger: Ledger):
        self.tensor, self.ledger, self.key = tensor, ledger, _key(tensor)
        ledger.add(tensor)

    def __del__(self):
        self.ledger.remove(self.key)


@contextlib.contextmanager
def measure():
    """Count from now on (yields the ``Ledger``); nested measurements are refused.

    Raises:
        RuntimeError: already measuring.
    """
    global _ledger
    if _ledger is not None:
        raise RuntimeError("pipeline.memory.measure: already measuring")
    _ledger = Ledger()
    try:
        yield _ledger
    finally:
        _ledger = None


def saved_tensors():
    """Autograd's saved-tensor hooks counting what the code inside saves (no-op when not measuring)."""
    ledger = _ledger
    if ledger is None:
        return contextlib.nullcontext()

    def pack(t: torch.Tensor):
        if not isinstance(t, torch.Tensor) or _is_parameter(t) or t.device.type == "meta":
            return t
        return _Held(t, ledger)

    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def hold(tensors) -> None:
    """Count ``tensors`` (a deferred weight gradient's) until ``release``; no-op when not measuring."""
    if _ledger is not None:
        for t in tensors:
            if not _is_parameter(t):
                _ledger.add(t)


def release(tensors) -> None:
    """Stop counting what ``hold`` counted."""
    if _ledger is not None:
        for t in tensors:
            if not _is_parameter(t):
                _ledger.remove(_key(t))
