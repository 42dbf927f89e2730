"""The column-parallel layer's backward overlaps its collectives with the GEMMs, proven by the order of events
(never by timing): the input-gradient all-reduce (reduce-scatter under sequence parallelism) is launched before the
weight-gradient GEMM starts and waited for after it ends; under sequence parallelism the input's re-gather is
launched before the dgrad GEMM and waited for after it. With overlap off each collective is waited for at once, and
the gradients are bitwise the same. One world of 4 gloo processes, tp 2 and 4."""

from __future__ import annotations

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


def _world(rank, world_size):
    return CHECKS.run(rank, world_size)


world = CHECKS.fixture(4, _world)


@pytest.mark.parametrize("name", CHECKS.names())
def test_overlap(world, name):
    CHECKS.assert_passed(world, name)
