"""Zero-bubble pipeline schedules (zb-h1, zb-v): the schedules as data, their simulated bubbles against the closed
forms, their exchanges replayed with blocking messages, the deferred weight gradients of the layers that split their
backward, and the executor for real in one world of 4 gloo processes (pp 2 × dp 2 with the data-parallel wrapper,
and pp 4): losses and gradients equal one process's, the executed order is the plan's, and the activation memory
each schedule holds is measured."""

from __future__ import annotations

import pytest
import torch

import megakernels.parallel as mp
from megakernels.parallel.pipeline import memory, schedules, wgrad
from megakernels.parallel.pipeline.schedules import (
    Exchange,
    bubble_fraction,
    communication_plan,
    format_schedule,
    schedule_order,
    simulate,
    stage_owner,
    virtual_stage,
)
from tests.parallel.checks import Checks, assert_close

ZB = ("zb-h1", "zb-v")
TIMES = [(1.0, 2.0, 1.0), (1.0, 2.0, 0.8), (1.0, 2.4, 0.9), (1.0, 2.0, 0.5), (2.0, 2.0, 1.0)]


def _cases(pps=(2, 3, 4)):
    for name in ZB:
        for p in pps:
            for m in sorted({1, max(1, p - 1), p, 2 * p, 4 * p + 1}):
                yield name, p, m


def _placement(name):
    return schedules.placement_of(name)


# ---- orders ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, p, m", list(_cases()))
def test_every_op_runs_once_w_after_its_b_after_its_f(name, p, m):
    v = schedules.default_vpp(name)
    for r in range(p):
        order = schedule_order(name, p, r, m)
        for kind in "FBW":
            assert sorted(op for op in order if op[0] == kind) == [(kind, c, j) for c in range(v) for j in range(m)]
        at = {op: i for i, op in enumerate(order)}
        assert all(at[("F", c, j)] < at[("B", c, j)] < at[("W", c, j)] for c in range(v) for j in range(m))


def test_zb_h1_is_1f1b_with_the_w_passes_delayed_by_rank():
    assert schedule_order("zb-h1", 4, 3, 3) == [
        ("F", 0, 0),
        ("B", 0, 0),
        ("F", 0, 1),
        ("B", 0, 1),
        ("F", 0, 2),
        ("B", 0, 2),  # fmt: skip
        ("W", 0, 0),
        ("W", 0, 1),
        ("W", 0, 2),  # fmt: skip
    ]
    for p, m in ((4, 6), (3, 5)):
        for r in range(p):
            fb = [op for op in schedule_order("zb-h1", p, r, m) if op[0] != "W"]
            assert [(k if k == "F" else "B", c, j) for k, c, j in fb] == schedule_order("1f1b", p, r, m)


def test_zb_v_places_two_chunks_per_rank_in_a_v():
    p = 4
    assert [virtual_stage("v", p, r, c, 2) for r in range(p) for c in (0, 1)] == [0, 7, 1, 6, 2, 5, 3, 4]
    assert all(stage_owner("v", p, virtual_stage("v", p, r, c, 2), 2) == (r, c) for r in range(p) for c in (0, 1))
    # Rank 0 starts with chunk 0's forwards; the last rank turns the V: its chunk 1 follows its chunk 0 at once.
    assert schedule_order("zb-v", p, 0, 8)[:2] == [("F", 0, 0), ("F", 0, 1)]
    assert schedule_order("zb-v", p, p - 1, 8)[:2] == [("F", 0, 0), ("F", 1, 0)]


# ---- simulator -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("times", TIMES)
@pytest.mark.parametrize("p, m", [(2, 2), (2, 9), (3, 6), (4, 4), (4, 17), (8, 16)])
def test_zb_h1_bubble_is_the_papers_closed_form_for_m_at_least_pp(p, m, times):
    sim = simulate("zb-h1", p, m, None, *times)
    assert sim["bubble_fraction"] == pytest.approx(bubble_fraction("zb-h1", p, m, None, *times), abs=1e-12)


