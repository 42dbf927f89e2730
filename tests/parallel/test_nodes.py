"""The nodes of a torchrun job (``megakernels.parallel.nodes``) on one machine: where tensor-parallel groups fall
relative to nodes (from torchrun's environment), the trainer's refusal of a --tp across nodes (naming the flag and
the way to ask for it), and how a failing rank names lost nodes — a beacon that answers, one whose process is gone
(its port refuses), and the watchdog's line carrying the report. The two-host checks (network namespaces, a node
lost for real) are tests/multinode, run by scripts/multinode_check.sh."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from megakernels.parallel import nodes, watchdog
from megakernels_models.arguments import ArgumentError, TrainArgs, validate
from tests.parallel.test_watchdog import DEADLINE_S, PRELUDE


def _env(rank, local_rank, local_world_size, node=0, nodes_=2, world=None):
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(node),
        "GROUP_WORLD_SIZE": str(nodes_),
        "WORLD_SIZE": str(world or local_world_size * nodes_),
    }


def test_outside_torchrun_there_is_no_node_rule():
    assert nodes.torchrun_env({}) is None
    assert nodes.tp_problem(16, {}) is None


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tp_dividing_the_ranks_per_node_stays_inside_a_node(tp):
    for rank in range(16):  # two nodes of 8
        assert nodes.tp_problem(tp, _env(rank, rank % 8, 8, node=rank // 8)) is None


def test_tp_larger_than_a_node_is_refused_naming_the_flag_and_the_way_out():
    message = nodes.tp_problem(4, _env(3, 1, 2, node=1))
    assert message == (
        "--tp 4 puts tensor-parallel groups across nodes: torchrun runs 2 ranks on this node (LOCAL_WORLD_SIZE; "
        "node 1 holds ranks 2-3) and its 2 ranks do not split into groups of 4 adjacent ranks, so every layer's "
        "all-reduces would cross the network; use a --tp that divides the ranks per node (1, 2), or pass "
        "--tp-across-nodes to run it anyway"
    )
    # every rank refuses, on every node: the ranks per node are the same everywhere
    assert all(nodes.tp_problem(4, _env(r, r % 2, 2, node=r // 2)) for r in range(4))


def test_tp_not_dividing_a_node_is_refused_on_every_rank():
    # 6 ranks a node, tp 4: rank 0's group fits, rank 4's spans nodes; both refuse (the rule is the node's)
    assert all(nodes.tp_problem(4, _env(r, r % 6, 6, node=r // 6)) for r in range(12))


def test_a_node_whose_ranks_start_off_a_group_boundary_is_refused_by_the_rank_whose_group_spans_it():
    # nodes of different sizes (2, then 4): the second node holds ranks 2-5; tp 4 groups are 0-3 and 4-7
    message = nodes.tp_problem(4, _env(2, 0, 4, node=1, world=6))
    assert "the group of rank 2, ranks 0-3, starts on another node" in message


def test_the_trainer_refuses_tp_across_nodes_unless_asked(monkeypatch):
    for k, v in _env(3, 1, 2, node=1).items():
        monkeypatch.setenv(k, v)
    args = TrainArgs(preset="gpt-tiny", tp=4, micro_batch_size=2, global_batch_size=4)
    with pytest.raises(ArgumentError, match=r"^--tp 4 puts tensor-parallel groups across nodes: .* --tp-across-nodes"):
        validate(args, check_memory=False)
    validate(
        TrainArgs(preset="gpt-tiny", tp=4, micro_batch_size=2, global_batch_size=4, tp_across_nodes=True),
        check_memory=False,
    )
    validate(TrainArgs(preset="gpt-tiny", tp=2, micro_batch_size=2, global_batch_size=4), check_memory=False)


def test_the_flag_parses():
    from megakernels_models.cli import parse_train_args

    assert parse_train_args(["--tp-across-nodes"]).tp_across_nodes is True
    assert parse_train_args([]).tp_across_nodes is False


def _closed_port() -> int:
    """A port nothing listens on (bound, then closed: the kernel refuses connections to it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_node_whose_beacon_answers_is_not_lost_and_one_whose_port_refuses_is():
    beacon = nodes.Beacon()
    try:
        me = nodes.Node(0, "here", 0, 2, ("127.0.0.1",), None)
        alive = nodes.Node(1, "node-b", 2, 2, ("127.0.0.1",), beacon.port)
        gone = nodes.Node(2, "node-c", 4, 2, ("127.0.0.1",), _closed_port())
        node_map = nodes.NodeMap({0: me, 1: alive, 2: gone}, me=0)
        assert [n for n, _ in node_map.lost()] == [gone]
        assert node_map.report() == (
            f"node 2 (host node-c, ranks 4-5) is lost: its beacon at 127.0.0.1:{gone.port} refused the connection "
            "(no process of the job is left there)"
        )
        # one address answering is enough
        both = nodes.Node(2, "node-c", 4, 2, ("127.0.0.1", "127.0.0.1"), beacon.port)
        assert nodes.NodeMap({0: me, 2: both}, me=0).report() == ""
    finally:
        beacon.close()
    assert nodes.NodeMap({0: me, 1: alive}, me=0).lost()[0][0] == alive  # closed beacon: refused


def test_host_addresses_leave_loopback_out_when_the_host_has_another():
    found = nodes.host_addresses("127.0.0.1")
    loopback = [a for a in found if a.startswith("127.")]
    assert found and (not loopback or loopback == list(found)), found


def test_the_watchdog_line_carries_the_lost_nodes():
    rank = subprocess.Popen(
        [
            sys.executable,
            "-c",
            PRELUDE
            + "w = wd.Watchdog(1.0, rank=0)\n"
            + "w.explain = lambda: 'node 1 (host node-b, ranks 2-3) is lost: gone'\n"
            + "w.start()\nwd.progress('step', 4)\nthreading.Event().wait()\n",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, err = rank.communicate(timeout=DEADLINE_S)
    assert rank.returncode == watchdog.EXIT_CODE, err
    assert "in phase 'step' (step 4); node 1 (host node-b, ranks 2-3) is lost: gone; ending the job" in err, err
