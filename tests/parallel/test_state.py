"""megakernels.parallel.initialize: group layout (tp innermost, then dp, then pp), accessors, pipeline helpers and
configuration errors, in one world of 8 gloo processes."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import megakernels.parallel as mp
from megakernels.parallel import state
from tests.parallel.checks import Checks
from tests.parallel.harness import run_world

CHECKS = Checks()


def _ranks(group) -> list[int]:
    return sorted(dist.get_process_group_ranks(group))


def _mine(table: list[list[int]], rank: int) -> list[int]:
    (group,) = [g for g in table if rank in g]
    return group


def _check_layout(rank, tp, pp, tp_groups, dp_groups, pp_groups, emb_groups):
    mp.initialize(tp, pp)
    assert (mp.tp_size(), mp.pp_size(), mp.dp_size()) == (tp, pp, 8 // (tp * pp))
    assert _ranks(mp.tp_group()) == _mine(tp_groups, rank)
    assert _ranks(mp.dp_group()) == _mine(dp_groups, rank)
    assert _ranks(mp.pp_group()) == _mine(pp_groups, rank)
    in_emb = [g for g in emb_groups if rank in g]
    if in_emb:
        assert _ranks(mp.embedding_group()) == in_emb[0] and mp.embedding_ranks() == in_emb[0]
    else:
        assert mp.embedding_group() is None and mp.embedding_ranks() == []
    assert mp.tp_rank() == _mine(tp_groups, rank).index(rank)
    assert mp.dp_rank() == _mine(dp_groups, rank).index(rank)
    assert mp.pp_rank() == _mine(pp_groups, rank).index(rank)
    assert mp.pp_ranks() == _mine(pp_groups, rank)
    # The groups communicate among exactly those ranks.
    for group, table in ((mp.tp_group(), tp_groups), (mp.dp_group(), dp_groups), (mp.pp_group(), pp_groups)):
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=group)
        assert x.item() == sum(_mine(table, rank))
    mp_ranks = sorted(set(_mine(tp_groups, rank)) | {r for t in _mine(pp_groups, rank) for r in _mine(tp_groups, t)})
    assert _ranks(mp.model_parallel_group()) == mp_ranks


@CHECKS.add("layout_tp2_pp2_dp2")
def _(rank, world):
    _check_layout(
        rank,
        2,
        2,
        tp_groups=[[0, 1], [2, 3], [4, 5], [6, 7]],
        dp_groups=[[0, 2], [1, 3], [4, 6], [5, 7]],
        pp_groups=[[0, 4], [1, 5], [2, 6], [3, 7]],
        emb_groups=[[0, 4], [1, 5], [2, 6], [3, 7]],
    )


@CHECKS.add("layout_tp2_cp2_dp2_puts_cp_between_tp_and_dp")
def _(rank, world):
    mp.initialize(2, 1, cp=2)
    assert (mp.tp_size(), mp.cp_size(), mp.dp_size(), mp.dp_cp_size()) == (2, 2, 2, 4)
    assert _ranks(mp.tp_group()) == _mine([[0, 1], [2, 3], [4, 5], [6, 7]], rank)
    assert _ranks(mp.cp_group()) == _mine([[0, 2], [1, 3], [4, 6], [5, 7]], rank)
    assert _ranks(mp.dp_group()) == _mine([[0, 4], [1, 5], [2, 6], [3, 7]], rank)
    assert _ranks(mp.dp_cp_group()) == _mine([[0, 2, 4, 6], [1, 3, 5, 7]], rank)
    assert (mp.tp_rank(), mp.cp_rank(), mp.dp_rank()) == (rank % 2, (rank // 2) % 2, rank // 4)
    mp.destroy()
    mp.initialize(4)
    assert _ranks(mp.tp_replica_group(2)) == _mine([[0, 1], [2, 3], [4, 5], [6, 7]], rank)
    assert mp.tp_replica_group(2) is mp.tp_replica_group(2)  # created once, by initialize
    assert mp.tp_replica_group(4) is mp.tp_group() and mp.tp_replica_group(1) is None
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, group=mp.tp_replica_group(2))
    assert x.item() == sum(_mine([[0, 1], [2, 3], [4, 5], [6, 7]], rank))
    with pytest.raises(ValueError, match="replicas=3 does not divide the tensor-parallel size 4"):
        mp.tp_replica_group(3)


@CHECKS.add("expert_groups_are_carved_out_of_the_data_parallel_ranks")
def _(rank, world):
    mp.initialize(2, 1, ep=2)  # dp 4: expert groups of 2 consecutive data-parallel ranks
    assert (mp.ep_size(), mp.ep_rank()) == (2, (rank // 2) % 2)
    assert _ranks(mp.ep_group()) == _mine([[0, 2], [1, 3], [4, 6], [5, 7]], rank)
    assert _ranks(mp.expert_dp_group()) == _mine([[0, 4], [1, 5], [2, 6], [3, 7]], rank)
    mp.destroy()
    mp.initialize(1, 1, cp=2, ep=2)  # dp 4 × cp 2: the expert-data group spans cp too
    assert _ranks(mp.ep_group()) == _mine([[0, 2], [1, 3], [4, 6], [5, 7]], rank)
    assert _ranks(mp.expert_dp_group()) == _mine([[0, 1, 4, 5], [2, 3, 6, 7]], rank)
    mp.destroy()
    mp.initialize(2)
    assert mp.ep_group() is None and mp.ep_size() == 1
    assert mp.expert_dp_group() is mp.dp_cp_group()
    mp.destroy()
    with pytest.raises(ValueError, match="initialize: ep 3 does not divide the data-parallel size 4"):
        mp.initialize(2, ep=3)


@CHECKS.add("layout_tp2_pp4_dp1")
def _(rank, world):
    _check_layout(
        rank,
        2,
        4,
        tp_groups=[[0, 1], [2, 3], [4, 5], [6, 7]],
        dp_groups=[[r] for r in range(8)],
        pp_groups=[[0, 2, 4, 6], [1, 3, 5, 7]],
        emb_groups=[[0, 6], [1, 7]],
    )
    stage = rank // 2
    assert mp.pp_next_rank() == (rank + 2) % 8 and mp.pp_prev_rank() == (rank - 2) % 8
    assert mp.is_pp_first_stage() == (stage == 0) and mp.is_pp_last_stage() == (stage == 3)
    assert mp.is_in_embedding_group() == (stage in (0, 3))
    assert mp.embedding_ranks() == ([] if stage in (1, 2) else [0, 6] if rank % 2 == 0 else [1, 7])


@CHECKS.add("layout_dp8_is_the_default_dp")
def _(rank, world):
    _check_layout(
        rank,
        1,
        1,
        tp_groups=[[r] for r in range(8)],
        dp_groups=[list(range(8))],
        pp_groups=[[r] for r in range(8)],
        emb_groups=[[r] for r in range(8)],
    )
    assert mp.is_pp_first_stage() and mp.is_pp_last_stage() and mp.vpp_size() is None


@CHECKS.add("layout_tp8")
def _(rank, world):
    _check_layout(
        rank,
        8,
        1,
        tp_groups=[list(range(8))],
        dp_groups=[[r] for r in range(8)],
        pp_groups=[[r] for r in range(8)],
        emb_groups=[[r] for r in range(8)],
    )


@CHECKS.add("explicit_dp_must_match_world")
def _(rank, world):
    mp.initialize(2, 2, dp=2)
    assert mp.dp_size() == 2
    mp.destroy()
    with pytest.raises(ValueError, match=r"initialize: dp 1 does not match world size / \(tp × pp\) = 8 / 4 = 2"):
        mp.initialize(2, 2, dp=1)
    assert not mp.is_initialized()


@CHECKS.add("virtual_pipeline_stages")
def _(rank, world):
    mp.initialize(1, 4, vpp=2)
    stage = rank // 2
    assert mp.vpp_size() == 2 and mp.vpp_rank() == 0
    assert mp.is_pp_first_stage() == (stage == 0)
    assert not mp.is_pp_last_stage()  # chunk 0 is never the model's last chunk
    assert mp.is_pp_last_stage(ignore_virtual=True) == (stage == 3)
    mp.set_vpp_rank(1)
    assert not mp.is_pp_first_stage() and mp.is_pp_first_stage(ignore_virtual=True) == (stage == 0)
    assert mp.is_pp_last_stage() == (stage == 3)
    with pytest.raises(ValueError, match="set_vpp_rank: rank must be in 0..1"):
        mp.set_vpp_rank(2)


@CHECKS.add("world_not_divisible_by_tp_pp")
def _(rank, world):
    with pytest.raises(ValueError, match=r"the world size 8 \(.*\) is not divisible by tp × pp = 3 × 1 = 3"):
        mp.initialize(3, 1)
    with pytest.raises(ValueError, match=r"the world size 8 \(.*\) is not divisible by tp × pp = 2 × 3 = 6"):
        mp.initialize(2, 3)
    assert not mp.is_initialized()


@CHECKS.add("bad_sizes")
def _(rank, world):
    with pytest.raises(ValueError, match="tp must be a positive int, got 0"):
        mp.initialize(0, 1)
    with pytest.raises(ValueError, match="pp must be a positive int"):
        mp.initialize(1, 1.5)
    with pytest.raises(ValueError, match=r"vpp 2 needs pipeline parallelism \(pp > 1\)"):
        mp.initialize(2, 1, vpp=2)


@CHECKS.add("initialize_twice")
def _(rank, world):
    mp.initialize(2, 1)
    with pytest.raises(RuntimeError, match=r"already initialised \(tp=2, pp=1, dp=4\)"):
        mp.initialize(2, 1)
    mp.destroy()
    mp.initialize(4, 2)  # after destroy() a new layout is fine
    assert mp.tp_size() == 4


@CHECKS.add("tp_larger_than_heads_or_not_dividing")
def _(rank, world):
    mp.initialize(8, 1)
    with pytest.raises(ValueError, match="num_heads=4 is smaller than the tensor-parallel size 8"):
        mp.check_divisible(num_heads=4)
    with pytest.raises(ValueError, match="num_heads=12 is not divisible by the tensor-parallel size 8"):
        mp.check_divisible(num_heads=12, ffn_hidden_size=64)
    mp.check_divisible(num_heads=16, ffn_hidden_size=64)
    with pytest.raises(ValueError, match="num_heads=4 is smaller than the tensor-parallel size 8"):
        mp.ParallelSelfAttention(64, num_heads=4)
    with pytest.raises(ValueError, match="out_features=12 is not divisible"):
        mp.ColumnParallelLinear(16, 12)
    with pytest.raises(ValueError, match="in_features=20 is not divisible"):
        mp.RowParallelLinear(20, 16)
    with pytest.raises(ValueError, match="ffn_hidden_size=36 is not divisible"):
        mp.ParallelMLP(16, 36)


@contextlib.contextmanager
def _new_group_calls(fail: bool = False):
    """The ranks of every ``dist.new_group`` call made inside; with ``fail``, each call raises instead."""
    calls, original = [], dist.new_group

    def new_group(ranks=None, *args, **kwargs):
        if fail:
            raise AssertionError(f"a process group {ranks} was created after initialize")
        calls.append(sorted(ranks))
        return original(ranks, *args, **kwargs)

    dist.new_group = new_group
    try:
        yield calls
    finally:
        dist.new_group = original


@CHECKS.add("initialize_creates_every_group")
def _(rank, world):
    with _new_group_calls() as calls:
        mp.initialize(4, 2)  # tp 4 (replica groups of 2 and 4), pp 2, dp 1
    tp = [rank - rank % 4 + i for i in range(4)]
    pipe = [rank % 4, rank % 4 + 4]
    everyone = list(range(8))
    # tp, dp, cp, pp, model-parallel, embedding, replicas of 2, checkpoint (tp itself serves replicas of 4)
    expected = [tp, [rank], [rank], pipe, everyone, pipe, [rank - rank % 2, rank - rank % 2 + 1], everyone]
    assert sorted(_ranks(g) for g in state._get().groups) == sorted(expected)
    assert [c for c in calls if rank in c] == expected
    # A family of groups that splits the world is made by its members only (torch's local synchronisation); the
    # embedding groups (none for middle stages; here every rank is on an end stage) by every rank.
    assert len(calls) == (7 + 4 if state._LOCAL_SYNC else 2 + 8 + 8 + 4 + 1 + 4 + 4 + 1)
    assert _ranks(mp.checkpoint_group()) == everyone and dist.get_backend(mp.checkpoint_group()) == "gloo"
    for group in (mp.tp_replica_group(2), mp.checkpoint_group()):
        x = torch.tensor([1.0])
        dist.all_reduce(x, group=group)
        assert x.item() == dist.get_world_size(group)


def _build_gqa(tp: int, kv_heads: int):
    """The stages of a tiny grouped-query-attention Llama at tp, pp 2, as the trainer builds them."""
    from megakernels_models.models.config import ModelConfig
    from megakernels_models.models.llama.model import LlamaModel

    cfg = ModelConfig(
        "llama",
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=kv_heads,
        seq_length=16,
        vocab_size=256,
        ffn_hidden_size=48,
    )
    stage = mp.pp_rank()
    return LlamaModel(cfg, seed=3, layers=range(stage, stage + 1), pre_process=stage == 0, post_process=stage == 1)


@CHECKS.add("no_group_is_created_after_initialize")
def _(rank, world):
    for tp, kv_heads in ((2, 1), (4, 1), (4, 2)):  # key/value heads replicated on 2, 4 and 2 ranks
        mp.initialize(tp, 2)
        replicas = tp // kv_heads
        with _new_group_calls(fail=True):
            _build_gqa(tp, kv_heads)
            x = torch.tensor([1.0])
            dist.all_reduce(x, group=mp.tp_replica_group(replicas))
        assert x.item() == replicas
        mp.destroy()


@CHECKS.add("destroy_waits_for_every_rank_unless_an_error_propagates")
def _(rank, world):
    mp.initialize(2)
    if rank == 0:  # its peers are not in destroy(): a barrier would wait for them until the timeout
        with pytest.raises(RuntimeError, match="deliberate"):
            try:
                raise RuntimeError("deliberate")
            finally:
                mp.destroy()
    else:
        mp.destroy(barrier=False)
    dist.barrier()
    mp.initialize(2)
    mp.destroy()  # the barrier: every rank is here


def _world(rank, world_size):
    return CHECKS.run(rank, world_size)


world = CHECKS.fixture(8, _world)


@pytest.mark.parametrize("name", CHECKS.names())
def test_initialize(world, name):
    CHECKS.assert_passed(world, name)


def _from_torchrun_env(rank, world_size):
    assert not dist.is_initialized()
    mp.initialize(2, 1)
    assert dist.is_initialized() and dist.get_backend() == "gloo"
    out = (mp.tp_size(), mp.tp_rank(), mp.dp_size())
    mp.destroy()
    assert not dist.is_initialized()  # initialize created the default group, so destroy tears it down
    return out


def test_initialize_sets_up_torch_distributed_from_torchrun_environment():
    assert run_world(2, _from_torchrun_env, init="env", timeout=60) == [(2, 0, 1), (2, 1, 1)]


def test_initialize_without_process_group_or_environment(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match="missing RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        mp.initialize(1, 1)
    assert not mp.is_initialized()


def test_accessors_before_initialize():
    with pytest.raises(RuntimeError, match=r"call megakernels.parallel.initialize\(tp, pp\)"):
        mp.tp_group()
    with pytest.raises(RuntimeError, match="not initialised"):
        mp.ColumnParallelLinear(4, 4)


def test_groups_wait_as_long_as_the_world_unless_told_otherwise():
    """initialize without a timeout gives its groups the default process group's, not torch's 30 minutes (a stall
    in a test's world then raises within the world's timeout)."""
    from megakernels.parallel import state
    from megakernels.parallel.launch import single_process_world

    with single_process_world(timeout=17.0):
        state.initialize(1, 1)
        try:
            assert state.group_timeout() == 17.0
        finally:
            state.destroy()
        state.initialize(1, 1, timeout=5.0)
        try:
            assert state.group_timeout() == 5.0
        finally:
            state.destroy()
