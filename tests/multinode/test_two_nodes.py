"""Two nodes on one machine, as separate network hosts (``cluster.Cluster``): one torchrun agent per node, c10d
rendezvous on node 0's name, two ranks per node, gloo between them over the veth link.

- tp 2 inside each node × dp 2 across the nodes, and pp 2 across the nodes (dp 2 inside each), give the single
  process's loss curve of the same seed (fp32, dropout 0: equal to 1e-5 relative, as tests/models/test_layouts.py);
- a checkpoint saved by the two-node job resumes on one node at another layout, and one saved on one node resumes
  on two nodes, each continuing that curve;
- a --tp whose groups would span the nodes is refused on every rank with a message naming the flag, and runs (and
  matches) with --tp-across-nodes;
- a node lost mid-run (every process of it SIGKILLed; "cut": first taken off the network, so that no connection of
  it is closed or reset, as when a machine loses power): with ``--nnodes 1:2 --max-restarts 1`` the surviving node
  names the lost node, restarts at the smaller world from the last complete checkpoint (resharded from dp 2 to dp
  1) and the loss curve continues where it left off; without elastic settings every process exits within the
  collective timeout, the survivor naming the lost node — also when the lost node is node 0, which hosts the
  rendezvous. No process is left on either node.

The run is held at a sync point (``megakernels_models.training.syncpoints``) while a node is killed; every wait is
on a condition with a deadline."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from tests.models.preemption_harness import SyncDir
from tests.multinode.cluster import Cluster
from tests.multinode.common import DEADLINE_S, FLAGS, compare, env, layouts, record, steps, train, wait_until

TIMEOUT_S = 20  # --timeout of the node-loss runs: the collective timeout and the watchdog's
# Heartbeats every second and a node dead after five missed ones; a rendezvous that has its minimum of nodes closes
# 10 s later (time for the second agent to join the first round, which the test checks it did).
RDZV_CONF = "last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=5,join_timeout=120"
_port = iter(range(29400, 29500))


def _torchrun(nnodes: str, endpoint: str, flags: list[str], max_restarts: int = 0) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        "multinode-check",
        "--rdzv-conf",
        RDZV_CONF,
        "--max-restarts",
        str(max_restarts),
        "-m",
        "megakernels_models.cli",
        "train",
        *flags,
    ]


def _wait(procs, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        p.wait(timeout=max(0.1, deadline - time.monotonic()))


def _no_process_left(cluster: Cluster) -> None:
    """Every process of both nodes has exited (the agents' workers included): nothing is orphaned."""
    wait_until(
        lambda: not any(cluster.pids(i) for i in range(2)),
        30,
        lambda: f"end of the processes left on the nodes: { {i: cluster.pids(i) for i in range(2)} }",
    )


@pytest.fixture(scope="module")
def cluster():
    with Cluster() as c:
        yield c


@pytest.fixture(autouse=True)
def _fresh_nodes(cluster):
    """Every check starts with both nodes on the network and no process on them, and leaves them so."""
    assert not cluster.pids(0) and not cluster.pids(1)
    yield
    for i in range(2):
        cluster.kill_all(i)  # nothing, if the check passed (it asserts that no process is left)
        cluster.reconnect(i)


def _two_nodes(cluster: Cluster, flags: list[str], tmp_path, name: str) -> list[str]:
    """Run ``flags`` on both nodes (2 ranks each) to the end; their outputs (each asserted to exit 0)."""
    endpoint = f"{cluster.host(0)}:{next(_port)}"
    outs = [tmp_path / f"{name}-node{i}.out" for i in range(2)]
    files = [open(o, "w") for o in outs]  # noqa: SIM115 - closed below
    try:
        procs = [
            cluster.start(i, _torchrun("2", endpoint, flags), stdout=files[i], stderr=subprocess.STDOUT, env=env())
            for i in range(2)
        ]
        _wait(procs, DEADLINE_S)
    finally:
        for f in files:
            f.close()
    texts = [o.read_text() for o in outs]
    for i, (p, text) in enumerate(zip(procs, texts)):
        assert p.returncode == 0, f"node {i} exited with {p.returncode}:\n{text[-6000:]}"
    _no_process_left(cluster)
    return texts


@pytest.mark.parametrize(
    "layout,expected",
    [
        (["--tp", "2"], {"tp": 2, "pp": 1, "dp": 2}),  # tp inside each node, dp across the nodes
        (["--pp", "2"], {"tp": 1, "pp": 2, "dp": 2}),  # stage 0 on one node, stage 1 on the other
    ],
    ids=["tp2-in-node-x-dp2-across", "pp2-across"],
)
def test_two_nodes_give_the_single_process_losses(cluster, reference, tmp_path, layout, expected):
    log = tmp_path / "log.jsonl"
    start = time.monotonic()
    _two_nodes(cluster, FLAGS + layout + ["--log-jsonl", str(log)], tmp_path, "run")
    wall = time.monotonic() - start
    first = layouts(log)[0]
    assert {k: first[k] for k in expected} == expected and first["world_size"] == 4, first
    worst = compare(steps(log), reference, range(1, 7))
    record(f"two nodes {' '.join(layout)}", max_loss_rel_diff_fraction=worst, wall_s=wall)


def test_a_checkpoint_moves_between_two_nodes_and_one(cluster, reference, tmp_path):
    """Saved by the two-node job (pp 2 across the nodes) after step 3, resumed on one node at tp 2 (two spawned
    ranks); saved on one node (pp 2, spawned) after step 3, resumed by the two-node job at tp 2 × dp 2."""
    worst = 0.0
    # two nodes -> one node
    ckpt, log = tmp_path / "ckpt-a", tmp_path / "a.jsonl"
    saving = ["--save", str(ckpt), "--load", str(ckpt), "--log-jsonl", str(log)]
    _two_nodes(cluster, FLAGS + ["--pp", "2", "--exit-interval", "3", *saving], tmp_path, "two-to-one")
    r = train(FLAGS + ["--nproc", "2", "--tp", "2", *saving])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "done: 3 steps" in r.stdout, r.stdout  # steps 4-6
    assert [(x["world_size"], x["tp"], x["pp"]) for x in layouts(log)] == [(4, 1, 2), (2, 2, 1)]
    worst = max(worst, compare(steps(log), reference, range(1, 7)))

    # one node -> two nodes
    ckpt, log = tmp_path / "ckpt-b", tmp_path / "b.jsonl"
    saving = ["--save", str(ckpt), "--load", str(ckpt), "--log-jsonl", str(log)]
    r = train(FLAGS + ["--nproc", "2", "--pp", "2", "--exit-interval", "3", *saving])
    assert r.returncode == 0, r.stdout + r.stderr
    texts = _two_nodes(cluster, FLAGS + ["--tp", "2", *saving], tmp_path, "one-to-two")
    assert any("done: 3 steps" in t for t in texts), texts
    assert [(x["world_size"], x["tp"], x["pp"]) for x in layouts(log)] == [(2, 1, 2), (4, 2, 1)]
    worst = max(worst, compare(steps(log), reference, range(1, 7)))
    record("checkpoint two nodes <-> one node", max_loss_rel_diff_fraction=worst)


def test_tp_across_nodes_is_refused_unless_asked(cluster, reference, tmp_path):
    endpoint = f"{cluster.host(0)}:{next(_port)}"
    procs = [
        cluster.start(
            i,
            _torchrun("2", endpoint, FLAGS + ["--tp", "4"]),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env(),
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=DEADLINE_S)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode != 0, out
        assert "--tp 4 puts tensor-parallel groups across nodes: torchrun runs 2 ranks on this node" in out, out
        assert "or pass --tp-across-nodes to run it anyway" in out
    _no_process_left(cluster)

    log = tmp_path / "log.jsonl"
    _two_nodes(cluster, FLAGS + ["--tp", "4", "--tp-across-nodes", "--log-jsonl", str(log)], tmp_path, "asked")
    assert layouts(log)[0]["tp"] == 4
    worst = compare(steps(log), reference, range(1, 7))
    record("two nodes --tp 4 --tp-across-nodes", max_loss_rel_diff_fraction=worst)


def _poll_for(path, pattern: str, proc, deadline: float) -> float | None:
    """Wait until ``pattern`` (a regex) appears in the file ``path`` or ``proc`` exits; when it appeared (monotonic
    time) or None."""
    rx = re.compile(pattern)
    try:
        return wait_until(
            lambda: rx.search(path.read_text(errors="replace")) is not None,
            max(0.0, deadline - time.monotonic()),
            pattern,
            0.05,
            give_up=lambda: proc.poll() is not None,
        )
    except TimeoutError:
        return None


def _lose_node(cluster: Cluster, how: str, sync: SyncDir, node: int = 1) -> tuple[float, list[int]]:
    """With every rank held at step 3: lose ``node`` (``cut``: off the network first), then let the run go on."""
    if how == "cut":
        cluster.cut(node)
    killed = cluster.kill_all(node)
    lost_at = time.monotonic()
    sync.release("step-3")
    return lost_at, killed


@pytest.mark.parametrize("how", ["killed", "cut"])
def test_a_lost_node_with_elastic_settings_continues_on_the_survivor(cluster, reference, tmp_path, how):
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    flags = FLAGS + ["--tp", "2", "--timeout", str(TIMEOUT_S), "--save", str(ckpt), "--load", str(ckpt)]
    flags += ["--save-interval", "2", "--log-jsonl", str(log)]
    sync = SyncDir(str(tmp_path / "sync"))
    sync.hold("step-3")  # every rank finished step 3; the checkpoint of step 2 is complete
    run_env = env(MEGAKERNELS_SYNC_DIR=sync.path)
    endpoint = f"{cluster.host(0)}:{next(_port)}"
    outs = [tmp_path / f"node{i}.out" for i in range(2)]
    files = [open(o, "w") for o in outs]  # noqa: SIM115 - closed below
    try:
        # The node to lose needs both nodes, so it cannot close the first round alone; it starts first and joins
        # as soon as node 0's agent hosts the rendezvous. The survivor may go on alone (1:2).
        lost = cluster.start(
            1, _torchrun("2", endpoint, flags, 1), stdout=files[1], stderr=subprocess.STDOUT, env=run_env
        )
        survivor = cluster.start(
            0, _torchrun("1:2", endpoint, flags, 1), stdout=files[0], stderr=subprocess.STDOUT, env=run_env
        )

        def alive(name):
            for p, out in ((lost, outs[1]), (survivor, outs[0])):
                assert p.poll() is None, f"an agent ended before {name}:\n{out.read_text()[-6000:]}"

        sync.alive = alive
        sync.wait_for("step-3", range(4), timeout=DEADLINE_S)
        lost_at, killed = _lose_node(cluster, how, sync)
        assert lost.pid in killed
        deadline = lost_at + DEADLINE_S
        named = _poll_for(outs[0], r"node \d \(host mk-node1, ranks \d-\d\) is lost", survivor, deadline)
        restarted = _poll_for(outs[0], r"torchrun restart 1: world size 2", survivor, deadline)
        survivor.wait(timeout=max(1.0, deadline - time.monotonic()))
        finished = time.monotonic()
    finally:
        for f in files:
            f.close()
    out = outs[0].read_text()
    assert survivor.returncode == 0, out[-6000:]
    assert named is not None, out[-6000:]
    assert "torchrun restart 1: world size 2, dp 1, 4 micro-batches per step (global batch 8)" in out, out[-6000:]
    assert f"resumed from {os.path.join(str(ckpt), 'step-00000002')} (step 2)" in out, out[-6000:]
    launches = layouts(log)
    assert launches[0]["world_size"] == 4, f"the first round did not have both nodes: {launches}"
    assert launches[-1] == {"world_size": 2, "tp": 2, "cp": 1, "pp": 1, "dp": 1, "num_microbatches": 4, "restart": 1}
    worst = compare(steps(log), reference, range(1, 7))
    _no_process_left(cluster)
    record(
        f"elastic node loss ({how})",
        max_loss_rel_diff_fraction=worst,
        lost_node_named_after_s=named - lost_at,
        restarted_after_s=restarted - lost_at,
        finished_after_s=finished - lost_at,
    )


@pytest.mark.parametrize(
    "how,lost_node",
    [("killed", 1), ("cut", 1), ("killed", 0)],
    ids=["killed", "cut", "rendezvous-host-killed"],
)
def test_a_lost_node_without_elastic_settings_ends_the_job(cluster, tmp_path, how, lost_node):
    """Node 1, or node 0, which hosts the rendezvous (its store goes with it: the survivor's agent cannot even
    report to it), is lost; the other node's every process ends, its ranks naming the lost node."""
    flags = FLAGS + ["--tp", "2", "--timeout", str(TIMEOUT_S)]
    sync = SyncDir(str(tmp_path / "sync"))
    sync.hold("step-3")
    run_env = env(MEGAKERNELS_SYNC_DIR=sync.path)
    endpoint = f"{cluster.host(0)}:{next(_port)}"
    outs = [tmp_path / f"node{i}.out" for i in range(2)]
    with open(outs[0], "w") as f0, open(outs[1], "w") as f1:
        agents = [
            cluster.start(i, _torchrun("2", endpoint, flags), stdout=f, stderr=subprocess.STDOUT, env=run_env)
            for i, f in enumerate((f0, f1))
        ]
        survivor, lost = agents[1 - lost_node], agents[lost_node]

        def alive(name):
            for p, path in zip(agents, outs):
                assert p.poll() is None, f"an agent ended before {name}:\n{path.read_text()[-6000:]}"

        sync.alive = alive
        sync.wait_for("step-3", range(4), timeout=DEADLINE_S)
        lost_at, killed = _lose_node(cluster, how, sync, lost_node)
        assert lost.pid in killed
        survivor.wait(timeout=DEADLINE_S)
        ended = time.monotonic() - lost_at
    text = outs[1 - lost_node].read_text()
    assert survivor.returncode != 0, text[-6000:]
    # the survivor names the lost node: the rank that fails first does (in its watchdog's line, or in a line of
    # its own when a collective raised), its local peer too unless torchrun's agent ended it first
    host = cluster.host(lost_node)
    named = rf"megakernels train: rank \d: [^\n]*node \d \(host {host}, ranks \d-\d\) is lost"
    assert re.search(named, text), text[-6000:]
    _no_process_left(cluster)
    # within the collective timeout (the watchdog's documented bound: about twice it), torchrun's teardown included
    assert ended <= 2 * TIMEOUT_S, (ended, text[-6000:])
    record(f"node {lost_node} lost without elastic settings ({how})", job_ended_after_s=ended)
