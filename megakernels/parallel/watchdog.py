"""A training rank's hang watchdog, and the rules that make a rank die with its launcher.

A rank that stops responding -- a GPU or NCCL hang, a stopped process -- must not hang the job. Its peers' own
collective timeouts do not suffice: they cover a rank waiting in a collective, not one stuck outside it, and not a
rank with no peer to wait for. So every rank runs a ``Watchdog``, a thread that the training loop feeds at its phase
boundaries with ``progress(phase, step)`` (a lock, a clock read and a 132-byte memory copy: a few microseconds).
When no progress comes for ``timeout`` seconds, the thread prints one line, e.g.

    megakernels train: rank 0: no progress for 8.3 s (timeout 8 s) in phase 'stop check' (step 3); rank 1
    (pid 4242) stopped responding: no heartbeat for 9.1 s, last in phase 'pipeline' (step 4); ending the job

and ends its process with ``EXIT_CODE`` (``os._exit``: the main thread is stuck; nothing else would end it). It
checks every ``interval(timeout)`` seconds (at most 1 s), so a hung rank ends within ``timeout`` plus an interval,
and the job within about twice the timeout.

**Blaming the right rank.** The rank whose watchdog fires is usually the one waiting in a collective for a stopped
peer (a gloo or NCCL wait releases the GIL, so its thread runs), while the stopped rank's thread is stopped with
it. So each watchdog also keeps its rank's heartbeat record in the job's liveness directory
(``megakernels.parallel.liveness``): a rank whose heartbeat is older than ``stale_after(timeout)`` has stopped
responding. The spawned-world launcher reads the records to name that rank and every rank's phase, and ends the
world itself once a heartbeat is older than the timeout; a torchrun worker that fails ends its local peers that
stopped responding (``end_stale_peers``), which torchrun's agent would give 30 s to act on a SIGTERM they cannot
act on.

**Dying with the launcher.** A rank whose launcher is gone must stop: it would train and save on without it, and a
relaunch would find two jobs writing one checkpoint directory. ``die_with(launcher)`` asks Linux to SIGKILL the
process when its parent dies (``PR_SET_PDEATHSIG``, which ends a stopped process too) and closes the race with a
launcher that died before that; the watchdog thread also watches the launcher's process (a pidfd where Linux has
one), which covers ranks whose parent is not the launcher (the fork server's children).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import threading
import time

from megakernels.parallel import liveness

# The status of a rank ended by its watchdog (as coreutils' ``timeout``: the command ran past its time).
EXIT_CODE = 124
# The status of a rank that ended because its launcher was gone (nobody reads it; distinct for debugging).
LAUNCHER_GONE_EXIT_CODE = 125
PROGRAM = "megakernels train"

_PR_SET_PDEATHSIG = 1  # linux/prctl.h

_active: Watchdog | None = None


def interval(timeout: float) -> float:
    """Seconds between two checks (and heartbeats) of a watchdog with ``timeout``: a tenth of it, at most 1 s."""
    return min(1.0, timeout / 10.0)


def stale_after(timeout: float) -> float:
    """Heartbeat age, in seconds, after which a rank counts as not responding: three missed beats, and at least 2 s
    (a loaded machine may not schedule a thread for a while)."""
    return max(3.0 * interval(timeout), 2.0)


def progress(phase: str, step: int | None = None) -> None:
    """Report progress to this process's watchdog: the rank starts ``phase`` (of optimizer step ``step``; None keeps
    the step of the previous report). Nothing without a watchdog."""
    w = _active
    if w is not None:
        w.progress(phase, step)


def current_phase() -> str | None:
    """The phase of this process's watchdog (None without one)."""
    w = _active
    return None if w is None else w.phase


