"""Elastic restarts under torchrun: when a node is lost, the surviving torchrun agent restarts its workers at the
smaller world, and the trainer resumes from the latest checkpoint there — tp/pp from the command line, dp from the
new world, the global batch and the sample order unchanged, the micro-batches per step recomputed. The loss curve
is the uninterrupted run's within fp32 reduction-order tolerance (the data-parallel sums are added in another
order at another dp).

Two torchrun agents on this machine are the two "nodes" of one job (c10d rendezvous, one worker each). The
rendezvous store is hosted by the test (``is_host=false`` for both agents), so losing either agent never loses
the store. The node that will be lost starts first and needs both nodes (``--nnodes 2``), so it cannot form a
world alone; the survivor (``--nnodes 1:2``) joins once the first has joined — the first round therefore always
has both, and the survivor's later round may have one. The run is held at a sync point (``megakernels_models.
syncpoints``) while the test kills the lost node's agent and worker (its worker runs in a session of its own, so
both are killed by process id), never after a sleep."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from megakernels_models.arguments import ArgumentError, TrainArgs, validate
from tests.models.preemption_harness import TINY_FLAGS, SyncDir, run_to_end

RUN_ID = "elastic-test"
DEADLINE_S = 240.0  # two agents and their workers starting on a machine other tests share
# Fast failure detection and rendezvous: heartbeats every second, a node dead after five missed ones (slack for a
# loaded machine), a rendezvous with fewer than the maximum nodes closing one second after the minimum joined.
RDZV_CONF = "is_host=false,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5,join_timeout=120"


def _agent(nnodes: str, port: int, flags: list[str], env: dict, out, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            nnodes,
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            RUN_ID,
            "--rdzv-conf",
            RDZV_CONF,
            "--max-restarts",
            "1",
            "-m",
            "megakernels_models.cli",
            "train",
            *flags,
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        **popen,
    )


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _runs(path) -> list[list[dict]]:
    """The step records of a JSONL log, one list per launch (each launch starts with its ``config`` header)."""
    runs = []
    with open(path) as f:
        for rec in map(json.loads, f):
            if "config" in rec:
                runs.append([])
            else:
                runs[-1].append(rec)
    return runs


def _close(procs) -> None:
    """End the agents still running: SIGTERM first, which a torchrun agent passes on to its workers."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_a_lost_node_restarts_the_job_at_the_smaller_world_from_the_checkpoint(tmp_path):
    flags = TINY_FLAGS + ["--dropout", "0", "--steps", "6", "--timeout", "60"]
    reference = str(tmp_path / "reference.jsonl")
    run_to_end(flags + ["--log-jsonl", reference])  # uninterrupted, one process

    ckpt, log = str(tmp_path / "ckpt"), str(tmp_path / "log.jsonl")
    flags += ["--save", ckpt, "--load", ckpt, "--save-interval", "2", "--log-jsonl", log]
    sync = SyncDir(str(tmp_path / "sync"))
    sync.hold("step-3")  # both ranks finished step 3; the checkpoint of step 2 is complete
    env = dict(os.environ, OMP_NUM_THREADS="1", MEGAKERNELS_SYNC_DIR=sync.path)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(k, None)
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=DEADLINE_S)
    )
    procs = []
    with open(tmp_path / "lost.out", "w") as lost_out, open(tmp_path / "survivor.out", "w") as survivor_out:
        try:
            lost = _agent("2", store.port, flags, env, lost_out, start_new_session=True)
            procs.append(lost)
            deadline = time.monotonic() + DEADLINE_S
            # The rendezvous state appears in the store when the first node joins (torch's c10d rendezvous
            # backend keeps it under this key).
            while not store.check([f"torch.rendezvous.{RUN_ID}"]):
                assert lost.poll() is None, (tmp_path / "lost.out").read_text()
                assert time.monotonic() < deadline, "the first agent did not join the rendezvous"
                time.sleep(0.01)
            survivor = _agent("1:2", store.port, flags, env, survivor_out)
            procs.append(survivor)

            def alive(name):
                for p, out in ((lost, "lost.out"), (survivor, "survivor.out")):
                    assert p.poll() is None, f"an agent ended before {name}:\n{(tmp_path / out).read_text()}"

            sync.alive = alive
            workers = sync.wait_for("step-3", [0, 1], timeout=DEADLINE_S)
            victims = [w for w in workers if _parent(w) == lost.pid]
            assert len(victims) == 1, (workers, lost.pid)
            os.kill(lost.pid, signal.SIGKILL)  # the node is lost: its agent and its worker
            os.kill(victims[0], signal.SIGKILL)
            lost.wait()
            sync.release("step-3")
            survivor.wait(timeout=DEADLINE_S)
        finally:
            _close(procs)
            del store
    out = (tmp_path / "survivor.out").read_text()
    assert survivor.returncode == 0, out[-4000:]
    assert "torchrun restart 1: world size 1, dp 1, 2 micro-batches per step (global batch 4)" in out, out[-4000:]
    assert f"resumed from {os.path.join(ckpt, 'step-00000002')} (step 2)" in out

    first, second = _runs(log)  # the logging rank of the first attempt may have been on either node
    assert [r["step"] for r in first] == [1, 2] and [r["step"] for r in second] == [3, 4, 5, 6]
    assert first[0]["layout"] == {
        "world_size": 2,
        "tp": 1,
        "cp": 1,
        "pp": 1,
        "dp": 2,
        "num_microbatches": 1,
        "restart": 0,
    }
    assert second[0]["layout"] == {
        "world_size": 1,
        "tp": 1,
        "cp": 1,
        "pp": 1,
        "dp": 1,
        "num_microbatches": 2,
        "restart": 1,
    }
    expected = [r["loss"] for r in _runs(reference)[0]]
    got = [r["loss"] for r in first + second]
    assert len(got) == len(expected) == 6
    for step, (g, e) in enumerate(zip(got, expected), 1):
        assert abs(g - e) <= 1e-5 * abs(e), (step, got, expected)


def test_a_restart_at_a_world_the_global_batch_does_not_divide_is_refused_naming_the_restart(monkeypatch):
    """What every worker checks before training: the new world gives dp = 3, and 4 samples do not split into
    micro-batches of 2 on 3 data-parallel ranks."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    args = TrainArgs(preset="gpt-tiny", micro_batch_size=2, global_batch_size=4)
    with pytest.raises(ArgumentError) as e:
        validate(args)
    message = str(e.value)
    assert message == (
        "--global-batch-size 4 is not divisible by --micro-batch-size × dp = 2 × 3 = 6 (dp = world "
        "size 3 from torchrun's WORLD_SIZE after elastic restart 1 / tp × pp 1)"
    )
