"""Deferred weight gradients: the zero-bubble schedules' B pass computes input gradients only, W the rest.

While a B pass runs inside ``defer()``, a layer whose backward can be split (``deferring()`` says so) computes its
input gradient, returns no gradient for its weight, and pushes a closure that computes the weight gradient
(``push``); the W op of the same (chunk, micro-batch) runs those closures (``Deferred.run``). Layers that split:
the column-parallel linear (``linear.LinearWithAsyncComm``: its input-gradient collective still overlaps what is
left of B), the row-parallel linear (``linear.RowLinear``), the FP8 linears and the experts' grouped GEMMs
(``parallel.fp8``, ``moe.experts``). Everything else (norms, biases, embeddings, the LM head, the attention core,
the router) computes its weight gradient during B as it always does.

Where a deferred gradient lands: exactly where the undeferred one would. A layer remembers the weight its forward was
given as an attribute of its autograd context (not the tensor ``saved_tensors`` returns: under activation
recomputation that is the recomputed forward's alias of the parameter). ``accumulate(weight, grad)`` runs
``torch.autograd.backward(weight, grad)``: on a leaf parameter that is its ``AccumulateGrad`` node, so ``.grad``
accumulates as in one backward, and the parameter's post-accumulate-grad hooks fire (the data-parallel wrapper's
bucket hooks: ``parallel.ddp``); on a tensor made from a parameter (a cast, a view) the gradient flows through the
autograd nodes that made it, which are still there (W holds the tensor, and with it its ``grad_fn``).

The state is one module-level slot, not a thread-local: on CUDA the autograd engine runs backward functions on its
device threads, while ``defer()`` is entered on the caller's.

A closure keeps what the weight gradient needs (the layer's input and output gradient) from B to W; ``push`` takes
those tensors too, so that ``Deferred.nbytes`` and the activation ledger (``memory.py``) count them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

_current: Deferred | None = None


class Deferred:
    """The weight-gradient closures one B pass pushed, in push order; ``run()`` computes them (the W op)."""

    def __init__(self) -> None:
        self._closures: list[tuple[Callable[[], None], tuple]] = []
        self.ran = False

    def __len__(self) -> int:
        return len(self._closures)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors the closures hold (each storage once)."""
        seen, total = set(), 0
        for _, tensors in self._closures:
            for t in tensors:
                key = _storage_key(t)
                if key not in seen:
                    seen.add(key)
                    total += t.untyped_storage().nbytes()
        return total

    def run(self) -> None:
        """Compute every deferred weight gradient, in push order, and drop what the closures held.

        Raises:
            RuntimeError: run twice.
        """
        if self.ran:
            raise RuntimeError("wgrad.Deferred.run: these weight gradients were computed already")
        self.ran = True
        closures, self._closures = self._closures, []
        from megakernels.parallel.pipeline import memory

        with torch.no_grad():  # as inside backward: no graph for the GEMMs (accumulate's backward still runs)
            for fn, tensors in closures:
                fn()
                memory.release(tensors)
        del closures


def deferring() -> bool:
    """Whether the backward running now is a B pass whose weight gradients are to be deferred."""
    return _current is not None


def push(fn: Callable[[], None], tensors=()) -> None:
    """Defer ``fn`` (which computes weight gradients and hands them to ``accumulate``) to the W op; ``tensors``:
    what it keeps alive until then (counted, not used). Call only while ``deferring()``.

    Raises:
        RuntimeError: not inside ``defer()``.
    """
    if _current is None:
        raise RuntimeError("wgrad.push: called outside wgrad.defer() (check wgrad.deferring() first)")
    tensors = tuple(t for t in tensors if isinstance(t, torch.Tensor))
    from megakernels.parallel.pipeline import memory

    memory.hold(tensors)
    _current._closures.append((fn, tensors))


@contextlib.contextmanager
def defer():
    """Inside: splittable layers defer their weight gradients into the ``Deferred`` yielded (run it for the W op).

    Raises:
        RuntimeError: nested.
    """
    global _current
    if _current is not None:
        raise RuntimeError("wgrad.defer: already deferring (a B pass inside a B pass)")
    _current = Deferred()
    try:
        yield _current
    finally:
        _current = None


def accumulate(weight: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Add ``grad`` to ``weight``'s gradient as its backward would have: through autograd to the leaf (module
    docstring). Nothing for a None gradient or a weight that does not require grad."""
    if grad is None or not weight.requires_grad:
        return
    torch.autograd.backward(weight, grad)


def _storage_key(t: torch.Tensor):
    return (t.device, t.untyped_storage().data_ptr())
