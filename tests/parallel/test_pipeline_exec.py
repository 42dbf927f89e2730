"""forward_backward runs the schedules for real: one world of 4 gloo processes (pp 2 with dp 2, and pp 4).

The model is a stack of L Linear + tanh layers in fp64 that every rank can build whole from a seed; virtual stage
k = chunk · pp + rank holds layers [k·L/S, (k+1)·L/S) of S = pp · vpp. Each check compares the pipeline against the
same model run in one process on all micro-batches: the losses and every rank's parameter gradients agree to 1e-10.
It also checks that the executed order of forwards and backwards is ``schedule_order``, that the exchanges are
exactly ``communication_plan``'s, when ``grad_sync`` is called, and that activations are freed as the schedule
says. Single-stage runs (no process group at all) are tested in this process.
"""

from __future__ import annotations

import weakref

import pytest
import torch

import megakernels.parallel as mp
from megakernels.parallel.pipeline import Exchange, communication_plan, forward_backward, p2p, schedule_order, simulate
from megakernels.parallel.pipeline.executor import _check_output
from tests.parallel.checks import Checks, assert_close

CHECKS = Checks()
L, H, ROWS = 8, 6, 3  # layers, hidden size, rows of a micro-batch
SHAPE, DTYPE = (ROWS, H), torch.float64


def _layers() -> list[torch.nn.Linear]:
    g = torch.Generator().manual_seed(1234)
    layers = []
    for _ in range(L):
        layer = torch.nn.Linear(H, H, dtype=DTYPE)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(H, H, generator=g, dtype=DTYPE) / H**0.5)
            layer.bias.copy_(torch.randn(H, generator=g, dtype=DTYPE) * 0.1)
        layers.append(layer)
    return layers


def _data(m: int) -> list[torch.Tensor]:
    return [torch.randn(*SHAPE, generator=torch.Generator().manual_seed(100 + j), dtype=DTYPE) for j in range(m)]


