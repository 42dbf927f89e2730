"""The column-parallel layer's backward overlaps its collectives with the GEMMs, proven by the order of events
(never by timing): the input-gradient all-reduce (reduce-scatter under sequence parallelism) is launched before the
weight-gradient GEMM starts and waited for after it ends; under sequence parallelism the input's re-gather is
launched before the dgrad GEMM and waited for after it. With overlap off each collective is waited for at once, and
the gradients are bitwise the same. In FP8 (megakernels.parallel.fp8) the same overlap holds, the sequence-parallel
all-gather moves FP8 bytes (half of bf16's, plus the 1×128 tiles' scales: counted), the column/row pair equals
ops.fp8_linear on the full weights (its tiles straddling the shards here), and every tensorwise scale is the
unsharded tensor's on every TP rank. One world of 4 gloo processes, tp 2 and 4."""

from __future__ import annotations

import contextlib

import pytest
import torch

import megakernels.parallel as mp
from tests.parallel.checks import Checks, randn

CHECKS = Checks()
S, B, IN, OUT = 8, 2, 16, 32

ORDER = {
    # (sequence_parallel, overlap_comm): backward events
    (False, True): [
        ("start", "dgrad"),
        ("end", "dgrad"),
        ("launch", "all_reduce"),
        ("start", "wgrad"),
        ("end", "wgrad"),
        ("wait", "all_reduce"),
    ],
    (False, False): [
        ("start", "dgrad"),
        ("end", "dgrad"),
        ("launch", "all_reduce"),
        ("wait", "all_reduce"),
        ("start", "wgrad"),
        ("end", "wgrad"),
    ],
    (True, True): [
        ("launch", "all_gather"),
        ("start", "dgrad"),
        ("end", "dgrad"),
        ("wait", "all_gather"),
        ("launch", "reduce_scatter"),
        ("start", "wgrad"),
        ("end", "wgrad"),
        ("wait", "reduce_scatter"),
    ],
    (True, False): [
        ("launch", "all_gather"),
        ("wait", "all_gather"),
        ("start", "dgrad"),
        ("end", "dgrad"),
        ("launch", "reduce_scatter"),
        ("wait", "reduce_scatter"),
        ("start", "wgrad"),
        ("end", "wgrad"),
    ],
}


def _backward(sp: bool, overlap: bool):
    tp, r = mp.tp_size(), mp.tp_rank()
    torch.manual_seed(3)
    layer = mp.ColumnParallelLinear(IN, OUT, sequence_parallel=sp, overlap_comm=overlap)
    x = randn(S, B, IN, seed=4)
    x = (x.chunk(tp, 0)[r] if sp else x).requires_grad_(True)
    with mp.record_events() as forward:
        y = layer(x)
    dy = randn(*y.shape, seed=5 + r)
    with mp.record_events() as backward:
        y.backward(dy)
    return forward, backward, (x.grad, layer.weight.grad, layer.bias.grad)


for _tp in (2, 4):
    for _key in ORDER:

        def _check(rank, world, tp=_tp, key=_key):
            mp.initialize(tp)
            forward, backward, _ = _backward(*key)
            assert backward == ORDER[key], backward
            expected_forward = [("launch", "all_gather"), ("wait", "all_gather")] if key[0] else []
            assert forward == expected_forward, forward

        CHECKS.add(f"backward_order_tp{_tp}_sp={_key[0]}_overlap={_key[1]}")(_check)


@CHECKS.add("overlap_does_not_change_the_gradients")
def _(rank, world):
    for tp in (2, 4):
        for sp in (False, True):
            mp.initialize(tp)
            _, _, on = _backward(sp, True)
            _, _, off = _backward(sp, False)
            assert all(torch.equal(a, b) for a, b in zip(on, off)), f"tp{tp} sp={sp}"
            mp.destroy()


