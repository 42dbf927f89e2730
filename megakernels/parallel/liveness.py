"""Heartbeat records of a job's ranks (``megakernels.parallel.watchdog``): which rank stopped responding, and where
each rank was.

A rank's watchdog keeps one record in its job's *liveness directory*: ``rank-<R>``, a small file the rank maps into
memory, so that reporting progress is a memory copy, not a system call. It holds the rank, its pid, the phase and
step it is in, and the ``time.monotonic()`` (one clock for every process of a Linux machine) of its last progress
(``since``) and of its last sign of life (``beat``: progress, or the watchdog thread's check every interval). A
stopped process stops beating; a rank blocked in a collective does not (its thread runs). A watchdog that ends its
rank leaves its line beside the record (``rank-<R>.verdict``) for the launcher to quote.

Directories live in ``/dev/shm`` where it is writable (memory: no disk to be full or slow), else in the temporary
directory, under ``megakernels-watchdog-<uid>``: ``launcher-<pid>-*`` for a spawned world (made and removed by the
launcher; ``stacks-<pid>-*`` beside it holds its ranks' stack dumps when it times out), ``agent-<pid>-restart-<n>``
for the ranks of one torchrun agent (``$MEGAKERNELS_WATCHDOG_DIR`` instead, where set). Making one removes those
whose process is gone.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import struct
import tempfile
import zlib

# A liveness directory given by the environment (torchrun's ranks otherwise derive one per agent).
ENV_DIR = "MEGAKERNELS_WATCHDOG_DIR"


def where(phase: str, step: int | None) -> str:
    """``phase 'P' (step S)``, as the watchdog's messages name a place."""
    return f"phase '{phase}'" + ("" if step is None else f" (step {step})")


# A record: CRC32 of the payload, then rank, pid, time of the last progress, time of the last beat, step (-1: none),
# phase (UTF-8, NUL-padded). Written with one copy into a shared mapping; a reader that catches a copy half done
# sees a wrong CRC and reads again.
_PAYLOAD = struct.Struct("<qqddq96s")
_CRC = struct.Struct("<I")
RECORD_BYTES = _CRC.size + _PAYLOAD.size


def _record_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank-{rank}")