def test_bubble_fractions_at_equal_times():
    """T_F = T_B = T_W (t_backward = 2, t_weight = 1): 1F1B (p-1)/m, zb-h1 a third of it, zb-v a sixth (the last
    rank's wait for its first input, p-1 chunk forwards, is all that is left)."""
    for p, m in ((2, 4), (4, 8), (4, 17), (8, 8), (8, 32)):
        assert simulate("1f1b", p, m)["bubble_fraction"] == pytest.approx((p - 1) / m)
        assert simulate("zb-h1", p, m)["bubble_fraction"] == pytest.approx((p - 1) / (3 * m))
        assert simulate("zb-v", p, m)["bubble_fraction"] == pytest.approx((p - 1) / (6 * m))
        assert bubble_fraction("zb-v", p, m) == pytest.approx((p - 1) / (6 * m))


@pytest.mark.parametrize("times", TIMES)
@pytest.mark.parametrize("p, m", [(2, 8), (4, 16), (8, 32)])
def test_zb_v_planned_for_the_times_beats_zb_h1_and_respects_the_bound(p, m, times):
    v, h1 = simulate("zb-v", p, m, None, *times), simulate("zb-h1", p, m, None, *times)
    assert v["bubble_fraction"] >= bubble_fraction("zb-v", p, m, None, *times) - 1e-12
    assert v["bubble_fraction"] <= h1["bubble_fraction"] + 1e-12


@pytest.mark.parametrize("name, p, m", list(_cases(pps=(2, 4, 8))))
def test_peak_memory_is_1f1bs_first_stage_on_every_rank(name, p, m):
    """Counted until W (what the deferred weight gradients hold), every rank keeps at most min(p, m) micro-batches
    through its layers: 1F1B's first-stage peak, which costs.in_flight_per_rank uses."""
    from megakernels_models.planning import costs

    sim = simulate(name, p, m)
    assert max(sim["peak_activations"]) == min(p, m)
    layout = costs.Layout(pp=p, vpp=schedules.default_vpp(name), schedule=name, micro_batch_size=1, global_batch_size=m)
    assert costs.in_flight_per_rank(layout) == [float(min(p, m))] * p
    assert max(simulate("1f1b", p, m)["peak_activations"]) == min(p, m)


def test_the_planners_zb_v_estimate_follows_the_simulation():
    """costs.pipeline_bubble simulates zb-v up to 8·pp micro-batches and extrapolates its idle time linearly past
    that: constant without recomputation (the list scheduler's idle time wanders by ~10 % from one m to the next),
    growing when B outweighs F and W (full recomputation's times), where it may saturate or grow again later."""
    from megakernels_models.models.config import preset, stage_times
    from megakernels_models.planning.costs import zb_v_idle

    cfg = preset("gpt-1.3b")
    for times, lo, hi in (
        ((1.0, 2.0, 1.0), 0.999, 1.001),
        (stage_times(cfg), 0.8, 1.25),
        (stage_times(cfg, "full"), 0.75, 1.5),
    ):
        for p in (4, 8):
            for m in (p, 4 * p, 10 * p, 12 * p):
                sim = simulate("zb-v", p, m, None, *times)
                exact = sim["total_time"] - sim["useful_time"]
                assert lo * exact <= zb_v_idle(p, m, times) <= hi * exact, (times, p, m, exact)
    assert [zb_v_idle(8, m, (1.0, 2.0, 1.0)) for m in (16, 64, 1000)] == pytest.approx([3.5] * 3)


