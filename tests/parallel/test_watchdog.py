"""The watchdog thread and the parent-death rules on their own (``megakernels.parallel.watchdog``): a rank without
progress for the timeout is ended with a line naming its rank, phase and step; one that reports progress is not;
its heartbeat record says where it is; a rank dies with its launcher whether the launcher is its parent or not, even
when the rank itself is stopped.

The rank is a small Python process that loads the watchdog module alone (no torch: it starts in milliseconds), held
on events it never gets; the test waits for its exit with a deadline, never for a window of time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from megakernels.parallel import launch, liveness, watchdog

DEADLINE_S = 30.0
# Loads the watchdog and liveness modules as `wd` and `lv` without the package, whose __init__ imports torch (1.5 s
# a process): they need only the standard library. Stubs stand for the packages they are imported through.
PRELUDE = (
    "import importlib.util, os, sys, threading, time, types\n"
    "for name in ('megakernels', 'megakernels.parallel'):\n"
    "    sys.modules[name] = types.ModuleType(name)\n"
    "def load(name, path):\n"
    "    spec = importlib.util.spec_from_file_location(name, path)\n"
    "    sys.modules[name] = module = importlib.util.module_from_spec(spec)\n"
    "    spec.loader.exec_module(module)\n"
    "    return module\n"
    f"lv = load('megakernels.parallel.liveness', {liveness.__file__!r})\n"
    f"wd = load('megakernels.parallel.watchdog', {watchdog.__file__!r})\n"
)
FOREVER = "threading.Event().wait()\n"


def _python(code: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", PRELUDE + code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
    )


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie that nobody reaped counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_gone(pid: int, deadline_s: float = DEADLINE_S) -> None:
    """Poll until ``pid`` ended, with a deadline; fails the test at the deadline."""
    t0 = time.monotonic()
    while not _gone(pid):
        assert time.monotonic() - t0 < deadline_s, f"process {pid} still running after {deadline_s:g} s"
        time.sleep(0.01)


def _kill(*pids: int) -> None:
    for pid in pids:
        if not _gone(pid):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)


def test_a_rank_without_progress_is_ended_with_its_rank_phase_and_step():
    rank = _python("w = wd.Watchdog(1.0, rank=3).start()\nwd.progress('testing', 7)\n" + FOREVER)
    _, err = rank.communicate(timeout=DEADLINE_S)
    assert rank.returncode == watchdog.EXIT_CODE, err
    assert "megakernels train: rank 3: no progress for 1." in err, err  # at least the timeout, measured by the rank
    assert "(timeout 1 s) in phase 'testing' (step 7)" in err and "ending the job" in err, err


class _Clock:
    def __init__(self):
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_a_rank_that_reports_progress_more_often_than_the_timeout_runs_on(monkeypatch):
    """The watchdog's rule on its own clock: progress every fortieth of the timeout for one and a half timeouts, a
    check after each, fires nothing; then no progress past the timeout fires once, naming the last phase and step."""
    clock, fired = _Clock(), []
    w = watchdog.Watchdog(2.0, rank=0, clock=clock)
    monkeypatch.setattr(w, "_fire", lambda age, phase, step: fired.append((age, phase, step)))
    for i in range(60):
        clock.now += 0.05
        w.progress("step", i)
        w.check()
    assert fired == []
    clock.now += 2.0
    w.check()
    assert fired == []  # exactly the timeout is not past it
    clock.now += 0.01
    w.check()
    assert fired == [(pytest.approx(2.01), "step", 59)]


def test_the_heartbeat_record_names_the_phase_at_once_and_is_removed_when_the_watchdog_stops(tmp_path):
    live = str(tmp_path / "live")
    with watchdog.Watchdog(60.0, rank=2, liveness_dir=live):
        watchdog.progress("pipeline", 5)
        rec = liveness.read(live)[2]  # written by progress itself, not at the thread's next beat
        assert (rec["pid"], rec["phase"], rec["step"]) == (os.getpid(), "pipeline", 5)
        watchdog.progress("optimizer")  # the step carries over
        assert liveness.read(live)[2]["phase"] == "optimizer" and liveness.read(live)[2]["step"] == 5
    assert liveness.read(live) == {}
    watchdog.progress("after")  # no watchdog: nothing


def test_the_summary_names_the_stale_rank_first():
    now = 1000.0
    records = {
        0: {"rank": 0, "pid": 10, "phase": "stop check", "step": 3, "since": now - 7.5, "beat": now - 0.2},
        1: {"rank": 1, "pid": 11, "phase": "pipeline", "step": 4, "since": now - 9.0, "beat": now - 9.0},
    }
    assert liveness.summary(records, now, stale=2.0) == (
        "rank 1 (pid 11) stopped responding: no heartbeat for 9.0 s, last in phase 'pipeline' (step 4); "
        "rank 0 in phase 'stop check' (step 3) for 7.5 s"
    )


def test_a_damaged_record_is_left_out(tmp_path):
    with watchdog.Watchdog(60.0, rank=0, liveness_dir=str(tmp_path)):
        with open(tmp_path / "rank-1", "wb") as f:
            f.write(b"\x01" * liveness.RECORD_BYTES)  # a wrong checksum
        assert sorted(liveness.read(str(tmp_path))) == [0]


def test_a_rank_watching_a_launcher_that_is_not_its_parent_ends_when_the_launcher_dies():
    # As a rank forked by the fork server: its parent lives on, its launcher is another process.
    launcher = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])  # lives until killed
    rank = _python(
        f"w = wd.Watchdog(600.0, rank=1, launcher={launcher.pid}).start()\nprint('watching', flush=True)\n" + FOREVER
    )
    try:
        assert rank.stdout.readline() == "watching\n"
        launcher.kill()
        launcher.wait()
        _, err = rank.communicate(timeout=DEADLINE_S)
        assert rank.returncode == watchdog.LAUNCHER_GONE_EXIT_CODE, err
        assert f"the launcher (pid {launcher.pid}) is gone" in err
    finally:
        _kill(rank.pid, launcher.pid)
        rank.communicate()
        launcher.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_stopped_rank_dies_with_its_parent_killed_by_sigkill():
    # The parent starts the rank and says its pid; the rank arms the parent-death signal and says so. The test stops
    # the rank (its own threads cannot act any more) and kills the parent: the kernel's SIGKILL still ends the rank.
    rank_code = PRELUDE + "assert wd.die_with(os.getppid())\nprint('armed', flush=True)\n" + FOREVER
    parent = _python(
        f"import subprocess\np = subprocess.Popen([sys.executable, '-c', {rank_code!r}])\n"
        "print(p.pid, flush=True)\n" + FOREVER
    )
    rank_pid = int(parent.stdout.readline())
    try:
        # the rank's "armed" goes to the parent's stdout, the same pipe
        assert parent.stdout.readline() == "armed\n"
        os.kill(rank_pid, signal.SIGSTOP)
        parent.kill()
        parent.communicate()
        _wait_gone(rank_pid)
    finally:
        _kill(rank_pid, parent.pid)
        parent.communicate()


def test_a_rank_whose_launcher_died_before_it_started_ends_at_once():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    rank = _python(f"wd.die_with({gone.pid})\nprint('still here')\n")
    out, _ = rank.communicate(timeout=DEADLINE_S)
    assert rank.returncode == watchdog.LAUNCHER_GONE_EXIT_CODE and out == ""


def test_a_timeout_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="timeout must be > 0 seconds, got 0"):
        watchdog.Watchdog(0)


def test_a_new_liveness_directory_sweeps_away_those_of_dead_launchers():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    mine = liveness.new_dir()
    left = os.path.join(os.path.dirname(mine), f"launcher-{gone.pid}-x")  # as a launcher killed by SIGKILL leaves it
    os.makedirs(left)
    try:
        other = liveness.new_dir()
        assert not os.path.exists(left) and os.path.isdir(mine)  # this process lives: its directory stays
        os.rmdir(other)
    finally:
        os.rmdir(mine)


# ---- in a spawned world (megakernels.parallel.launch.run_world with a watchdog) --------------------------------


def _stuck(rank: int, world_size: int) -> None:
    watchdog.progress("waiting", 9)
    threading.Event().wait()  # no progress, no collective: only the watchdog can end it


def _rank_1_stops(rank: int, world_size: int) -> None:
    watchdog.progress("before the barrier", 1)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # as a hung GPU looks from outside: nothing of the rank runs
    dist.barrier()  # rank 0 waits here for rank 1 (its gloo timeout is the world's 60 s)


def test_a_rank_without_progress_fails_the_world_with_its_watchdogs_line():
    with pytest.raises(
        launch.WorldFailed,
        match=r"rank 0: no progress for 2\.\d s \(timeout 2 s\) in phase "
        r"'waiting' \(step 9\)",
    ):
        launch.run_world(1, _stuck, timeout=60, world_timeout=None, watch=2.0)


def test_a_stopped_rank_is_named_by_the_launcher():
    with pytest.raises(
        launch.WorldFailed,
        match=r"rank 1 \(pid \d+\) stopped responding: no heartbeat for [\d.]+ s, "
        r"last in phase 'before the barrier' \(step 1\)",
    ):
        launch.run_world(2, _rank_1_stops, timeout=60, world_timeout=None, watch=2.0)


def _dp_all_reduce_without_rank_1(rank: int, world_size: int) -> tuple[float, str] | None:
    from megakernels.parallel import state

    state.initialize(1, 1, timeout=2.0)
    try:
        message = ""
        if rank == 0:
            try:
                dist.all_reduce(torch.ones(1), group=state.dp_group())  # rank 1 never joins
            except RuntimeError as e:
                message = str(e)
        dist.barrier()  # the world's group: rank 1 waits here for rank 0
        return message if rank == 0 else None
    finally:
        state.destroy()


def test_the_groups_collectives_time_out_after_the_timeout_given_to_initialize():
    """The hang's cause: a group made by new_group without a timeout waits gloo's default 30 minutes, whatever the
    world's timeout."""
    message = launch.run_world(2, _dp_all_reduce_without_rank_1, timeout=60)[0]
    assert "Timed out waiting 2000ms" in message, message  # the group's own timeout, as gloo reports it


def test_a_watchdog_started_inside_another_hands_progress_back_to_it_when_it_stops():
    with watchdog.Watchdog(60.0) as outer:
        with watchdog.Watchdog(60.0):
            watchdog.progress("inner")
        watchdog.progress("outer again")
        assert outer.phase == "outer again"
    assert watchdog.current_phase() is None
