"""Run one training (or evaluation) step of a pipeline schedule: forwards, backwards and the messages between them.

The executor walks ``communication_plan`` for this rank: compute steps in ``schedule_order`` and, between them, the
exchanges with the neighbouring stages (``p2p.communicate``). It owns no model: the caller's ``forward_step`` runs
one chunk on one micro-batch, and backward is ``torch.autograd.backward`` on what it returned.

Memory follows the schedule: a forward's input and output (and so its autograd graph) are kept until its backward,
then dropped; a received gradient lives from its receive to its backward; a computed input gradient until it is
sent. With 1F1B a rank thus holds at most ``pp - rank`` micro-batches' activations, with gpipe all of them. The
zero-bubble schedules (zb-h1, zb-v) run their B ops inside ``wgrad.defer()``: the layers that can split their
backward compute the input gradient only and leave closures that the W op of the same (chunk, micro-batch) runs;
what those closures hold (the layers' inputs and output gradients) lives from the B to the W.

On the V placement (zb-v) the last pipeline rank hands its chunk 0's output to its chunk 1 (and chunk 1's input
gradient back to chunk 0) without a message: the tensor is detached and made a leaf that requires grad, as a
received one is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from megakernels.parallel import state
from megakernels.parallel.pipeline import memory, p2p, wgrad
from megakernels.parallel.pipeline.schedules import (
    ALL_SCHEDULES,
    Exchange,
    check_arguments,
    communication_plan,
    neighbour_direction,
    placement_of,
    splits_backward,
    stage_owner,
    virtual_stage,
)


def _layout(num_chunks: int, placement: str) -> tuple[int, int, bool]:
    """(pp size, pp rank, whether to set the vpp rank) of this process; one stage when nothing is initialised."""
    if not state.is_initialized():
        if num_chunks != 1:
            raise ValueError(
                f"forward_backward: num_chunks={num_chunks} needs megakernels.parallel initialised with "
                f"vpp={num_chunks}"
            )
        return 1, 0, False
    vpp = state.vpp_size()
    if num_chunks != (vpp or 1):
        raise ValueError(
            f"forward_backward: num_chunks={num_chunks} must equal the vpp megakernels.parallel was "
            f"initialised with (vpp={vpp})"
        )
    if state.pipeline_placement() != placement:
        raise ValueError(
            f"forward_backward: the schedule runs on the {placement!r} placement, but megakernels.parallel was "
            f"initialised with placement={state.pipeline_placement()!r} (initialize(..., placement='v') for zb-v)"
        )
    return state.pp_size(), state.pp_rank(), vpp is not None


def forward_backward(
    forward_step: Callable[[int, int, torch.Tensor | None], torch.Tensor],
    num_microbatches: int,
    *,
    schedule: str = "1f1b",
    tensor_shape,
    dtype: torch.dtype,
    device,
    num_chunks: int = 1,
    forward_only: bool = False,
    grad_sync: Callable[[int, bool], None] | None = None,
    exchange_hook: Callable[[Callable], Callable] | None = None,
    durations: tuple[float, float, float] | None = None,
    stats: dict | None = None,
) -> list[torch.Tensor]:
    """One step of pipeline schedule ``schedule`` over ``num_microbatches`` micro-batches on this rank.

    Virtual stage ``k`` is ``chunk · pp_size + pp_rank`` (zb-v: ``pp_rank`` for chunk 0, ``2·pp_size − 1 −
    pp_rank`` for chunk 1); the first is chunk 0 of pp rank 0, the last chunk ``num_chunks-1`` of the last pp rank
    (zb-v: chunk 1 of pp rank 0).

    Args:
        forward_step: ``forward_step(chunk, microbatch, input_tensor)``, called once per forward. ``input_tensor``
            is None on the first virtual stage (the model reads its own data there), else the received activation
            (``tensor_shape``, ``dtype``, requires grad). Returns the scalar loss on the last virtual stage (scaled
            by the caller, e.g. ``/ num_microbatches``: the gradients are the sum of its backwards), elsewhere the
            output activation (``tensor_shape``, ``dtype``) for the next stage. With virtual stages,
            ``state.set_vpp_rank(chunk)`` has been called, so ``is_pp_first_stage()`` / ``is_pp_last_stage()``
            inside it are right.
        num_microbatches: micro-batches in this step.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zb-h1"``, ``"zb-v"`` or ``"forward_only"`` (see
            ``schedules``). zb-v needs ``megakernels.parallel`` initialised with ``placement="v"`` (and
            ``num_chunks=2``); forward-only evaluation of such a model passes ``schedule="zb-v"`` with
            ``forward_only=True``.
        tensor_shape, dtype, device: of every activation and gradient sent between stages.
        num_chunks: model chunks per rank; must equal ``state.vpp_size()`` (1 when it is None).
        forward_only: forwards only, under ``torch.no_grad`` (evaluation), whatever ``schedule`` says.
        grad_sync: ``grad_sync(chunk, enabled)``, e.g. a data-parallel wrapper's switch: called with False for
            every chunk before the first forward, and with True right before the last backward of each chunk, so
            that the gradient reduction happens once per step and overlaps the remaining backwards. With the
            zero-bubble schedules a chunk's gradients become final in two places, its last B (the gradients B
            computes: norms, biases, embeddings) and its last W (the deferred ones): it is switched on right before
            each of those two ops and off before the chunk's other W ops in between, so each parameter's last
            contribution arrives with it on and no earlier one does. Not called when forward-only.
        exchange_hook: wraps the exchange function for this step (``exchange_hook(p2p.communicate)`` is called
            instead of it), e.g. to time the time spent waiting on neighbours; None for the plain exchange.
        durations: zb-v only: the ``(t_forward, t_backward, t_weight)`` its order is planned for
            (``schedules.schedule_order``); every rank must pass the same. Default: equal F, B and W.
        stats: a dict to fill with what the step held (``memory.py``): ``"peak_activation_bytes"`` (tensors saved
            for backward plus those deferred weight gradients keep, each storage once), ``"peak_live_microbatches"``
            (most (chunk, micro-batch) whose forward ran and whose backward — W for the zero-bubble schedules — has
            not) and ``"peak_deferred"`` (most B ops whose W has not run).

    Returns:
        On the rank holding the last virtual stage, ``forward_step``'s losses, detached, in micro-batch order;
        elsewhere an empty list.

    Raises:
        ValueError: an unknown ``schedule``; ``num_microbatches``, ``num_chunks`` or ``tensor_shape`` that is not
            positive; ``num_chunks`` different from the initialised vpp or > 1 with gpipe / 1f1b / zb-h1 (zb-v: not
            2); a schedule whose placement is not the initialised one; interleaving with ``num_microbatches`` not
            divisible by the pp size; ``forward_step`` returning a loss that is not a scalar, or an activation of
            another shape or dtype than ``tensor_shape`` / ``dtype``. A rank that raises leaves its peers waiting on
            their next message (the process group's timeout ends them).
    """
    fn = "forward_backward"
    if schedule not in ALL_SCHEDULES:
        raise ValueError(f"{fn}: schedule must be one of {', '.join(ALL_SCHEDULES)}, got {schedule!r}")
    try:
        tensor_shape = torch.Size(tensor_shape)
    except TypeError:
        raise ValueError(f"{fn}: tensor_shape must be a sequence of ints, got {tensor_shape!r}") from None
    if not tensor_shape or min(tensor_shape) < 1:
        raise ValueError(f"{fn}: tensor_shape must be non-empty with positive sizes, got {tuple(tensor_shape)}")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{fn}: dtype must be a torch.dtype, got {dtype!r}")
    name = "forward_only" if forward_only else schedule
    placement = placement_of(schedule)
    if placement == "v":
        check_arguments(fn, schedule, 2, num_microbatches, num_chunks, "num_chunks")  # two chunks
    else:
        check_arguments(
            fn, name, 1, num_microbatches, num_chunks, "num_chunks"
        )  # sizes; one chunk for gpipe/1f1b/zb-h1
    pp, rank, set_vpp = _layout(num_chunks, placement)
    check_arguments(
        fn, name, pp, num_microbatches, num_chunks, "num_chunks", placement
    )  # interleaving: m divisible by pp
    plan = communication_plan(name, pp, rank, num_microbatches, num_chunks, placement=placement, durations=durations)
    training = name != "forward_only"
    split = training and splits_backward(schedule)
    stages = pp * num_chunks
    stage = {c: virtual_stage(placement, pp, rank, c, num_chunks) for c in range(num_chunks)}

    def first(c: int) -> bool:
        return stage[c] == 0

    def last(c: int) -> bool:
        return stage[c] == stages - 1

    def local(k: int) -> int | None:
        """The chunk of this rank that virtual stage ``k + 1`` (after stage ``k``) is, when it stays here."""
        return stage_owner(placement, pp, k + 1, num_chunks)[1] if neighbour_direction(placement, pp, k) == 0 else None

    # Position in the plan of each chunk's last B and last W (where its gradients become final).
    final = {}
    for i, step in enumerate(plan):
        if not isinstance(step, Exchange) and step[0] in "BW":
            final[(step[0], step[1])] = i
    syncing = {}
    if training and grad_sync is not None:
        for c in range(num_chunks):
            grad_sync(c, False)
            syncing[c] = False

    inputs: dict[tuple[int, int], torch.Tensor] = {}  # received activation, until its backward
    outputs: dict[tuple[int, int], torch.Tensor] = {}  # forward output or loss, until backward (or sent)
    output_grads: dict[tuple[int, int], torch.Tensor] = {}  # received gradient, until its backward
    input_grads: dict[tuple[int, int], torch.Tensor] = {}  # computed gradient, until sent
    deferred: dict[tuple[int, int], wgrad.Deferred] = {}  # a B's weight gradients, until its W
    losses: dict[int, torch.Tensor] = {}
    no_grad = contextlib.nullcontext if training else torch.no_grad
    communicate = p2p.communicate if exchange_hook is None else exchange_hook(p2p.communicate)
    live = peak_live = peak_deferred = 0
    measuring = memory.measure() if stats is not None else contextlib.nullcontext()

    with measuring as ledger:
        for i, step in enumerate(plan):
            if isinstance(step, Exchange):
                sends = {}
                for field in ("send_next", "send_prev"):
                    op = getattr(step, field)
                    if op is not None:
                        key = op[1:]
                        if op[0] == "B":
                            sends[field] = input_grads.pop(key)
                        else:
                            sends[field] = outputs[key] if training else outputs.pop(key)
                from_prev, from_next = communicate(
                    send_next=sends.get("send_next"),
                    send_prev=sends.get("send_prev"),
                    recv_prev=step.recv_prev is not None,
                    recv_next=step.recv_next is not None,
                    shape=tensor_shape,
                    dtype=dtype,
                    device=device,
                )
                for op, t in ((step.recv_prev, from_prev), (step.recv_next, from_next)):
                    if op is None:
                        continue
                    if op[0] == "B":  # a gradient
                        output_grads[op[1:]] = t.detach()
                    else:  # an activation (on the V, chunk 1's come from the next rank)
                        inputs[op[1:]] = t.requires_grad_() if training else t
                del sends
                continue
            kind, c, j = step
            if set_vpp:
                state.set_vpp_rank(c)
            if kind == "F":
                x = None if first(c) else (inputs[(c, j)] if training else inputs.pop((c, j)))
                with no_grad(), memory.saved_tensors():
                    out = forward_step(c, j, x)
                _check_output(out, c, j, last(c), tensor_shape, dtype)
                if last(c):
                    losses[j] = out.detach()
                turn = None if last(c) else local(stage[c])
                if turn is not None:  # the V's turn: the next stage is this rank's other chunk
                    inputs[(turn, j)] = out.detach().requires_grad_() if training else out
                if training:
                    outputs[(c, j)] = out
                    live += 1
                    peak_live = max(peak_live, live)
                elif not last(c) and turn is None:
                    outputs[(c, j)] = out
                del x, out
                continue
            if grad_sync is not None and kind in "BW":
                on = i in (final.get(("B", c)), final.get(("W", c)))
                if on != syncing[c]:
                    grad_sync(c, on)
                    syncing[c] = on
            if kind == "W":
                deferred.pop((c, j)).run()
                live -= 1
                continue
            out, x = outputs.pop((c, j)), inputs.pop((c, j), None)
            grad = None if last(c) else output_grads.pop((c, j))
            with wgrad.defer() if split else contextlib.nullcontext() as pending:
                torch.autograd.backward(out, grad_tensors=grad)
            if split:
                deferred[(c, j)] = pending
                peak_deferred = max(peak_deferred, len(deferred))
            else:
                live -= 1
            if not first(c):
                # An input the stage does not use gets no gradient; the previous stage still expects a message.
                g = x.grad if x.grad is not None else torch.zeros_like(x)
                back = stage_owner(placement, pp, stage[c] - 1, num_chunks)
                if neighbour_direction(placement, pp, stage[c] - 1) == 0:  # the V's turn: to this rank's other chunk
                    output_grads[(back[1], j)] = g
                else:
                    input_grads[(c, j)] = g
            del out, x, grad
        if stats is not None:
            stats.update(
                peak_activation_bytes=ledger.peak,
                peak_live_microbatches=peak_live,
                peak_deferred=peak_deferred,
            )
    holds_last = any(last(c) for c in range(num_chunks))
    return [losses[j] for j in range(num_microbatches)] if holds_last else []


def _check_output(
    out, chunk: int, microbatch: int, is_last: bool, tensor_shape: torch.Size, dtype: torch.dtype
) -> None:
    where = f"forward_backward: forward_step(chunk={chunk}, microbatch={microbatch})"
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"{where} must return a tensor, got {type(out).__name__}")
    if is_last and out.numel() != 1:
        raise ValueError(f"{where} on the last stage must return a scalar loss, got shape {tuple(out.shape)}")
    if not is_last and (out.shape != tensor_shape or out.dtype != dtype):
        raise ValueError(
            f"{where} returned a {out.dtype} tensor of shape {tuple(out.shape)}; the next stage expects "
            f"tensor_shape={tuple(tensor_shape)}, dtype={dtype}"
        )