def _run(layers, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = torch.tanh(layer(x))
    return x


def _loss(y: torch.Tensor, m: int) -> torch.Tensor:
    return y.pow(2).mean() / m


def _reference(m: int):
    layers = _layers()
    losses = [_loss(_run(layers, x), m) for x in _data(m)]
    torch.stack(losses).sum().backward()
    return [loss.detach() for loss in losses], layers


class _Mark(torch.autograd.Function):
    """Identity whose backward logs ``tag``: the moment backward of a (chunk, micro-batch) starts."""

    @staticmethod
    def forward(ctx, x, log, tag):
        ctx.log, ctx.tag = log, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(ctx.tag)
        return grad, None, None


def _pipeline(schedule: str, m: int, vpp: int = 1, forward_only: bool = False):
    """Run the toy model through forward_backward on this rank; returns (losses, {chunk: layers}, log, held)."""
    p, r = mp.pp_size(), mp.pp_rank()
    layers, data, per = _layers(), _data(m), L // (p * vpp)
    chunks = {c: layers[(c * p + r) * per : (c * p + r + 1) * per] for c in range(vpp)}
    log, alive, held = [], [], []

    def forward_step(chunk, microbatch, x):
        assert mp.is_pp_first_stage() == (x is None) and (mp.vpp_rank() in (None, chunk))
        held.append(sum(ref() is not None for ref in alive))  # outputs the executor still holds
        log.append(("F", chunk, microbatch))
        y = _run(chunks[chunk], data[microbatch] if x is None else x)
        out = _Mark.apply(_loss(y, m) if mp.is_pp_last_stage() else y, log, ("B", chunk, microbatch))
        alive.append(weakref.ref(out))
        return out

    with mp.record_events() as events:
        losses = forward_backward(
            forward_step,
            m,
            schedule=schedule,
            tensor_shape=SHAPE,
            dtype=DTYPE,
            device="cpu",
            num_chunks=vpp,
            forward_only=forward_only,
            grad_sync=lambda c, on: log.append(("sync", c, on)),
        )
    log.append(("p2p", [detail for kind, detail in events if kind == "p2p"]))
    return losses, chunks, log, held


def _planned_exchanges(name, m, vpp) -> list[str]:
    plan = communication_plan(name, mp.pp_size(), mp.pp_rank(), m, vpp)
    return [
        "+".join(f for f in ("send_next", "send_prev", "recv_prev", "recv_next") if getattr(s, f) is not None)
        for s in plan
        if isinstance(s, Exchange)
    ]


def _check_step(schedule: str, m: int, vpp: int = 1, forward_only: bool = False) -> None:
    p, r = mp.pp_size(), mp.pp_rank()
    forward_only = forward_only or schedule == "forward_only"
    name = "forward_only" if forward_only else schedule
    losses, chunks, log, held = _pipeline(schedule, m, vpp, forward_only)
    ref_losses, ref_layers = _reference(m)
    what = f"{name} pp={p} m={m} vpp={vpp} rank={r}"
    # Losses on the last stage, in micro-batch order.
    if r == p - 1:
        assert len(losses) == m, what
        for j, (got, want) in enumerate(zip(losses, ref_losses)):
            assert_close(got, want, f"{what}: loss {j}", rtol=1e-12)
    else:
        assert losses == [], what
    # Gradients of this rank's layers, or none at all when forward-only.
    per = L // (p * vpp)
    for c, layers in chunks.items():
        for i, layer in enumerate(layers):
            ref = ref_layers[(c * p + r) * per + i]
            for got, want, which in ((layer.weight, ref.weight, "weight"), (layer.bias, ref.bias, "bias")):
                if forward_only:
                    assert got.grad is None, f"{what}: forward-only left a gradient"
                else:
                    assert_close(got.grad, want.grad, f"{what}: chunk {c} layer {i} {which} grad", rtol=1e-10)
    # Executed order, grad_sync calls, exchanges.
    (_, exchanges), log = log[-1], log[:-1]
    order = schedule_order(name, p, r, m, vpp)
    assert [e for e in log if e[0] in "FB"] == order, f"{what}: executed {log}"
    assert exchanges == _planned_exchanges(name, m, vpp), f"{what}: exchanges {exchanges}"
    syncs = [e for e in log if e[0] == "sync"]
    if forward_only:
        assert syncs == [], what
    else:
        assert log[:vpp] == [("sync", c, False) for c in range(vpp)], what
        assert len(syncs) == 2 * vpp, f"{what}: {syncs}"
        for c in range(vpp):
            last_b = max(i for i, op in enumerate(log) if op[:2] == ("B", c))
            assert log[last_b - 1] == ("sync", c, True), f"{what}: {log}"
        # Memory follows the schedule: the outputs held at a forward, plus its own, peak at the simulated count.
        assert max(held) + 1 == simulate(name, p, m, vpp)["peak_in_flight"][r], f"{what}: held {held}"


for _p in (2, 4):
    for _schedule, _vpp, _ms in (
        ("gpipe", 1, (_p, 2 * _p, 4 * _p + 1)),
        ("1f1b", 1, (_p, 2 * _p, 4 * _p + 1)),
        ("interleaved", 2, (_p, 2 * _p)),
    ):

        def _check(rank, world, p=_p, schedule=_schedule, vpp=_vpp, ms=_ms):
            mp.initialize(1, p, vpp=vpp if vpp > 1 else None)
            for m in ms:
                _check_step(schedule, m, vpp)

        CHECKS.add(f"{_schedule}_pp{_p}_matches_one_process")(_check)

    def _check(rank, world, p=_p):
        mp.initialize(1, p, vpp=2)
        for m in (p, 2 * p, 4 * p + 1):
            _check_step("forward_only", m, vpp=2)
            _check_step("interleaved", m, vpp=2, forward_only=True)
        mp.destroy()
        mp.initialize(1, p)
        _check_step("1f1b", 4 * p + 1, forward_only=True)

    CHECKS.add(f"forward_only_pp{_p}_matches_one_process")(_check)


@CHECKS.add("pp1_dp4_is_gradient_accumulation_without_messages")
def _(rank, world):
    mp.initialize(1, 1)
    for schedule in ("gpipe", "1f1b", "interleaved"):
        _check_step(schedule, 3)


@CHECKS.add("p2p_combined_operations_pair_up_between_neighbours")
def _(rank, world):
    for p in (2, 4):
        mp.initialize(1, p)
        r, prev, nxt = mp.pp_rank(), (mp.pp_rank() - 1) % p, (mp.pp_rank() + 1) % p

        def msg(tag: int, stage: int) -> torch.Tensor:
            return torch.full(SHAPE, 10.0 * tag + stage, dtype=DTYPE)

        if r > 0:
            x = p2p.recv_forward(SHAPE, DTYPE)
            assert x.requires_grad and torch.equal(x.detach(), msg(1, prev))
        if r < p - 1:
            p2p.send_forward(msg(1, r))
        # 1F1B: a stage's send_backward_recv_forward meets the previous stage's send_forward_recv_backward.
        if r > 0:
            x = p2p.send_backward_recv_forward(msg(2, r))
            assert x.requires_grad and torch.equal(x.detach(), msg(3, prev))
        if r < p - 1:
            g = p2p.send_forward_recv_backward(msg(3, r))
            assert not g.requires_grad and torch.equal(g, msg(2, nxt))
        if r < p - 1:
            assert torch.equal(p2p.recv_backward(SHAPE, DTYPE), msg(4, nxt))
        if r > 0:
            p2p.send_backward(msg(4, r))
        # Interleaving, around the ring; with two stages next == prev, so the operations' order must line up.
        assert torch.equal(p2p.send_forward_recv_forward(msg(5, r)).detach(), msg(5, prev))
        assert torch.equal(p2p.send_backward_recv_backward(msg(6, r)), msg(6, nxt))
        with mp.record_events() as events:
            x, g = p2p.send_forward_backward_recv_forward_backward(msg(7, r), msg(8, r))
        assert torch.equal(x.detach(), msg(7, prev)) and torch.equal(g, msg(8, nxt))
        assert events == [("p2p", "send_next+send_prev+recv_prev+recv_next")]
        mp.destroy()


@CHECKS.add("arguments_checked_before_any_message")
def _(rank, world):
    mp.initialize(1, 2, vpp=2)
    kwargs = dict(tensor_shape=SHAPE, dtype=DTYPE, device="cpu")
    with pytest.raises(ValueError, match=r"num_chunks=1 must equal the vpp .* \(vpp=2\)"):
        forward_backward(None, 4, schedule="1f1b", **kwargs)
    with pytest.raises(ValueError, match="num_microbatches divisible by pp_size .* num_microbatches=3, pp_size=2"):
        forward_backward(None, 3, schedule="interleaved", num_chunks=2, **kwargs)
    with pytest.raises(ValueError, match="schedule 'gpipe' runs one model chunk per rank, got num_chunks=2"):
        forward_backward(None, 4, schedule="gpipe", num_chunks=2, **kwargs)


def _world(rank, world_size):
    torch.set_num_threads(1)
    return CHECKS.run(rank, world_size)


world = CHECKS.fixture(4, _world)


@pytest.mark.parametrize("name", CHECKS.names())
def test_pipeline(world, name):
    CHECKS.assert_passed(world, name)


# ---- one stage, no process group -------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_single_stage_without_process_group_accumulates_gradients(schedule):
    m, layers, data = 4, _layers(), _data(4)
    calls = []
    losses = forward_backward(
        lambda c, j, x: _loss(_run(layers, data[j]), m),
        m,
        schedule=schedule,
        tensor_shape=SHAPE,
        dtype=DTYPE,
        device="cpu",
        grad_sync=lambda c, on: calls.append((c, on)),
    )
    ref_losses, ref_layers = _reference(m)
    assert calls == [(0, False), (0, True)]
    for got, want in zip(losses, ref_losses):
        assert_close(got, want, "loss", rtol=1e-12)
    for got, want in zip(layers, ref_layers):
        assert_close(got.weight.grad, want.weight.grad, "weight grad", rtol=1e-10)


def test_forward_only_without_process_group_keeps_no_graph():
    layers, data = _layers(), _data(2)
    losses = forward_backward(
        lambda c, j, x: _loss(_run(layers, data[j]), 2),
        2,
        tensor_shape=SHAPE,
        dtype=DTYPE,
        device="cpu",
        forward_only=True,
    )
    assert len(losses) == 2 and not any(loss.requires_grad for loss in losses)
    assert all(layer.weight.grad is None for layer in layers)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(schedule="zero_bubble"), "schedule must be one of gpipe, 1f1b, interleaved, forward_only"),
        (dict(tensor_shape=(3, 0)), r"tensor_shape must be non-empty with positive sizes, got \(3, 0\)"),
        (dict(tensor_shape=None), "tensor_shape must be a sequence of ints"),
        (dict(dtype="float64"), "dtype must be a torch.dtype"),
        (dict(schedule="interleaved", num_chunks=2), "num_chunks=2 needs megakernels.parallel initialised with vpp=2"),
        (dict(num_chunks=0), "num_chunks must be a positive int, got 0"),
    ],
)
def test_executor_errors_name_the_argument(kwargs, message):
    args = dict(tensor_shape=SHAPE, dtype=DTYPE, device="cpu") | kwargs
    with pytest.raises(ValueError, match=message):
        forward_backward(lambda c, j, x: None, 2, **args)
    with pytest.raises(ValueError, match="num_microbatches must be a positive int, got 0"):
        forward_backward(lambda c, j, x: None, 0, tensor_shape=SHAPE, dtype=DTYPE, device="cpu")


def test_forward_step_results_are_checked():
    with pytest.raises(
        ValueError,
        match=r"forward_step\(chunk=0, microbatch=0\) on the last stage must return a "
        r"scalar loss, got shape \(3, 6\)",
    ):
        forward_backward(
            lambda c, j, x: torch.zeros(SHAPE, dtype=DTYPE).requires_grad_(),
            2,
            tensor_shape=SHAPE,
            dtype=DTYPE,
            device="cpu",
            forward_only=False,
            schedule="gpipe",
        )
    with pytest.raises(
        ValueError,
        match=r"returned a torch.float32 tensor of shape \(3, 5\); the next stage expects "
        r"tensor_shape=\(3, 6\), dtype=torch.float64",
    ):
        _check_output(torch.zeros(3, 5), 1, 2, False, torch.Size(SHAPE), DTYPE)