def test_format_schedule_draws_the_w_passes_and_the_v():
    text = format_schedule("zb-h1", 2, 3)
    assert text.splitlines()[1:3] == [
        "rank 0 | F0 F1 .. B0 W0 F2 B1 W1 B2 W2",
        "rank 1 | .. F0 B0 F1 B1 W0 F2 B2 W1 W2",
    ]
    assert "bubble fraction 0.1111 (closed form 0.1111)" in text
    v = format_schedule("zb-v", 2, 4)
    assert "F0a" in v and "W3b" in v and "b = chunk 1 (stage 3-r on rank r)" in v
    assert schedules.main(["--pp", "4", "--microbatches", "8", "--schedule", "zb-v"]) == 0


# ---- exchanges -------------------------------------------------------------------------------------------------


def _messages(p: int, r: int, ex: Exchange, placement: str, v: int):
    """(send | recv, peer, message) of one exchange; a message is (act | grad, producing virtual stage, mb). The
    fields are directions; the op says what travels (an F's activation, a B's input gradient)."""
    out = []
    for field, op in zip(Exchange._fields, ex):
        if op is None:
            continue
        kind, c, j = op
        k = virtual_stage(placement, p, r, c, v)
        peer = (r + 1) % p if field.endswith("next") else (r - 1) % p
        if field.startswith("send"):
            out.append(("send", peer, ("act" if kind == "F" else "grad", k, j)))
        else:
            out.append(("recv", peer, ("act", k - 1, j) if kind == "F" else ("grad", k + 1, j)))
    return out


def _replay(plans, placement, v):
    """Every rank's exchanges with NCCL's worst case, as tests/parallel/test_pipeline.py's replay_blocking: a rank
    waits for all of an exchange before its next one, and an operation completes only once its peer posted the
    match; the k-th message from a to b matches b's k-th receive from a and must be the same tensor."""
    p = len(plans)
    exchanges = [[s for s in plan if isinstance(s, Exchange)] for plan in plans]
    sent, received = {}, {}
    for r in range(p):
        for e, ex in enumerate(exchanges[r]):
            for direction, peer, msg in _messages(p, r, ex, placement, v):
                pair = (r, peer) if direction == "send" else (peer, r)
                (sent if direction == "send" else received).setdefault(pair, []).append((r, e, msg))
    assert sent.keys() == received.keys()
    waits = {}
    for pair, sends in sent.items():
        recvs = received[pair]
        assert [m for *_, m in sends] == [m for *_, m in recvs], f"messages {pair} out of order"
        for (a, ea, _), (b, eb, _) in zip(sends, recvs):
            waits.setdefault((a, ea), []).append((b, eb))
            waits.setdefault((b, eb), []).append((a, ea))
    pos = [0] * p
    while any(pos[r] < len(exchanges[r]) for r in range(p)):
        ready = [
            r
            for r in range(p)
            if pos[r] < len(exchanges[r]) and all(pos[b] >= eb for b, eb in waits.get((r, pos[r]), []))
        ]
        assert ready, f"deadlock with ranks at exchanges {pos}"
        for r in ready:
            pos[r] += 1
    return sent


@pytest.mark.parametrize("name, p, m", [c for c in _cases() if c[1] > 1] + [("forward_only", 4, 5)])
def test_exchanges_cannot_deadlock_and_carry_exactly_the_inputs_from_other_ranks(name, p, m):
    placement = "v" if name == "forward_only" else _placement(name)
    v = 2 if placement == "v" else 1
    plans = [communication_plan(name, p, r, m, v, placement=placement) for r in range(p)]
    sent = _replay(plans, placement, v)
    last = p * v - 1
    for r, plan in enumerate(plans):
        assert [s for s in plan if not isinstance(s, Exchange)] == schedule_order(name, p, r, m, v, placement=placement)
        received = set()
        for step in plan:
            if isinstance(step, Exchange):
                assert sum(x is not None for x in step[:2]) <= 1  # one op's output per exchange
                received |= {op for op in step[2:] if op is not None}
                continue
            kind, c, _ = step
            k = virtual_stage(placement, p, r, c, v)
            other = {"F": k - 1, "B": k + 1}.get(kind)
            remote = other is not None and 0 <= other <= last and stage_owner(placement, p, other, v)[0] != r
            assert (step in received) == remote, step
    if name == "zb-v":  # two chunks per rank: twice 1F1B's messages, less the V's turn on the last rank
        assert sum(len(s) for s in sent.values()) == 2 * m * (2 * p - 2)


