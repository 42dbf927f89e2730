"""Point-to-point exchange of activations (forward) and gradients (backward) between neighbouring pipeline stages.

Every message has the same, known shape and dtype (``[s, b, h]`` activations and their gradients), so a receiver
allocates its buffer without asking the sender first; there is no shape handshake per micro-batch.

Why sends and receives go together in one ``batch_isend_irecv``: in PyTorch's NCCL backend all point-to-point
operations between one pair of ranks run in order on one stream, and a send need not complete before the peer has
posted the matching receive. If rank A sends to B and then receives from B as two calls, while B does the same,
each send waits for a receive queued behind the other rank's own blocked send: a deadlock. Gloo, which the CPU
tests run on, tolerates orders that NCCL does not, so passing there proves nothing. Hence every send and receive
that cross between two neighbours at the same point of the schedule are issued in ONE ``batch_isend_irecv`` (an
NCCL group), as Megatron-LM does, and the schedules (``schedules.communication_plan``) are built so that even
blocking, unbuffered messages cannot deadlock (a property the tests check by replaying every rank's plan).

Within one call, operations are issued in a fixed order, sends to the next then the previous rank, receives from
the previous then the next: with two stages the next and previous rank are the same peer, and NCCL matches the
operations between a pair in issue order, so a sender's ``send_next`` must line up with the receiver's
``recv_prev`` (and ``send_prev`` with ``recv_next``).

Peers are ``state.pp_next_rank()`` / ``state.pp_prev_rank()`` in ``state.pp_group()`` (wrapping from the last stage
to the first, which the interleaved schedule uses). Received activations get ``requires_grad_()`` so that backward
through the stage produces their gradient, the tensor sent back; received gradients do not. Each call is reported
to ``megakernels.parallel.record_events()`` as ``("p2p", "send_next+recv_next")`` (the operations it carries).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megakernels.parallel import comm, state


def communicate(
    *,
    send_next: torch.Tensor | None = None,
    send_prev: torch.Tensor | None = None,
    recv_prev: bool = False,
    recv_next: bool = False,
    shape=None,
    dtype: torch.dtype | None = None,
    device=None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Send to and receive from the neighbouring stages in one ``batch_isend_irecv``, and wait for all of it.

    Args:
        send_next: activation for the next stage, or None.
        send_prev: gradient for the previous stage, or None.
        recv_prev: receive an activation from the previous stage (returned with ``requires_grad``).
        recv_next: receive a gradient from the next stage.
        shape, dtype, device: of the received tensors (every message of a pipeline has them); by default those
            of the tensor sent.

    Returns:
        ``(from_prev, from_next)``, each None unless asked for.

    Raises:
        ValueError: a receive without a shape and dtype (none given and nothing sent).
        RuntimeError: ``megakernels.parallel`` not initialised.
    """
    sent = send_next if send_next is not None else send_prev
    if (recv_prev or recv_next) and sent is None and (shape is None or dtype is None):
        raise ValueError("communicate: a receive needs shape and dtype (none given and no tensor sent)")
    if sent is not None:
        shape = sent.shape if shape is None else shape
        dtype = sent.dtype if dtype is None else dtype
        device = sent.device if device is None else device
    group, nxt, prev = state.pp_group(), state.pp_next_rank(), state.pp_prev_rank()

    def empty() -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=device)

    from_prev = empty() if recv_prev else None
    from_next = empty() if recv_next else None
    ops, names = [], []
    # Fixed order (see the module docstring): with two stages, nxt == prev and NCCL pairs operations by order.
    for name, op, tensor, peer in (
        ("send_next", dist.isend, send_next, nxt),
        ("send_prev", dist.isend, send_prev, prev),
        ("recv_prev", dist.irecv, from_prev, prev),
        ("recv_next", dist.irecv, from_next, nxt),
    ):
        if tensor is not None:
            if op is dist.isend:
                tensor = tensor.detach().contiguous()
            ops.append(dist.P2POp(op, tensor, peer, group))
            names.append(name)
    if not ops:
        return None, None
    comm.record("p2p", "+".join(names))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    if from_prev is not None:
        from_prev.requires_grad_()
    return from_prev, from_next


# ---- Megatron-LM's combined operations ------------------------------------------------------------------------
# Call them only where the neighbour exists and does the matching operation at the same point of the schedule.


def recv_forward(shape, dtype: torch.dtype, device=None) -> torch.Tensor:
    """The input activation from the previous stage (``requires_grad``)."""
    return communicate(recv_prev=True, shape=shape, dtype=dtype, device=device)[0]


def recv_backward(shape, dtype: torch.dtype, device=None) -> torch.Tensor:
    """The gradient of this stage's output, from the next stage."""
    return communicate(recv_next=True, shape=shape, dtype=dtype, device=device)[1]


def send_forward(output: torch.Tensor) -> None:
    """Send this stage's output activation to the next stage."""
    communicate(send_next=output)


def send_backward(input_grad: torch.Tensor) -> None:
    """Send the gradient of this stage's input to the previous stage."""
    communicate(send_prev=input_grad)


def send_forward_recv_backward(output: torch.Tensor) -> torch.Tensor:
    """Send the output activation to the next stage and receive its gradient from there (1F1B, after a forward)."""
    return communicate(send_next=output, recv_next=True)[1]


def send_backward_recv_forward(input_grad: torch.Tensor) -> torch.Tensor:
    """Send the input gradient to the previous stage and receive the next input from there (1F1B, after a
    backward); the received activation has ``requires_grad``."""
    return communicate(send_prev=input_grad, recv_prev=True)[0]


def send_forward_recv_forward(output: torch.Tensor, recv_prev: bool = True) -> torch.Tensor | None:
    """Send the output activation to the next stage and receive an input activation from the previous one
    (interleaved warm-up); None when not ``recv_prev``."""
    return communicate(send_next=output, recv_prev=recv_prev)[0]


def send_backward_recv_backward(input_grad: torch.Tensor, recv_next: bool = True) -> torch.Tensor | None:
    """Send the input gradient to the previous stage and receive an output gradient from the next one
    (interleaved cool-down); None when not ``recv_next``."""
    return communicate(send_prev=input_grad, recv_next=recv_next)[1]


def send_forward_backward_recv_forward_backward(
    output: torch.Tensor | None,
    input_grad: torch.Tensor | None,
    recv_prev: bool = True,
    recv_next: bool = True,
    *,
    shape=None,
    dtype: torch.dtype | None = None,
    device=None,
):
    """Both directions at once (interleaved steady state): send ``output`` to the next stage and ``input_grad`` to
    the previous one (either may be None), receive an activation from the previous stage and a gradient from the
    next one. Returns ``(input_activation, output_grad)``, each None unless asked for."""
    return communicate(
        send_next=output,
        send_prev=input_grad,
        recv_prev=recv_prev,
        recv_next=recv_next,
        shape=shape,
        dtype=dtype,
        device=device,
    )