class Record:
    """This rank's liveness record: a small file mapped into memory, so that ``progress`` updates it with a memory
    write instead of a system call."""

    def __init__(self, path: str, mapping: mmap.mmap):
        self.path, self.map = path, mapping

    @staticmethod
    def create(directory: str, rank: int) -> Record | None:
        """The record file of ``rank`` in ``directory``, created; None where it cannot be (the rank runs on without
        a heartbeat: a full or read-only directory costs the launcher its report, never the run)."""
        path = _record_path(directory, rank)
        try:
            os.makedirs(directory, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                # written, not just sized: a write to a mapped hole that the disk has no room for is a SIGBUS
                if os.write(fd, bytes(RECORD_BYTES)) != RECORD_BYTES:
                    return None
                return Record(path, mmap.mmap(fd, RECORD_BYTES))
            finally:
                os.close(fd)
        except (OSError, ValueError):
            return None

    def write(self, rank: int, state: tuple, beat: float) -> None:
        since, phase, step = state
        payload = _PAYLOAD.pack(
            rank,
            os.getpid(),
            since,
            beat,
            -1 if step is None else int(step),
            phase.encode("utf-8", errors="replace")[:96],
        )
        self.map[:] = _CRC.pack(zlib.crc32(payload)) + payload

    def remove(self) -> None:
        self.map.close()
        with contextlib.suppress(OSError):
            os.remove(self.path)


def _read_record(path: str) -> dict | None:
    for _ in range(3):  # a copy half done: read again
        try:
            with open(path, "rb") as f:
                data = f.read(RECORD_BYTES)
        except OSError:
            return None
        if len(data) != RECORD_BYTES:
            return None
        payload = data[_CRC.size :]
        if _CRC.unpack_from(data)[0] == zlib.crc32(payload):
            rank, pid, since, beat, step, phase = _PAYLOAD.unpack(payload)
            return {
                "rank": rank,
                "pid": pid,
                "since": since,
                "beat": beat,
                "step": None if step < 0 else step,
                "phase": phase.rstrip(b"\0").decode("utf-8", errors="replace"),
            }
    return None


def read(directory: str) -> dict[int, dict]:
    """The heartbeat records in ``directory`` by rank (``rank, pid, phase, step``, and the ``time.monotonic()`` of
    the last progress, ``since``, and of the last heartbeat, ``beat``); those unreadable now are left out."""
    out = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return out
    for name in names:
        if name.startswith("rank-") and name[5:].isdigit():
            rec = _read_record(os.path.join(directory, name))
            if rec is not None:
                out[rec["rank"]] = rec
    return out


def write_verdict(directory: str, rank: int, line: str) -> None:
    path = _record_path(directory, rank) + ".verdict"
    with contextlib.suppress(OSError):
        with open(path + ".tmp", "w") as f:
            f.write(line)
        os.replace(path + ".tmp", path)


def read_verdict(directory: str, rank: int) -> str | None:
    """The line the watchdog of ``rank`` printed before it ended the rank (None if it did not)."""
    try:
        with open(_record_path(directory, rank) + ".verdict") as f:
            return f.read()
    except OSError:
        return None


def summary(records: dict[int, dict], now: float, stale: float) -> str:
    """What each rank of ``records`` was doing at ``now``: those whose heartbeat is older than ``stale`` seconds
    first, as having stopped responding."""
    late, alive = [], []
    for r in sorted(records):
        rec = records[r]
        place = where(rec["phase"], rec["step"])
        if now - rec["beat"] > stale:
            late.append(
                f"rank {r} (pid {rec['pid']}) stopped responding: no heartbeat for {now - rec['beat']:.1f} "
                f"s, last in {place}"
            )
        else:
            alive.append(f"rank {r} in {place} for {now - rec['since']:.1f} s")
    return "; ".join(late + alive)


def _root() -> str | None:
    """This user's directory of liveness directories: in ``/dev/shm`` (memory: no disk that can be full or slow)
    where it is writable, else in the temporary directory; None where it cannot be made ours."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK | os.X_OK) else tempfile.gettempdir()
    root = os.path.join(base, f"megakernels-watchdog-{os.getuid()}")
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        if os.stat(root).st_uid != os.getuid():  # another user's: its records cannot be trusted
            return None
    except OSError:
        return None
    return root


def _sweep(root: str) -> None:
    """Remove the liveness directories of launchers and agents that are gone (``<kind>-<pid>-...``): a launcher
    killed by SIGKILL cannot remove its own. (A pid reused since only keeps a directory a while longer.)"""
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            parts = name.split("-")
            if len(parts) > 1 and parts[1].isdigit() and not _alive(int(parts[1])):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def new_dir(kind: str = "launcher") -> str | None:
    """A fresh liveness directory for the ranks this process launches (the caller removes it; one left by a launcher
    that is gone is removed by the next one made), ``<kind>-<pid>-*``: ``launcher`` for heartbeats, ``stacks`` for
    the stack dumps of a timed-out world (``megakernels.parallel.launch``). None where none can be made (the ranks
    then run without heartbeats, or stack dumps)."""
    root = _root()
    if root is None:
        return None
    _sweep(root)
    try:
        return tempfile.mkdtemp(prefix=f"{kind}-{os.getpid()}-", dir=root)
    except OSError:
        return None


def local_dir() -> str | None:
    """The liveness directory of a torchrun worker: ``$MEGAKERNELS_WATCHDOG_DIR``, else one per torchrun agent (the
    workers' common parent) and restart on this machine; None where none can be made."""
    given = os.environ.get(ENV_DIR)
    if given:
        return given
    root = _root()
    if root is None:
        return None
    _sweep(root)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    path = os.path.join(root, f"agent-{os.getppid()}-restart-{restart}")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError:
        return None
    return path
