"""Run one training (or evaluation) step of a pipeline schedule: forwards, backwards and the messages between them.

The executor walks ``communication_plan`` for this rank: compute steps in ``schedule_order`` and, between them, the
exchanges with the neighbouring stages (``p2p.communicate``). It owns no model: the caller's ``forward_step`` runs
one chunk on one micro-batch, and backward is ``torch.autograd.backward`` on what it returned.

Memory follows the schedule: a forward's input and output (and so its autograd graph) are kept until its backward,
then dropped; a received gradient lives from its receive to its backward; a computed input gradient until it is
sent. With 1F1B a rank thus holds at most ``pp - rank`` micro-batches' activations, with gpipe all of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from megakernels.parallel import state
from megakernels.parallel.pipeline import p2p
from megakernels.parallel.pipeline.schedules import SCHEDULES, Exchange, _check, communication_plan


def _layout(num_chunks: int) -> tuple[int, int, bool]:
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
) -> list[torch.Tensor]:
    """One step of pipeline schedule ``schedule`` over ``num_microbatches`` micro-batches on this rank.

    Virtual stage ``k = chunk · pp_size + pp_rank``; the first is chunk 0 of pp rank 0, the last chunk
    ``num_chunks-1`` of the last pp rank.

    Args:
        forward_step: ``forward_step(chunk, microbatch, input_tensor)``, called once per forward. ``input_tensor``
            is None on the first virtual stage (the model reads its own data there), else the received activation
            (``tensor_shape``, ``dtype``, requires grad). Returns the scalar loss on the last virtual stage (scaled
            by the caller, e.g. ``/ num_microbatches``: the gradients are the sum of its backwards), elsewhere the
            output activation (``tensor_shape``, ``dtype``) for the next stage. With interleaving,
            ``state.set_vpp_rank(chunk)`` has been called, so ``is_pp_first_stage()`` / ``is_pp_last_stage()``
            inside it are right.
        num_microbatches: micro-batches in this step.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or ``"forward_only"`` (see ``schedules``).
        tensor_shape, dtype, device: of every activation and gradient sent between stages.
        num_chunks: model chunks per rank; must equal ``state.vpp_size()`` (1 when it is None).
        forward_only: forwards only, under ``torch.no_grad`` (evaluation), whatever ``schedule`` says.
        grad_sync: ``grad_sync(chunk, enabled)``, e.g. a data-parallel wrapper's switch: called with False for
            every chunk before the first forward, and with True right before the last backward of each chunk, so
            that the gradient reduction happens once per step and overlaps the remaining backwards. Not called
            when forward-only.
        exchange_hook: wraps the exchange function for this step (``exchange_hook(p2p.communicate)`` is called
            instead of it), e.g. to time the time spent waiting on neighbours; None for the plain exchange.

    Returns:
        On the rank holding the last virtual stage, ``forward_step``'s losses, detached, in micro-batch order;
        elsewhere an empty list.

    Raises:
        ValueError: an unknown ``schedule``; ``num_microbatches``, ``num_chunks`` or ``tensor_shape`` that is not
            positive; ``num_chunks`` different from the initialised vpp or > 1 with gpipe / 1f1b; interleaving
            with ``num_microbatches`` not divisible by the pp size; ``forward_step`` returning a loss that is not a
            scalar, or an activation of another shape or dtype than ``tensor_shape`` / ``dtype``. A rank that
            raises leaves its peers waiting on their next message (the process group's timeout ends them).
    """
    fn = "forward_backward"
    if schedule not in SCHEDULES:
        raise ValueError(f"{fn}: schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    try:
        tensor_shape = torch.Size(tensor_shape)
    except TypeError:
        raise ValueError(f"{fn}: tensor_shape must be a sequence of ints, got {tensor_shape!r}") from None
    if not tensor_shape or min(tensor_shape) < 1:
        raise ValueError(f"{fn}: tensor_shape must be non-empty with positive sizes, got {tuple(tensor_shape)}")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{fn}: dtype must be a torch.dtype, got {dtype!r}")
    name = "forward_only" if forward_only else schedule
    _check(fn, name, 1, num_microbatches, num_chunks, "num_chunks")  # sizes; one chunk for gpipe and 1f1b
    pp, rank, set_vpp = _layout(num_chunks)
    _check(fn, name, pp, num_microbatches, num_chunks, "num_chunks")  # interleaving: m divisible by pp
    plan = communication_plan(name, pp, rank, num_microbatches, num_chunks)
    training = name != "forward_only"

    def first(c: int) -> bool:
        return rank == 0 and c == 0

    def last(c: int) -> bool:
        return rank == pp - 1 and c == num_chunks - 1

    # Position in the plan of each chunk's last backward (where its gradients become final).
    final_backward = {step[1]: i for i, step in enumerate(plan) if not isinstance(step, Exchange) and step[0] == "B"}
    if training and grad_sync is not None:
        for c in range(num_chunks):
            grad_sync(c, False)

    inputs: dict[tuple[int, int], torch.Tensor] = {}  # received activation, until its backward
    outputs: dict[tuple[int, int], torch.Tensor] = {}  # forward output or loss, until backward (or sent)
    output_grads: dict[tuple[int, int], torch.Tensor] = {}  # received gradient, until its backward
    input_grads: dict[tuple[int, int], torch.Tensor] = {}  # computed gradient, until sent
    losses: dict[int, torch.Tensor] = {}
    no_grad = contextlib.nullcontext if training else torch.no_grad
    communicate = p2p.communicate if exchange_hook is None else exchange_hook(p2p.communicate)

    for i, step in enumerate(plan):
        if isinstance(step, Exchange):
            send_next = send_prev = None
            if step.send_next:
                key = step.send_next[1:]
                send_next = outputs[key] if training else outputs.pop(key)
            if step.send_prev:
                send_prev = input_grads.pop(step.send_prev[1:])
            from_prev, from_next = communicate(
                send_next=send_next,
                send_prev=send_prev,
                recv_prev=step.recv_prev is not None,
                recv_next=step.recv_next is not None,
                shape=tensor_shape,
                dtype=dtype,
                device=device,
            )
            if step.recv_prev:
                inputs[step.recv_prev[1:]] = from_prev
            if step.recv_next:
                output_grads[step.recv_next[1:]] = from_next
            continue
        kind, c, j = step
        if set_vpp:
            state.set_vpp_rank(c)
        if kind == "F":
            x = None if first(c) else (inputs[(c, j)] if training else inputs.pop((c, j)))
            with no_grad():
                out = forward_step(c, j, x)
            _check_output(out, c, j, last(c), tensor_shape, dtype)
            if last(c):
                losses[j] = out.detach()
            if training or not last(c):
                outputs[(c, j)] = out
            del x, out
            continue
        if grad_sync is not None and final_backward[c] == i:
            grad_sync(c, True)
        out, x = outputs.pop((c, j)), inputs.pop((c, j), None)
        if last(c):
            torch.autograd.backward(out)
        else:
            torch.autograd.backward(out, grad_tensors=output_grads.pop((c, j)))
        if not first(c):
            # An input the stage does not use gets no gradient; the previous stage still expects a message.
            input_grads[(c, j)] = x.grad if x.grad is not None else torch.zeros_like(x)
        del out, x
    return [losses[j] for j in range(num_microbatches)] if rank == pp - 1 else []


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
