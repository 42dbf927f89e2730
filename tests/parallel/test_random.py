"""The TP-aware RNG tracker: dropout inside ``fork()`` differs across TP ranks and agrees across DP replicas; outside
it agrees everywhere; forking never moves the default stream. One world of 4 gloo processes (tp 2 × dp 2)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import megakernels.parallel as mp
from tests.parallel.checks import Checks

CHECKS = Checks()
N = 256


def _everyone(t: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return parts


def _mask() -> torch.Tensor:
    return F.dropout(torch.ones(N), p=0.5, training=True)


@CHECKS.add("dropout_outside_tp_regions_is_identical_on_every_rank")
def _(rank, world):
    mp.initialize(2)
    mp.model_parallel_seed(42)
    masks = _everyone(_mask())
    assert all(torch.equal(m, masks[0]) for m in masks)
    assert 0 < (masks[0] == 0).sum() < N


@CHECKS.add("dropout_inside_tp_regions_differs_per_tp_rank_and_agrees_across_dp")
def _(rank, world):
    mp.initialize(2)  # tp groups [0, 1], [2, 3]; rank 2 is rank 0's data-parallel replica
    mp.model_parallel_seed(42)
    with mp.get_rng_tracker().fork():
        masks = _everyone(_mask())
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[2], masks[3])
    assert torch.equal(masks[0], masks[2]) and torch.equal(masks[1], masks[3])


@CHECKS.add("the_tp_stream_is_seed_plus_2718_plus_tp_rank_and_continues_across_forks")
def _(rank, world):
    mp.initialize(2)
    mp.model_parallel_seed(42)
    tracker = mp.get_rng_tracker()
    with tracker.fork():
        first = torch.rand(8)
    with tracker.fork():
        second = torch.rand(8)
    g = torch.Generator().manual_seed(42 + 2718 + mp.tp_rank())
    assert torch.equal(first, torch.rand(8, generator=g)) and torch.equal(second, torch.rand(8, generator=g))


@CHECKS.add("fork_leaves_the_default_stream_where_it_was")
def _(rank, world):
    mp.initialize(2)
    mp.model_parallel_seed(5)
    expected = torch.rand(8)
    mp.model_parallel_seed(5)
    with mp.get_rng_tracker().fork():
        torch.rand(100)
    assert torch.equal(torch.rand(8), expected)
    mp.model_parallel_seed(5)
    with pytest.raises(RuntimeError, match="inside"):
        with mp.get_rng_tracker().fork():
            torch.rand(3)
            raise RuntimeError("inside")
    assert torch.equal(torch.rand(8), expected)  # restored on an exception too


@CHECKS.add("states_round_trip_for_checkpoints")
def _(rank, world):
    mp.initialize(2)
    mp.model_parallel_seed(9)
    tracker = mp.get_rng_tracker()
    saved = tracker.get_states()
    with tracker.fork():
        a = torch.rand(4)
    tracker.set_states(saved)
    with tracker.fork():
        assert torch.equal(torch.rand(4), a)


@CHECKS.add("tracker_errors")
def _(rank, world):
    mp.initialize(2)
    tracker = mp.RNGStatesTracker("cpu")
    with pytest.raises(KeyError, match="no stream 'model-parallel-rng'; call model_parallel_seed"):
        with tracker.fork():
            pass
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="stream 'a' already exists"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="seed 1 is already used"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        mp.RNGStatesTracker("tpu")
    with pytest.raises(ValueError, match="seed must be an int >= 0, got -1"):
        mp.model_parallel_seed(-1)


def _world(rank, world_size):
    return CHECKS.run(rank, world_size)


world = CHECKS.fixture(4, _world)


@pytest.mark.parametrize("name", CHECKS.names())
def test_rng(world, name):
    CHECKS.assert_passed(world, name)
