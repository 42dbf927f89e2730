"""Running ``megakernels train`` as a real process that a test holds at sync points (``megakernels_models.
syncpoints``), signals and kills: the pieces of the preemption and kill-during-save tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

DEADLINE_S = 240.0  # torchrun and its workers starting on a machine other tests (or a second suite) share
TINY_FLAGS = [
    "--preset",
    "none",
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-heads",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--corpus-bytes",
    "262144",
    "--no-progress",
    "--eval-interval",
    "0",
    "--dropout",
    "0.1",
]


class SyncDir:
    """The test's side of ``MEGAKERNELS_SYNC_DIR``: hold and release points, wait for ranks to reach them.
    ``alive`` (optional) says whether the run is still going, so a run that ended early fails the wait at once."""

    def __init__(self, path: str, alive=None):
        self.path, self.alive = path, alive
        os.makedirs(path, exist_ok=True)

    def hold(self, name: str) -> None:
        open(os.path.join(self.path, f"{name}.hold"), "w").close()

    def release(self, name: str) -> None:
        os.remove(os.path.join(self.path, f"{name}.hold"))

    def wait_for(self, name: str, ranks, timeout: float = DEADLINE_S) -> list[int]:
        """Wait (at most ``timeout`` seconds) until every rank in ``ranks`` reached ``name``; returns their process
        ids."""
        paths = [os.path.join(self.path, f"{name}.{r}") for r in ranks]
        deadline = time.monotonic() + timeout
        while not all(os.path.exists(p) for p in paths):
            if self.alive is not None:
                self.alive(name)
            assert time.monotonic() < deadline, f"no {name} after {timeout:g} s"
            time.sleep(0.01)
        pids = []
        for p in paths:
            with open(p) as f:
                pids.append(int(f.read()))
        return pids

    def forget(self, name: str) -> None:
        """Remove the marks of ``name`` (to wait for it again)."""
        for f in os.listdir(self.path):
            if f.startswith(name + ".") and not f.endswith(".hold"):
                os.remove(os.path.join(self.path, f))


class Run:
    """One ``megakernels train`` process; ``sync`` (a directory) becomes its ``MEGAKERNELS_SYNC_DIR`` with the
    points in ``holds`` held from the start."""

    def __init__(self, flags: list[str], sync: str | None = None, holds: tuple[str, ...] = (), group: bool = False):
        self.sync = SyncDir(sync, self._alive) if sync is not None else None
        for name in holds:
            self.sync.hold(name)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("MEGAKERNELS_SYNC_DIR", None)
        if sync is not None:
            env["MEGAKERNELS_SYNC_DIR"] = sync
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "megakernels_models.cli", "train", *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=group,  # a process group of its own: what a terminal or a scheduler signals
        )

    def _alive(self, waiting_for: str) -> None:
        if self.proc.poll() is not None:
            out, err = self.proc.communicate()
            raise AssertionError(f"the run ended (status {self.proc.returncode}) before {waiting_for}:\n{out}\n{err}")

    def signal(self, sig=signal.SIGTERM) -> None:
        os.kill(self.proc.pid, sig)

    def signal_group(self, sig) -> None:
        """``sig`` to the run's whole process group (``kill -SIG -PGID``; the run was started with ``group``)."""
        os.killpg(self.proc.pid, sig)

    def logged_step(self, log: str, timeout: float = DEADLINE_S) -> int:
        """Wait (at most ``timeout`` seconds) until the JSONL log ``log`` holds a step's record; return its step."""
        deadline = time.monotonic() + timeout
        while True:
            if os.path.exists(log):
                with open(log) as f:  # whole lines only: the last one may be half written
                    steps = [r["step"] for r in map(json.loads, f.read().split("\n")[:-1]) if "step" in r]
                if steps:
                    return steps[-1]
            self._alive(f"a step in {log}")
            assert time.monotonic() < deadline, f"no step logged in {log} after {timeout:g} s"
            time.sleep(0.01)

    def ended(self) -> tuple[int, str, str]:
        """Wait for the exit; return the status, stdout and stderr."""
        try:
            out, err = self.proc.communicate(timeout=DEADLINE_S)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        return self.proc.returncode, out, err

    def kill(self) -> None:
        self.proc.kill()
        self.proc.communicate()

    def finish(self) -> str:
        """Wait for the exit; assert status 0; return stdout."""
        code, out, err = self.ended()
        assert code == 0, f"status {code}:\n{out}\n{err}"
        return out


def run_to_end(flags: list[str]) -> str:
    return Run(flags).finish()


def logged_losses(path: str) -> list[float]:
    """The per-step losses of a JSONL log (appended to by every (re)launch), in order."""
    with open(path) as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]