@CHECKS.add("frozen_weight_skips_the_wgrad_gemm_and_frozen_input_the_dgrad")
def _(rank, world):
    mp.initialize(2)
    layer = mp.ColumnParallelLinear(IN, OUT)
    layer.weight.requires_grad_(False)
    x = randn(S, B, IN, seed=6).requires_grad_(True)
    with mp.record_events() as events:
        layer(x).sum().backward()
    assert ("start", "wgrad") not in events and ("start", "dgrad") in events
    layer.weight.requires_grad_(True)
    with mp.record_events() as events:
        layer(randn(S, B, IN, seed=6)).sum().backward()
    assert events == [("start", "wgrad"), ("end", "wgrad")]  # no input gradient: nothing to all-reduce


def _fp8_events(recipe: str, dtype=torch.bfloat16):
    from megakernels.parallel import comm, fp8

    tp, r = mp.tp_size(), mp.tp_rank()
    layer = mp.ColumnParallelLinear(IN, OUT, sequence_parallel=True, bias=False).to(dtype)
    if recipe:
        fp8.enable(layer, recipe)
    x = randn(S, B, IN, seed=4).to(dtype).chunk(tp, 0)[r].requires_grad_(True)
    with comm.count_bytes() as fwd_bytes, mp.record_events() as forward:
        y = layer(x)
    with mp.record_events() as backward:
        y.backward(randn(*y.shape, seed=5 + r).to(dtype))
    return fwd_bytes, forward, backward


def _before(events, a, b) -> bool:
    return events.index(a) < events.index(b)