# ---- deferred weight gradients ---------------------------------------------------------------------------------


def _layers_grads(make, defer: bool):
    torch.manual_seed(0)
    module, inputs, params = make()
    out = module(*inputs)
    if defer:
        with wgrad.defer() as pending:
            out.square().sum().backward()
        assert len(pending) > 0 and all(p.grad is None for p in params)
        pending.run()
    else:
        out.square().sum().backward()
    return [t.grad.clone() for t in inputs if t.requires_grad] + [p.grad.clone() for p in params]


def _row():
    from megakernels.parallel.linear import RowLinear

    w = torch.nn.Parameter(torch.randn(5, 6, dtype=torch.float64))
    return (lambda x: RowLinear.apply(x, w)), [torch.randn(3, 2, 6, dtype=torch.float64, requires_grad=True)], [w]


def _column():
    from megakernels.parallel.linear import ColumnParallelLinear

    layer = ColumnParallelLinear(6, 4, dtype=torch.float64, seed=3)
    return layer, [torch.randn(3, 2, 6, dtype=torch.float64, requires_grad=True)], [layer.weight]


def _experts(fp8=None):
    def make():
        from megakernels.parallel.moe.experts import GroupedMLP

        mlp = GroupedMLP(8, 16, 3, 0, 3, seed=5)
        if fp8:
            mlp.fp8 = __import__("megakernels.ops.fp8", fromlist=["x"]).get_recipe(fp8)
        rows = torch.randn(7, 8, requires_grad=True)
        return (lambda x: mlp(x, torch.tensor([3, 0, 4]))), [rows], [mlp.fc1, mlp.fc2]

    return make


def _fp8_linear(recipe):
    def make():
        from megakernels.ops.fp8 import get_recipe
        from megakernels.parallel.linear import RowParallelLinear

        layer = RowParallelLinear(8, 4, bias=False, seed=4)
        layer.fp8 = get_recipe(recipe)
        return layer, [torch.randn(3, 2, 8, requires_grad=True)], [layer.weight]

    return make


@pytest.mark.parametrize(
    "make",
    [_row, _column, _experts(), _experts("tensorwise"), _fp8_linear("tensorwise"), _fp8_linear("blockwise")],
    ids=["row", "column", "experts", "experts-fp8", "fp8-tensorwise", "fp8-blockwise"],
)
def test_deferred_weight_gradients_equal_the_undeferred_bit_for_bit(make):
    from megakernels.parallel.launch import single_process_world

    with single_process_world(parallel=True):
        plain, deferred = _layers_grads(make, False), _layers_grads(make, True)
    for a, b in zip(plain, deferred):
        assert torch.equal(a, b)


def test_a_deferred_gradient_accumulates_through_autograd_and_fires_the_hooks():
    w = torch.nn.Parameter(torch.ones(2, 2))
    fired = []
    w.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    w.grad = torch.ones(2, 2)
    wgrad.accumulate(w, torch.full((2, 2), 2.0))
    assert torch.equal(w.grad, torch.full((2, 2), 3.0)) and len(fired) == 1
    frozen = torch.ones(2, requires_grad=False)
    wgrad.accumulate(frozen, torch.ones(2))  # nothing to do
    assert frozen.grad is None


def test_wgrad_misuse_is_refused():
    with pytest.raises(RuntimeError, match="outside wgrad.defer"):
        wgrad.push(lambda: None)
    with wgrad.defer() as pending, pytest.raises(RuntimeError, match="already deferring"):
        with wgrad.defer():
            pass
    pending.run()
    with pytest.raises(RuntimeError, match="computed already"):
        pending.run()
    with memory.measure(), pytest.raises(RuntimeError, match="already measuring"):
        with memory.measure():
            pass


