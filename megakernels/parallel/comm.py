"""The collectives tensor and sequence parallelism use, on one group, optionally asynchronous, and observable.

All-gather and reduce-scatter along any dimension go through torch.distributed's single-tensor collectives
(``all_gather_into_tensor`` / ``reduce_scatter_tensor``), which exchange rank-major blocks along dim 0; another
dimension is moved to the front first and back after. With ``async_op=True`` the call returns a ``Pending`` whose
``wait()`` blocks until the result is usable: on CUDA (nccl) the collective runs on the communicator's own stream
and ``wait()`` makes the current stream wait for it (no host synchronisation); on CPU (gloo) it runs on gloo's
worker thread while this thread computes.

Every launch and wait is reported to the event recorder when one is installed (``record_events()``), which is how
tests check, without timing anything, that a collective is in flight while a GEMM runs, and how many collectives a
forward or backward pass issues.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

# torch >= 2.14 renames the single-tensor collectives; older releases (down to 2.5) only have the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Module-level, not thread-local: on CUDA the autograd engine runs backward on its own device threads.
_events: list | None = None
_bytes: dict | None = None


@contextlib.contextmanager
def record_events():
    """Collect ``(event, detail)`` tuples emitted by the parallel layers (any thread) while the block runs.

    Events: ``("launch", kind)`` and ``("wait", kind)`` for collectives (``kind`` is ``all_reduce``,
    ``all_gather`` or ``reduce_scatter``), and ``("start", name)`` / ``("end", name)`` around the GEMMs of the
    fused linear's backward (``dgrad``, ``wgrad``). Yields the list, which fills as events happen.
    """
    global _events
    previous, events = _events, []
    _events = events
    try:
        yield events
    finally:
        _events = previous


@contextlib.contextmanager
def count_bytes():
    """Count, per collective kind, the bytes this rank puts into collectives while the block runs (an all-gather's
    and a reduce-scatter's input, an all-reduce's tensor): yields a dict ``{kind: bytes}`` that fills as they
    launch. What crosses the wire is proportional (a ring moves ``(world - 1) / world`` of it per step)."""
    global _bytes
    previous, counts = _bytes, {}
    _bytes = counts
    try:
        yield counts
    finally:
        _bytes = previous


def count(kind: str, sent: torch.Tensor) -> None:
    """Add ``sent``'s bytes under ``kind`` to the active ``count_bytes`` block, if any (collectives launched outside
    ``_launch``: the MoE dispatchers' asynchronous all-to-alls)."""
    if _bytes is not None:
        _bytes[kind] = _bytes.get(kind, 0) + sent.numel() * sent.element_size()


def record(event: str, detail: str) -> None:
    """Append an event to the active recorder, if any (a no-op costing one attribute lookup otherwise)."""
    if _events is not None:
        _events.append((event, detail))


class Pending:
    """An asynchronous collective: ``wait()`` returns its result once it may be used on the current stream."""

    def __init__(self, kind: str, work, result: torch.Tensor, finish=None):
        self.kind, self._work, self._result, self._finish = kind, work, result, finish

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
            record("wait", self.kind)
        if self._finish is not None:
            self._result, self._finish = self._finish(self._result), None
        return self._result

    def wait_stream(self) -> None:
        """Make the current stream wait for the collective without consuming it: a later ``wait()`` still orders
        its own stream. For a consumer on a side stream (nccl: no host synchronisation; gloo: blocks the host)."""
        if self._work is not None:
            self._work.wait()


def _launch(kind: str, fn, result: torch.Tensor, async_op: bool, finish=None, sent: torch.Tensor | None = None):
    record("launch", kind)
    if _bytes is not None:
        src = result if sent is None else sent
        _bytes[kind] = _bytes.get(kind, 0) + src.numel() * src.element_size()
    work = fn(async_op=async_op)
    pending = Pending(kind, work if async_op else None, result, finish)
    if not async_op:
        record("wait", kind)
        return pending.wait()
    return pending


def all_reduce(x: torch.Tensor, group, async_op: bool = False, op=dist.ReduceOp.SUM):
    """Sum (or ``op``) ``x`` over ``group`` in place; returns ``x`` (or a ``Pending`` of it when ``async_op``)."""
    x = x.contiguous()
    return _launch(
        "all_reduce", lambda async_op: dist.all_reduce(x, op=op, group=group, async_op=async_op), x, async_op
    )


def all_gather(x: torch.Tensor, dim: int, group, async_op: bool = False):
    """Concatenate the ``x`` of every rank of ``group`` along ``dim`` in rank order.

    ``x`` must have the same shape on every rank; the result's ``dim`` is ``world · x.shape[dim]``.
    """
    world = dist.get_world_size(group)
    dim = dim % x.dim()
    src = x.movedim(dim, 0).contiguous()
    out = torch.empty((world * src.shape[0],) + tuple(src.shape[1:]), dtype=x.dtype, device=x.device)
    finish = None if dim == 0 else (lambda t: t.movedim(0, dim).contiguous())
    return _launch(
        "all_gather",
        lambda async_op: all_gather_single(out, src, group=group, async_op=async_op),
        out,
        async_op,
        finish,
        sent=src,
    )


def reduce_scatter(x: torch.Tensor, dim: int, group, async_op: bool = False):
    """Sum ``x`` over ``group`` and keep this rank's block of ``dim`` (``x.shape[dim] / world`` long).

    Raises:
        ValueError: ``x.shape[dim]`` not divisible by the group size.
    """
    world = dist.get_world_size(group)
    dim = dim % x.dim()
    if x.shape[dim] % world:
        raise ValueError(
            f"reduce_scatter: dimension {dim} of x has {x.shape[dim]} elements, not divisible by the group size {world}"
        )
    src = x.movedim(dim, 0).contiguous()
    out = torch.empty((src.shape[0] // world,) + tuple(src.shape[1:]), dtype=x.dtype, device=x.device)
    finish = None if dim == 0 else (lambda t: t.movedim(0, dim).contiguous())
    return _launch(
        "reduce_scatter",
        lambda async_op: reduce_scatter_single(out, src, group=group, async_op=async_op),
        out,
        async_op,
        finish,
        sent=src,
    )


def split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's block of ``x`` along ``dim`` (contiguous), no communication.

    Raises:
        ValueError: ``x.shape[dim]`` not divisible by the group size.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % world:
        raise ValueError(
            f"split: dimension {dim % x.dim()} of x has {x.shape[dim]} elements, not divisible by the "
            f"group size {world}"
        )
    return x.chunk(world, dim)[rank].contiguous()
