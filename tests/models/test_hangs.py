"""Hangs and orphans, from outside, the way an operator meets them: a rank that stops responding (SIGSTOP: how a GPU
or NCCL hang looks from outside) ends the whole job within twice ``--timeout``, the message naming the rank that
stopped and where each rank was; killing only the launcher (SIGKILL) leaves no rank training on without it.

The runs are real ``megakernels train`` processes held at a sync point (``megakernels_models.training.syncpoints``)
while the test stops or kills; every wait is for an event or a process's exit, with a deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.models.preemption_harness import TINY_FLAGS, Run, SyncDir

TIMEOUT_S = 10  # --timeout: room for a loaded machine's startup, which the watchdog also times
FLAGS = TINY_FLAGS + ["--steps", "100000", "--timeout", str(TIMEOUT_S)]


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie that nobody reaped counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_gone(pids, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while not all(_gone(p) for p in pids):
        assert time.monotonic() < end, f"still running {deadline_s:g} s on: {[p for p in pids if not _gone(p)]}"
        time.sleep(0.02)


def _end(pids) -> None:
    """Whatever a failed test left: continue and kill it."""
    for pid in pids:
        if not _gone(pid):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)


def _stop_rank_1_and_wait_for_the_exit(proc: subprocess.Popen, sync: SyncDir) -> tuple[list[int], str]:
    """Stop rank 1 while both ranks are held after step 2, let rank 0 go on, and wait for the job's exit for twice
    the job's own --timeout (the watchdog's bound; a later exit fails as TimeoutExpired): the ranks' pids and the
    job's stderr."""
    pids = sync.wait_for("step-2", [0, 1])
    os.kill(pids[1], signal.SIGSTOP)
    sync.release("step-2")
    _, err = proc.communicate(timeout=2 * TIMEOUT_S)
    return pids, err


def test_a_stopped_rank_ends_the_spawned_job_within_twice_the_timeout_and_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAKERNELS_START_METHOD", "spawn")  # the ranks: the launcher's children
    run = Run(FLAGS + ["--nproc", "2"], str(tmp_path / "sync"), holds=("step-2",))
    pids = []
    try:
        pids, err = _stop_rank_1_and_wait_for_the_exit(run.proc, run.sync)
        assert run.proc.returncode == 1, err[-3000:]
        assert "a rank failed" in err and f"rank 1 (pid {pids[1]}) stopped responding" in err, err[-3000:]
        assert "last in phase 'held at step-2' (step 2)" in err, err[-3000:]
        _wait_gone(pids, 5.0)  # reaped by the launcher before it exited
    finally:
        _end(pids)
        if run.proc.poll() is None:
            run.kill()


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_the_ranks_die_with_their_launcher_killed_by_sigkill(tmp_path, monkeypatch, start_method):
    """Rank 1 is stopped too: its own threads cannot act, the kernel's parent-death signal still ends it (with the
    fork server, whose ranks are not the launcher's children, through the server's exit)."""
    monkeypatch.setenv("MEGAKERNELS_START_METHOD", start_method)
    run = Run(FLAGS + ["--nproc", "2"], str(tmp_path / "sync"), holds=("step-2",))
    pids = []
    try:
        pids = run.sync.wait_for("step-2", [0, 1])
        os.kill(pids[1], signal.SIGSTOP)
        run.proc.kill()  # SIGKILL: nothing of the launcher runs any more
        run.proc.wait()
        _wait_gone(pids, 10.0)
    finally:
        _end(pids)
        run.kill()  # reads the pipes to their end: after the ranks, which write to them too, are gone


def test_a_stopped_rank_ends_a_torchrun_job_within_twice_the_timeout(tmp_path):
    sync = SyncDir(str(tmp_path / "sync"))
    sync.hold("step-2")
    env = dict(os.environ, OMP_NUM_THREADS="1", MEGAKERNELS_SYNC_DIR=sync.path)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "0",
            "-m",
            "megakernels_models.cli",
            "train",
            *FLAGS,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )

    def alive(name: str) -> None:  # a job that ended before the sync point fails the wait at once, with its stderr
        if proc.poll() is not None:
            raise AssertionError(
                f"the torchrun job ended (status {proc.returncode}) before {name}:\n{proc.stderr.read()[-3000:]}"
            )

    sync.alive = alive
    pids = []
    try:
        pids, err = _stop_rank_1_and_wait_for_the_exit(proc, sync)
        assert proc.returncode != 0, err[-3000:]
        # rank 0 names the rank that stopped and ends it (torchrun's agent would give it 30 s to act on SIGTERM)
        assert f"rank 1 (pid {pids[1]}) stopped responding" in err and "ended unresponsive rank 1" in err, err[-3000:]
        _wait_gone(pids, 5.0)
    finally:
        _end(pids)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