class Watchdog:
    """The watchdog thread of one rank; ``start()``/``stop()``, or ``with Watchdog(...) as w:``.

    Args:
        timeout: seconds the rank may go without ``progress`` before the watchdog ends it (> 0).
        rank: this rank (for its line and its liveness file).
        liveness_dir: where to write this rank's heartbeat (None: no heartbeat).
        launcher: the process id of the launcher this rank must not outlive (None: none to watch).
        end_stale_peers: when the watchdog fires (or ``end_stale_peers()`` is called), also SIGKILL the ranks in
            ``liveness_dir`` whose heartbeat is stale and whose parent is this process's parent: under torchrun,
            whose agent would otherwise give a stopped rank 30 s to act on its SIGTERM.
        program: the prefix of the watchdog's line.

    Raises:
        ValueError: ``timeout`` not > 0.
    """

    def __init__(
        self,
        timeout: float,
        rank: int = 0,
        liveness_dir: str | None = None,
        launcher: int | None = None,
        end_stale_peers: bool = False,
        program: str = PROGRAM,
        clock=time.monotonic,
    ):
        if not timeout > 0:
            raise ValueError(f"Watchdog: timeout must be > 0 seconds, got {timeout}")
        self.timeout, self.rank, self.liveness_dir, self.program = float(timeout), rank, liveness_dir, program
        self._clock = clock  # seconds, monotonic (a test's own clock drives ``check``)
        self.interval = interval(self.timeout)
        self._end_stale_peers = end_stale_peers
        # What else the line should say when the watchdog fires (e.g. ``nodes.NodeMap.report``: the nodes that are
        # lost); called on the watchdog's thread, so it must return in bounded time.
        self.explain = None
        self._launcher = _ProcessWatch(launcher) if launcher is not None else None
        self._state = (clock(), "start", None)  # (time of the last progress, phase, step)
        self._lock = threading.Lock()  # progress and the thread both write the record
        self._record: liveness.Record | None = None
        self._previous: Watchdog | None = None  # the process's watchdog before this one started
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megakernels-watchdog", daemon=True)

    # ---- the rank's side ----------------------------------------------------------------------------------------

    def progress(self, phase: str, step: int | None = None) -> None:
        """The rank starts ``phase`` (of step ``step``; None keeps the previous step)."""
        with self._lock:
            now = self._clock()
            self._state = (now, phase, self._state[2] if step is None else step)
            if self._record is not None:  # a memory write: the record names the phase even if the rank stops now
                self._record.write(self.rank, self._state, now)

    @property
    def phase(self) -> str:
        return self._state[1]

    def start(self) -> Watchdog:
        """Write the first heartbeat, check the launcher, start the thread; this becomes the process's watchdog
        (``progress()``)."""
        global _active
        if self.liveness_dir is not None:
            self._record = liveness.Record.create(self.liveness_dir, self.rank)
        self._beat(self._clock())
        if self._launcher is not None and self._launcher.gone():
            self._launcher_gone()
        self._previous, _active = _active, self
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and remove the heartbeat (a rank that finished is not judged)."""
        global _active
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if _active is self:
            _active = self._previous
        if self._launcher is not None:
            self._launcher.close()
        if self._record is not None:
            self._record.remove()
            self._record = None

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def end_stale_peers(self) -> None:
        """When this rank fails under torchrun (``end_stale_peers``; nothing otherwise): print which local peers
        stopped responding and SIGKILL them."""
        if self._end_stale_peers:
            peers, stale, ended = self._report_peers(self._clock())
            if stale:
                _say(f"{self.program}: rank {self.rank}: {peers}{ended}")

    # ---- the thread ---------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.check()

    def check(self) -> None:
        """One look of the thread (every ``interval``): write the heartbeat, end the rank when its launcher is gone
        or it made no progress for ``timeout`` seconds."""
        now = self._clock()
        self._beat(now)
        if self._launcher is not None and self._launcher.gone():
            self._launcher_gone()
        since, phase, step = self._state
        if now - since > self.timeout:
            self._fire(now - since, phase, step)

    def _beat(self, now: float) -> None:
        with self._lock:
            if self._record is not None:
                self._record.write(self.rank, self._state, now)

    def _report_peers(self, now: float) -> tuple[str, int, str]:
        """What the other ranks in the liveness directory are doing, how many stopped responding, and
        (``end_stale_peers``) which of those this rank ended."""
        if self.liveness_dir is None:
            return "", 0, ""
        records = liveness.read(self.liveness_dir)
        records.pop(self.rank, None)
        limit = stale_after(self.timeout)
        stale = [r for r, rec in records.items() if now - rec["beat"] > limit]
        ended = [r for r in stale if self._end_stale_peers and _kill_sibling(records[r]["pid"])]
        return (
            liveness.summary(records, now, limit),
            len(stale),
            (f"; ended unresponsive rank{'s' if len(ended) > 1 else ''} {', '.join(map(str, ended))}" if ended else ""),
        )

    def _fire(self, age: float, phase: str, step: int | None) -> None:
        now = self._clock()
        line = (
            f"rank {self.rank}: no progress for {age:.1f} s (timeout {self.timeout:g} s) in "
            f"{liveness.where(phase, step)}"
        )
        peers, _, ended = self._report_peers(now)
        line += (f"; {peers}" if peers else "") + ended
        if self.explain is not None:
            try:
                extra = self.explain()
            except Exception as e:  # noqa: BLE001 - the rank ends either way; say why the report is missing
                extra = f"(could not tell which nodes answer: {e})"
            line += f"; {extra}" if extra else ""
        if self.liveness_dir is not None:  # the launcher quotes it
            liveness.write_verdict(self.liveness_dir, self.rank, line)
        _say(f"{self.program}: {line}; ending the job")
        os._exit(EXIT_CODE)

    def _launcher_gone(self) -> None:
        _say(f"{self.program}: rank {self.rank}: the launcher (pid {self._launcher.pid}) is gone; ending this rank")
        os._exit(LAUNCHER_GONE_EXIT_CODE)


def _say(line: str) -> None:
    # os.write, not print: no lock that the stuck main thread could hold, no buffer left behind by os._exit.
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode(errors="replace"))


# ---- processes --------------------------------------------------------------------------------------------------


class _ProcessWatch:
    """Whether a process has ended: a pidfd (Linux 5.3+; never fooled by a reused pid), else signal 0."""

    def __init__(self, pid: int):
        self.pid, self.fd, self._gone = pid, None, False
        try:
            self.fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._gone = True
        except (AttributeError, OSError):
            pass

    def gone(self, close: bool = False) -> bool:
        """Whether the process has ended (``close``: and release the pidfd, for a one-off question)."""
        try:
            if self._gone:
                return True
            if self.fd is not None:
                return bool(select.select([self.fd], [], [], 0)[0])  # readable once the process has terminated
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                pass
            return False
        finally:
            if close:
                self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def die_with(launcher: int) -> bool:
    """End this process (SIGKILL) when its parent dies, whatever killed the parent; and now, if ``launcher`` (a
    process id) is already gone. Returns whether the kernel will send the signal (Linux only).

    The parent is the launcher for a spawned rank and torchrun's agent for a torchrun worker; a rank started by the
    fork server has the server as its parent, which exits when the launcher does (and the watchdog watches the
    launcher itself). Call it first thing in the rank: a parent that died before the call is caught by the check
    that follows it, for a parent that is ``launcher``."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != launcher and _ProcessWatch(launcher).gone(close=True):
        os._exit(LAUNCHER_GONE_EXIT_CODE)
    return armed


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _kill_sibling(pid: int) -> bool:
    """SIGKILL ``pid`` if it is a child of this process's parent (a rank of the same torchrun agent, not a process
    that reused a dead rank's pid); whether it was sent."""
    if pid == os.getpid() or _parent_of(pid) != os.getppid():
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        return False
    return True