# ---- errors ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: schedule_order("zb-h1", 2, 0, 4, vpp=2), "schedule 'zb-h1' runs one model chunk per rank, got vpp=2"),
        (lambda: schedule_order("zb-v", 2, 0, 4, vpp=1), "schedule 'zb-v' runs two model chunks per rank"),
        (lambda: schedule_order("zb-v", 1, 0, 4), r"needs pipeline parallelism \(pp_size > 1"),
        (lambda: schedule_order("1f1b", 2, 0, 4, placement="v"), "runs on the 'interleaved' placement"),
        (lambda: schedule_order("forward_only", 2, 0, 4, placement="w"), "placement must be one of"),
        (lambda: simulate("zb-h1", 2, 4, t_weight=2.0), r"t_weight .* must be in \(0, t_backward=2\)"),
        (lambda: simulate("zb-v", 2, 4, t_weight=0), "t_weight"),
    ],
)
def test_errors_name_the_argument_and_the_rule(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---- the executor, for real ------------------------------------------------------------------------------------

CHECKS = Checks()
L, H, ROWS = 8, 6, 3
SHAPE, DTYPE = (ROWS, H), torch.float64


class _Linear(torch.autograd.Function):
    """``x Wᵀ`` whose weight gradient a B pass defers; logs ("W", chunk, microbatch) when W computes it."""

    @staticmethod
    def forward(ctx, x, w, log, tag):
        ctx.save_for_backward(x)
        ctx.w, ctx.log, ctx.tag = w, log, tag
        return x @ w.t()

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        w, log, tag = ctx.w, ctx.log, ctx.tag
        dx = dy @ w
        if wgrad.deferring():

            def compute():
                if ("W",) + tag not in log:
                    log.append(("W",) + tag)
                wgrad.accumulate(w, dy.t() @ x)

            wgrad.push(compute, (x, dy))
            return dx, None, None, None
        return dx, dy.t() @ x, None, None


class _Chunk(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(w.detach().clone()) for w, _ in layers])
        self.biases = torch.nn.ParameterList([torch.nn.Parameter(b.detach().clone()) for _, b in layers])

    def forward(self, x, log=None, tag=None):
        for w, b in zip(self.weights, self.biases):
            x = torch.tanh(_Linear.apply(x, w, log if log is not None else [], tag or (0, 0)) + b)
        return x


def _toy():
    g = torch.Generator().manual_seed(1234)
    return [
        (torch.randn(H, H, generator=g, dtype=DTYPE) / H**0.5, torch.randn(H, generator=g, dtype=DTYPE) * 0.1)
        for _ in range(L)
    ]


def _data(m):
    return [torch.randn(*SHAPE, generator=torch.Generator().manual_seed(100 + j), dtype=DTYPE) for j in range(m)]


def _reference(m):
    model = _Chunk(_toy())
    losses = [model(x).pow(2).mean() / m for x in _data(m)]
    torch.stack(losses).sum().backward()
    return [loss.detach() for loss in losses], model


def _run(schedule: str, m: int, stats: dict, ddp: bool):
    from megakernels.parallel.ddp import DistributedDataParallel
    from megakernels.parallel.pipeline import forward_backward

    p, r = mp.pp_size(), mp.pp_rank()
    placement, v = _placement(schedule), schedules.default_vpp(schedule)
    per, toy, data = L // (p * v), _toy(), _data(m)
    stages = {c: virtual_stage(placement, p, r, c, v) for c in range(v)}
    chunks = {c: _Chunk(toy[k * per : (k + 1) * per]) for c, k in stages.items()}
    wrappers = (
        {c: DistributedDataParallel(chunk, bucket_size=H * H + H, grad_dtype=None) for c, chunk in chunks.items()}
        if ddp
        else {}
    )
    log = []

    def forward_step(chunk, mb, x):
        log.append(("F", chunk, mb))
        y = chunks[chunk](data[mb] if x is None else x, log, (chunk, mb))
        return y.pow(2).mean() / m if stages[chunk] == p * v - 1 else y

    with mp.record_events() as events:
        losses = forward_backward(
            forward_step,
            m,
            schedule=schedule,
            tensor_shape=SHAPE,
            dtype=DTYPE,
            device="cpu",
            num_chunks=v,
            grad_sync=lambda c, on: (log.append(("sync", c, on)), wrappers and wrappers[c].set_grad_sync(on)),
            stats=stats,
        )
    for w in wrappers.values():
        w.finish_grad_sync()
    return losses, chunks, stages, per, log, [d for kind, d in events if kind == "p2p"]


