"""The device↔host copies of the offloaded optimizer (``ParallelOptimizer(offload=True)``), one data-parallel
bucket at a time, overlapped with backward and with the next forward (docs/parallelism.md).

Gradients, device to host. ``DistributedDataParallel`` calls ``on_reduced(bucket)`` once per bucket and step, as
soon as the bucket's gradients are reduced (``register_grad_reduced_hook``), and this copies the pieces of that
bucket the optimizer updates (under ZeRO-1 this rank's shard) into their host gradient buffers (pinned on CUDA).

- CUDA: the hook runs when the bucket's collective is launched, from backward. The copy stream waits for the
  compute stream (the pre-division) and for the collective (``Pending.wait_stream``, no host synchronisation), then
  copies, while backward goes on computing the earlier layers on the compute stream.
- CPU: the hook runs after the bucket's collective completed (``finish_grad_sync``), or at launch with one rank;
  the copy is a plain copy, the same per-bucket logic without streams.

Pieces whose gradient ``finalize_model_grads`` still changes after the data-parallel sync (``changed_after_sync``:
sequence-parallel and TP-replicated params, the tied embedding across pipeline stages) and pieces outside any
bucket (an optimizer over plain params) are copied by ``finish()``, at step time, which then waits (host) for the
copy stream: the CPU AdamW reads the host gradients next. That wait is the only host synchronisation, and only
with the copy stream.

Parameters, host to device. After the host step ``put_params()`` copies each bucket's updated values on a second
side stream, buckets in forward order (the reverse of the bucket order), each recording an event; 16-bit values are
rounded on the host into the memory of the piece's gradient copy (unused until the next backward's copy, which waits
for this one), so the bus carries 2 bytes per 16-bit parameter. The next forward waits for a bucket's event (the
compute stream waits, the host does not) in the forward pre-hook of the first module that owns one of its params;
the params of modules whose forward was never seen to run (e.g. the last pipeline stage's copy of the tied
embedding, read by the output layer) are waited for when the chunk's forward starts. ``wait_params()`` makes the
current stream wait for every copy: before reading params any other way (checkpoints, the ZeRO-1 all-gather).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from megakernels.parallel import comm
from megakernels.parallel.ddp import changed_after_sync


class HostCopies:
    """The per-bucket gradient (device→host) and parameter (host→device) copies of an offloaded optimizer.

    Args:
        pieces: the optimizer's ``Piece`` list (``flat``/``grad`` on the device, ``main``/``main.grad`` on the host).
        models: the ``DistributedDataParallel`` wrappers the pieces come from (empty for plain params: every piece
            is then copied at step time).
        device: the params' device.
    """

    def __init__(self, pieces, models, device: torch.device) -> None:
        self.pieces, self.device, self.cuda = pieces, device, device.type == "cuda"
        by_param: dict[torch.Tensor, list[int]] = {}  # a param's pieces (one, or its ZeRO-1 intersections)
        for i, piece in enumerate(pieces):
            by_param.setdefault(piece.param, []).append(i)
        # per bucket (keyed by id): the pieces its hook copies, and every piece it holds (for the parameter copies)
        self._early: dict[int, list[int]] = {}
        self.buckets: list[tuple[int, list[int]]] = []
        placed: set[int] = set()
        for m in models:
            for b in m.buckets:
                held = [i for p in b.params for i in by_param.get(p, ())]
                if held:
                    self.buckets.append((id(b), held))
                    self._early[id(b)] = [i for i in held if not changed_after_sync(pieces[i].param)]
                    placed.update(held)
        early = {i for held in self._early.values() for i in held}
        self._late = [i for i in range(len(pieces)) if i not in early]
        if len(placed) < len(pieces):  # plain params: one pseudo-bucket for the parameter copies
            self.buckets.append((-1, [i for i in range(len(pieces)) if i not in placed]))
        self._copied: set[int] = set()
        self._d2h = self._h2d = None
        if self.cuda:
            self._d2h, self._h2d = torch.cuda.Stream(device), torch.cuda.Stream(device)
        self._pending: dict[int, torch.cuda.Event | None] = {}  # bucket key -> event of its parameter copy
        self._waits: dict[nn.Module, list[int]] = {}
        self._seen: set[nn.Module] = set()
        self._roots: list[nn.Module] = []
        bucket_of_piece = {i: key for key, held in self.buckets for i in held}
        for m in models:
            m.register_grad_reduced_hook(self.on_reduced)
            if m.module not in self._roots:
                self._roots.append(m.module)
        for root in self._roots:
            for module in root.modules():
                keys = [bucket_of_piece[i] for p in module.parameters(recurse=False) for i in by_param.get(p, ())]
                if keys or module is root:
                    if module not in self._waits:
                        self._waits[module] = list(dict.fromkeys(keys))
                        module.register_forward_pre_hook(self._before_forward)

    # ---- gradients, device to host --------------------------------------------------------------------------------

    def _copy_grads(self, indices) -> None:
        for i in indices:
            piece = self.pieces[i]
            piece.main.grad.copy_(piece.grad, non_blocking=self.cuda)

    def on_reduced(self, bucket) -> None:
        """DDP's hook: copy ``bucket``'s reduced gradient pieces to the host (on the copy stream on CUDA)."""
        key = id(bucket)
        early = self._early.get(key)
        if not early or key in self._copied:
            return
        self._copied.add(key)
        comm.record("copy", "grads_to_host")
        if not self.cuda:
            self._copy_grads(early)
            return
        self._d2h.wait_stream(torch.cuda.current_stream(self.device))  # the pre-division, the backward's grads
        self._d2h.wait_stream(self._h2d)  # the last parameter copy read the same host memory
        with torch.cuda.stream(self._d2h):
            if bucket.pending is not None:
                bucket.pending.wait_stream()
            self._copy_grads(early)

    def finish(self) -> None:
        """At step time: copy what the hooks did not (pieces changed after the sync, buckets not reduced through
        DDP), then wait until every gradient is on the host."""
        rest = self._late + [i for key, early in self._early.items() if key not in self._copied for i in early]
        self._copied.clear()
        if not self.cuda:
            self._copy_grads(rest)
            return
        self._d2h.wait_stream(torch.cuda.current_stream(self.device))  # finalize_model_grads's sums
        self._d2h.wait_stream(self._h2d)
        with torch.cuda.stream(self._d2h):
            self._copy_grads(rest)
        self._d2h.synchronize()

    def abandon(self) -> None:
        """A skipped step: the gradient buffers may be zeroed once the copies in flight have read them."""
        self._copied.clear()
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._d2h)

    # ---- parameters, host to device -------------------------------------------------------------------------------

    def put_params(self) -> None:
        """Copy the updated masters into the device params, bucket by bucket in forward order."""
        if self.cuda:
            self._h2d.wait_stream(torch.cuda.current_stream(self.device))  # the last reads of the old values
        for key, held in reversed(self.buckets):
            with torch.cuda.stream(self._h2d) if self.cuda else contextlib.nullcontext():
                for i in held:
                    piece = self.pieces[i]
                    src = piece.main
                    if piece.flat.dtype != torch.float32:  # round on the host: 2 bytes a param over the bus
                        src = piece.main.grad.view(piece.flat.dtype)[: src.numel()].copy_(src)
                    piece.flat.copy_(src, non_blocking=self.cuda)
            event = None
            if self.cuda:
                event = torch.cuda.Event()
                event.record(self._h2d)
            self._pending[key] = event

    def _wait(self, keys) -> None:
        for key in keys:
            if key in self._pending:
                event = self._pending.pop(key)
                comm.record("wait", "params_to_device")
                if event is not None:
                    torch.cuda.current_stream(self.device).wait_event(event)

    def _before_forward(self, module, args) -> None:
        if not self._pending:
            self._seen.add(module)
            return
        if module in self._roots:  # params whose module's forward never ran are read by someone else
            self._wait([k for m, keys in self._waits.items() if m not in self._seen for k in keys])
        self._seen.add(module)
        self._wait(self._waits[module])

    def in_flight(self, p: torch.Tensor) -> bool:
        """Whether the copy of ``p``'s updated value has not been waited for yet (no stream orders reads after it)."""
        return any(key in self._pending and any(self.pieces[i].param is p for i in held) for key, held in self.buckets)

    def wait_params(self) -> None:
        """Make the current stream wait for every parameter copy still in flight (no host synchronisation)."""
        self._wait(list(self._pending))