@CHECKS.add("fp8_sequence_parallel_all_gather_moves_fp8_and_backward_overlaps")
def _(rank, world):
    mp.initialize(2)
    tokens = S // 2 * B  # this rank's sequence shard
    bf16, _, _ = _fp8_events("")
    assert bf16["all_gather"] == tokens * IN * 2, bf16
    for recipe in ("tensorwise", "blockwise"):
        got, forward, backward = _fp8_events(recipe)
        scales = 0 if recipe == "tensorwise" else tokens * -(-IN // 128) * 4  # fp32 scale per 1×128 tile
        assert got["all_gather"] == tokens * IN + scales, (recipe, got)
        # tensorwise: the shard's amax and the weight's, reduced over TP (MAX) before quantising; blockwise: the
        # amax of the one 128×128 block the two weight shards of 16 rows share
        assert got["all_reduce"] == (8 if recipe == "tensorwise" else 4), (recipe, got)
        # backward: the input's re-gather in flight during the dgrad GEMM, the reduce-scatter during the wgrad
        assert _before(backward, ("launch", "all_gather"), ("start", "dgrad"))
        assert _before(backward, ("end", "dgrad"), ("wait", "all_gather"))
        assert _before(backward, ("launch", "reduce_scatter"), ("start", "wgrad"))
        assert _before(backward, ("end", "wgrad"), ("wait", "reduce_scatter"))


@CHECKS.add("fp8_column_row_pair_equals_fp8_linear_on_the_full_weights")
def _(rank, world):
    from megakernels.ops import fp8 as ops
    from megakernels.parallel import fp8

    for tp in (2, 4):
        mp.initialize(tp)
        for recipe in ("tensorwise", "blockwise"):
            torch.manual_seed(3)
            col, row = mp.ColumnParallelLinear(IN, OUT, bias=False), mp.RowParallelLinear(OUT, IN, bias=False)
            fp8.enable(col, recipe), fp8.enable(row, recipe)
            w1, w2 = randn(OUT, IN, seed=8) / 4, randn(IN, OUT, seed=9) / 4
            with torch.no_grad():
                col.weight.copy_(w1.chunk(tp, 0)[mp.tp_rank()])
                row.weight.copy_(w2.chunk(tp, 1)[mp.tp_rank()])
            x = randn(S * B, IN, seed=10, scale=3.0)
            dy = randn(S * B, IN, seed=11)
            xa = x.clone().requires_grad_(True)
            row(col(xa)).backward(dy)
            xr, r1, r2 = (
                x.clone().requires_grad_(True),
                w1.clone().requires_grad_(True),
                w2.clone().requires_grad_(True),
            )
            ops.fp8_linear(ops.fp8_linear(xr, r1, recipe=recipe), r2, recipe=recipe).backward(dy)
            close = dict(rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(xa.grad, xr.grad, **close)
            torch.testing.assert_close(col.weight.grad, r1.grad.chunk(tp, 0)[mp.tp_rank()], **close)
            torch.testing.assert_close(row.weight.grad, r2.grad.chunk(tp, 1)[mp.tp_rank()], **close)
        mp.destroy()


@contextlib.contextmanager
def _recording(taken):
    from megakernels.parallel import fp8

    real = fp8.quantize

    def recorded(x, fmt, granularity, **kw):
        q = real(x, fmt, granularity, **kw)
        if granularity == "tensor":
            taken.append((fmt, float(q.scale)))
        return q

    fp8.quantize = recorded
    try:
        yield
    finally:
        fp8.quantize = real


def _tensorwise_scales(tp: int, sequence_parallel: bool) -> list[tuple[str, float]]:
    """A column -> row FP8 pair (tensorwise) forward and backward at ``tp``: every tensorwise scale taken, in
    order, with its format. The weights, input and output gradient are the same full tensors at every tp, each
    rank holding its shard; under sequence parallelism the input and output gradient are sequence shards."""
    from megakernels.parallel import fp8

    r = mp.tp_rank()
    col = mp.ColumnParallelLinear(IN, OUT, bias=False, sequence_parallel=sequence_parallel)
    row = mp.RowParallelLinear(OUT, IN, bias=False, sequence_parallel=sequence_parallel)
    fp8.enable(col, "tensorwise"), fp8.enable(row, "tensorwise")
    with torch.no_grad():
        col.weight.copy_(randn(OUT, IN, seed=20, scale=0.3).chunk(tp, 0)[r])
        row.weight.copy_(randn(IN, OUT, seed=21, scale=2.0).chunk(tp, 1)[r])
    x, dy = randn(S, B, IN, seed=22, scale=3.0), randn(S, B, IN, seed=23, scale=1e-3)
    if sequence_parallel:
        x, dy = x.chunk(tp, 0)[r], dy.chunk(tp, 0)[r]
    taken = []
    with _recording(taken):
        row(col(x.requires_grad_(True))).backward(dy)
    return taken


@CHECKS.add("fp8_tensorwise_scales_are_the_full_tensors_on_every_tensor_parallel_rank")
def _(rank, world):
    """One scale a tensor (as Transformer Engine's and torchao's tensorwise recipes): at tp 2, with and without
    sequence parallelism, each of the six scales (forward: the column layer's input and weight, the row layer's
    input and weight; backward: the row and column layers' output gradients) is the same on every TP rank and is
    the scale of the unsharded tensor, the tp 1 layers' (whose first, the input's, is checked by hand)."""
    import torch.distributed as dist

    from megakernels.ops import fp8 as ops

    mp.initialize(1)
    full = _tensorwise_scales(1, False)
    x = randn(S, B, IN, seed=22, scale=3.0)
    assert full[0] == ("e4m3", float(ops.pow2_scale(x.abs().max(), "e4m3")))
    assert [f for f, _ in full] == ["e4m3"] * 4 + ["e5m2"] * 2, full
    mp.destroy()
    mp.initialize(2)
    for sp in (False, True):
        mine = _tensorwise_scales(2, sp)
        everyone = [None] * mp.tp_size()
        dist.all_gather_object(everyone, mine, group=mp.tp_group())
        assert all(theirs == mine for theirs in everyone), (sp, everyone)
        assert mine == full, (sp, mine, full)


def _world(rank, world_size):
    return CHECKS.run(rank, world_size)


world = CHECKS.fixture(4, _world)


@pytest.mark.parametrize("name", CHECKS.names())
def test_overlap(world, name):
    CHECKS.assert_passed(world, name)