def _check(schedule: str, m: int, ddp: bool = False) -> dict:
    p, r = mp.pp_size(), mp.pp_rank()
    stats = {}
    losses, chunks, stages, per, log, exchanges = _run(schedule, m, stats, ddp)
    ref_losses, ref = _reference(m)
    what = f"{schedule} pp={p} m={m} rank={r}"
    holds_last = (p * len(chunks) - 1) in stages.values()
    assert len(losses) == (m if holds_last else 0), what
    for got, want in zip(losses, ref_losses):
        assert_close(got, want, f"{what}: loss", rtol=1e-12)
    for c, chunk in chunks.items():
        for i, (w, b) in enumerate(zip(chunk.weights, chunk.biases)):
            k = stages[c] * per + i
            for got, want in ((w, ref.weights[k]), (b, ref.biases[k])):
                grad = got.main_grad if ddp else got.grad
                assert_close(grad, want.grad, f"{what}: layer {k} grad", rtol=1e-10)
    # Executed order (W as its closures ran), exchanges, grad_sync switched on at each chunk's last B and last W.
    v = len(chunks)
    order = schedule_order(schedule, p, r, m)
    executed = [e for e in log if e[0] in "FW" or e[0] == "B"]
    assert [e for e in executed if e[0] != "B"] == [op for op in order if op[0] != "B"], f"{what}: {log}"
    planned = [
        "+".join(f for f in ("send_next", "send_prev", "recv_prev", "recv_next") if getattr(s, f) is not None)
        for s in communication_plan(schedule, p, r, m)
        if isinstance(s, Exchange)
    ]
    assert exchanges == planned, what
    for c in range(v):
        switches = _sync_points(order, c)
        assert [e[2] for e in log if e[:2] == ("sync", c)] == [False] + [on for _, on in switches], what
        ops = [(i, op[0]) for i, op in enumerate(order) if op[1] == c and op[0] in "BW"]
        on = {i: max([(j, s) for j, s in switches if j <= i], default=(-1, False))[1] for i, _ in ops}
        last = {kind: max(i for i, k in ops if k == kind) for kind in "BW"}
        assert on[last["B"]] and on[last["W"]], f"{what}: {switches}"
        # sync is off for every other W after the last B (a parameter's earlier contributions arrive with it off)
        assert not any(on[i] for i, k in ops if k == "W" and last["B"] < i < last["W"]), f"{what}: {switches}"
    sim = simulate(schedule, p, m)
    assert stats["peak_live_microbatches"] == sim["peak_in_flight"][r], f"{what}: {stats}"
    assert stats["peak_activation_bytes"] > 0
    return stats


def _sync_points(order, c):
    """(position, on) where the executor switches grad_sync of chunk c (its documented rule)."""
    ops = [(i, op) for i, op in enumerate(order) if op[1] == c and op[0] in "BW"]
    last = {kind: max(i for i, op in ops if op[0] == kind) for kind in "BW"}
    on, out = False, []
    for i, _ in ops:
        want = i in last.values()
        if want != on:
            out.append((i, want))
            on = want
    return out


MEASURED: dict = {}


