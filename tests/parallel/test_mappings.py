"""Forward and backward of the f/g mappings and their sequence-parallel siblings, against sums and concatenations
of every TP rank's tensors written out by hand; tp 1, 2 and 4 in one world of 4 gloo processes."""

from __future__ import annotations

import pytest
import torch

import megakernels.parallel as mp
from megakernels.parallel import comm
from tests.parallel.checks import Checks, assert_close, block, randn

CHECKS = Checks()
SHAPE = (8, 3, 12)  # [s, b, h]: s and h divisible by 4
TPS = (1, 2, 4)


def _per_rank(tp: int, seed: int, shape=SHAPE) -> list[torch.Tensor]:
    """What each TP rank of the group holds: a different tensor per TP rank, the same across DP replicas."""
    return [randn(*shape, seed=seed + r) for r in range(tp)]


def _run(fn, x: torch.Tensor, dy_shape_of=None, seed: int = 0):
    """fn(x) and d(sum(fn(x) * dy))/dx for this TP rank's dy (different per TP rank)."""
    x = x.clone().requires_grad_(True)
    y = fn(x)
    dy = randn(*y.shape, seed=seed + mp.tp_rank())
    y.backward(dy)
    return y.detach(), x.grad, dy


def _each_tp(check):
    def run(rank, world):
        for tp in TPS:
            mp.initialize(tp)
            try:
                check(tp, mp.tp_rank())
            finally:
                mp.destroy()

    return run


@CHECKS.add("copy_to_tp_region_is_identity_forward_and_all_reduce_backward")
@_each_tp
def _(tp, r):
    x = randn(*SHAPE, seed=1)
    y, dx, _ = _run(mp.copy_to_tensor_model_parallel_region, x, seed=10)
    assert torch.equal(y, x)
    assert_close(dx, sum(randn(*SHAPE, seed=10 + i) for i in range(tp)), f"tp{tp} f backward")


@CHECKS.add("reduce_from_tp_region_is_all_reduce_forward_and_identity_backward")
@_each_tp
def _(tp, r):
    xs = _per_rank(tp, 20)
    y, dx, dy = _run(mp.reduce_from_tensor_model_parallel_region, xs[r], seed=30)
    assert_close(y, sum(xs), f"tp{tp} g forward")
    assert torch.equal(dx, dy)
    assert torch.equal(xs[r], randn(*SHAPE, seed=20 + r))  # the input is not reduced in place


@CHECKS.add("scatter_and_gather_along_the_hidden_dim")
@_each_tp
def _(tp, r):
    x = randn(*SHAPE, seed=2)
    y, dx, _ = _run(mp.scatter_to_tensor_model_parallel_region, x, seed=40)
    assert torch.equal(y, block(x, -1, r, tp))
    # Each rank's gradient block lands in its place; the result is the same on every rank.
    assert_close(dx, torch.cat([randn(8, 3, 12 // tp, seed=40 + i) for i in range(tp)], -1), f"tp{tp} scatter bwd")
    xs = _per_rank(tp, 50, (8, 3, 5))
    y, dx, dy = _run(mp.gather_from_tensor_model_parallel_region, xs[r], seed=60)
    assert torch.equal(y, torch.cat(xs, -1))
    assert torch.equal(dx, block(dy, -1, r, tp))


@CHECKS.add("scatter_to_sequence_parallel_region")
@_each_tp
def _(tp, r):
    x = randn(*SHAPE, seed=3)
    y, dx, _ = _run(mp.scatter_to_sequence_parallel_region, x, seed=70)
    assert torch.equal(y, block(x, 0, r, tp))
    assert_close(dx, torch.cat([randn(8 // tp, 3, 12, seed=70 + i) for i in range(tp)], 0), f"tp{tp} bwd")


@CHECKS.add("gather_from_sequence_parallel_region_reduce_scatters_or_splits_the_gradient")
@_each_tp
def _(tp, r):
    xs = _per_rank(tp, 80, (2, 3, 12))
    y, dx, _ = _run(mp.gather_from_sequence_parallel_region, xs[r], seed=90)
    assert torch.equal(y, torch.cat(xs, 0))
    full = sum(randn(2 * tp, 3, 12, seed=90 + i) for i in range(tp))
    assert_close(dx, block(full, 0, r, tp), f"tp{tp} gather-seq backward (reduce-scatter)")
    y, dx, dy = _run(
        lambda t: mp.gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=False), xs[r], seed=95
    )
    assert torch.equal(dx, block(dy, 0, r, tp))


@CHECKS.add("reduce_scatter_to_sequence_parallel_region")
@_each_tp
def _(tp, r):
    xs = _per_rank(tp, 100)
    y, dx, _ = _run(mp.reduce_scatter_to_sequence_parallel_region, xs[r], seed=110)
    assert_close(y, block(sum(xs), 0, r, tp), f"tp{tp} reduce-scatter forward")
    assert_close(dx, torch.cat([randn(8 // tp, 3, 12, seed=110 + i) for i in range(tp)], 0), f"tp{tp} backward")


@CHECKS.add("one_rank_groups_are_the_identity_without_communication")
def _(rank, world):
    mp.initialize(1)
    x = randn(*SHAPE, seed=4)
    with comm.record_events() as events:
        for fn in (
            mp.copy_to_tensor_model_parallel_region,
            mp.reduce_from_tensor_model_parallel_region,
            mp.scatter_to_tensor_model_parallel_region,
            mp.gather_from_tensor_model_parallel_region,
            mp.scatter_to_sequence_parallel_region,
            mp.gather_from_sequence_parallel_region,
            mp.reduce_scatter_to_sequence_parallel_region,
        ):
            assert fn(x) is x
    assert events == []


@CHECKS.add("all_gather_and_reduce_scatter_along_a_middle_dim")
@_each_tp
def _(tp, r):
    xs = _per_rank(tp, 120, (2, 3, 4))
    assert torch.equal(comm.all_gather(xs[r], 1, mp.tp_group()), torch.cat(xs, 1))
    ys = _per_rank(tp, 130, (2, 4, 3))
    assert_close(comm.reduce_scatter(ys[r], 1, mp.tp_group()), block(sum(ys), 1, r, tp), "reduce-scatter dim 1")
    pending = comm.all_gather(xs[r], -1, mp.tp_group(), async_op=True)
    assert torch.equal(pending.wait(), torch.cat(xs, -1))


@CHECKS.add("shapes_that_do_not_split_are_rejected")
def _(rank, world):
    mp.initialize(4)
    with pytest.raises(ValueError, match="x has 6 elements along dim 2, not divisible by the tensor-parallel size 4"):
        mp.scatter_to_tensor_model_parallel_region(torch.zeros(8, 2, 6))
    with pytest.raises(ValueError, match="x has 6 elements along dim 0"):
        mp.scatter_to_sequence_parallel_region(torch.zeros(6, 2, 8))
    with pytest.raises(ValueError, match="reduce_scatter_to_sequence_parallel_region: x has 2 elements along dim 0"):
        mp.reduce_scatter_to_sequence_parallel_region(torch.zeros(2, 2, 8))
    with pytest.raises(ValueError, match="scalar"):
        mp.scatter_to_sequence_parallel_region(torch.zeros(()))


def _world(rank, world_size):
    return CHECKS.run(rank, world_size)


world = CHECKS.fixture(4, _world)


@pytest.mark.parametrize("name", CHECKS.names())
def test_mapping(world, name):
    CHECKS.assert_passed(world, name)