@CHECKS.add("zb_pp2_dp2_with_the_data_parallel_wrapper")
def _(rank, world):
    mp.initialize(1, 2)
    for m in (1, 2, 4, 9):
        _check("zb-h1", m, ddp=True)
    mp.destroy()
    mp.initialize(1, 2, placement="v")
    for m in (1, 2, 4, 9):
        _check("zb-v", m, ddp=True)


@CHECKS.add("zb_pp4_and_the_memory_each_schedule_holds")
def _(rank, world):
    from megakernels.parallel.pipeline import forward_backward

    mp.initialize(1, 4)
    out = {name: _check(name, 8) for name in ("zb-h1",)}
    for name in ("1f1b", "gpipe"):
        stats = {}
        toy, data, r = _toy(), _data(8), mp.pp_rank()
        chunk = _Chunk(toy[2 * r : 2 * r + 2])
        forward_backward(
            lambda c, j, x: (lambda y: y.pow(2).mean() if r == 3 else y)(chunk(data[j] if x is None else x)),
            8,
            schedule=name,
            tensor_shape=SHAPE,
            dtype=DTYPE,
            device="cpu",
            stats=stats,
        )
        out[name] = stats
    mp.destroy()
    mp.initialize(1, 4, placement="v")
    out["zb-v"] = _check("zb-v", 8)
    # The worst rank of each schedule: the zero-bubble ones hold 1F1B's first-stage peak of micro-batches (pp)
    # on every rank, a deferred one keeping its layers' inputs and output gradients until W (the toy's B frees
    # its tanh outputs but W holds as many new gradients); GPipe all 8.
    worst = {}
    for name in ("1f1b", "zb-h1", "zb-v", "gpipe"):
        t = torch.tensor([float(out[name]["peak_activation_bytes"])])
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        worst[name] = float(t)
    assert worst["gpipe"] > 1.5 * worst["1f1b"], worst
    assert worst["1f1b"] <= worst["zb-h1"] <= 1.5 * worst["1f1b"], worst
    assert worst["zb-v"] <= 1.5 * worst["1f1b"], worst
    print(f"rank {rank}: toy pp 4, m 8: peak activation bytes of the worst rank {worst}", flush=True)


@CHECKS.add("zb_v_refuses_the_interleaved_placement")
def _(rank, world):
    from megakernels.parallel.pipeline import forward_backward

    mp.initialize(1, 2, vpp=2)
    with pytest.raises(ValueError, match="initialised with placement='interleaved'"):
        forward_backward(None, 4, schedule="zb-v", num_chunks=2, tensor_shape=SHAPE, dtype=DTYPE, device="cpu")


def _world(rank, world_size):
    torch.set_num_threads(1)
    return CHECKS.run(rank, world_size)


world = CHECKS.fixture(4, _world)


@pytest.mark.parametrize("name", CHECKS.names())
def test_pipeline(world, name):
    CHECKS.assert_passed(world, name)


def test_zb_h1_on_one_stage_without_process_group():
    from megakernels.parallel.pipeline import forward_backward

    m, model, data, log = 3, _Chunk(_toy()), _data(3), []
    losses = forward_backward(
        lambda c, j, x: model(data[j], log, (c, j)).pow(2).mean() / m,
        m,
        schedule="zb-h1",
        tensor_shape=SHAPE,
        dtype=DTYPE,
        device="cpu",
    )
    ref_losses, ref = _reference(m)
    assert [e for e in log if e[0] == "W"] == [("W", 0, j) for j in range(m)]
    for got, want in zip(losses, ref_losses):
        assert_close(got, want, "loss", rtol=1e-12)
    for got, want in zip(model.weights, ref.weights):
        assert_close(got.grad, want.grad, "weight grad", rtol=1e-10)
    with pytest.raises(ValueError, match="num_chunks=2 needs megakernels.parallel initialised"):
        forward_backward(None, 2, schedule="zb-v", num_chunks=2, tensor_shape=SHAPE, dtype=DTYPE, device="cpu")
