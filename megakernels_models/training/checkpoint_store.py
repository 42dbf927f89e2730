"""The checkpoint directory: ``DIR/step-N`` checkpoints, the ``latest`` marker, atomic commits, keep-K pruning,
and the files an incremental checkpoint shares with older ones.

Commit. A checkpoint is written to ``DIR/.tmp-step-N`` and renamed to ``DIR/step-N`` once DCP's metadata exists
(DCP writes it last, after every rank's data files), then ``DIR/latest`` (a temporary file renamed over) names it.
A process killed at any moment therefore leaves ``latest`` naming a complete checkpoint; without ``latest`` the
newest ``step-N`` holding the metadata is used.

Shared files. An incremental checkpoint does not rewrite a tensor whose bytes equal those in the previous
checkpoint: its metadata points at the file that already holds them, ``../step-M/__r_0.distcp`` (relative, so the
directory can move as a whole). References always name the file where the bytes are, never a chain.

Pruning keeps the newest ``keep`` complete checkpoints (and the one ``latest`` names). An older checkpoint whose
files a kept one still references loses its metadata and its unreferenced files but keeps the referenced ones: it
is no longer a checkpoint, only a store, deleted once nothing references it.
"""

from __future__ import annotations

import os
import re
import shutil

LATEST = "latest"
METADATA = ".metadata"
# The special token ids (bos, eos, pad) of a converted model, beside its checkpoints as in a HuggingFace directory.
GENERATION_CONFIG = "generation_config.json"
STEP_DIR = re.compile(r"^step-(\d{8,})$")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def complete_steps(save_dir: str) -> list[tuple[int, str]]:
    """``(step, name)`` of the complete checkpoints in ``save_dir``, oldest first."""
    out = []
    for name in os.listdir(save_dir):
        m = STEP_DIR.match(name)
        if m and os.path.exists(os.path.join(save_dir, name, METADATA)):
            out.append((int(m.group(1)), name))
    return sorted(out)


def find_latest(load_dir: str, error=RuntimeError) -> str | None:
    """The checkpoint to resume from: ``load_dir`` itself if it is one (``DIR/step-N``), else the one ``latest``
    names, else the newest complete ``step-N``; None when ``load_dir`` does not exist or holds no complete
    checkpoint (a first launch with ``--save DIR --load DIR``).

    Raises:
        error: ``load_dir`` exists and is not a directory.
    """
    if not os.path.exists(load_dir):
        return None
    if not os.path.isdir(load_dir):
        raise error(f"--load {load_dir!r} is not a directory")
    if os.path.exists(os.path.join(load_dir, METADATA)):
        return load_dir
    name = read_marker(load_dir)
    path = os.path.join(load_dir, name or "")
    if name and STEP_DIR.match(name) and os.path.exists(os.path.join(path, METADATA)):
        return path
    steps = complete_steps(load_dir)
    return os.path.join(load_dir, steps[-1][1]) if steps else None


def read_marker(save_dir: str) -> str | None:
    """The checkpoint name ``save_dir/latest`` holds; None when there is no marker or it is not one (a damaged,
    binary or oversized file, or a directory): the newest complete checkpoint is used then."""
    marker = os.path.join(save_dir, LATEST)
    if not os.path.isfile(marker):
        return None
    try:
        with open(marker, "rb") as f:
            name = f.read(256).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if STEP_DIR.match(name) else None


def write_latest(save_dir: str, name: str) -> None:
    """Point ``save_dir/latest`` at ``name``, atomically and durably."""
    if os.path.isdir(os.path.join(save_dir, LATEST)):
        raise OSError(f"{os.path.join(save_dir, LATEST)} is a directory, not the marker file: move it away")
    tmp = os.path.join(save_dir, f".{LATEST}.tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(save_dir, LATEST))
    try:  # make the rename itself durable
        fd = os.open(save_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def commit(tmp: str, final: str, error=RuntimeError) -> None:
    """Rename the written checkpoint ``tmp`` to ``final`` and point ``latest`` at it (rank 0, after DCP's save
    returned on it, which is after every rank's files and the metadata are written).

    Raises:
        error: ``tmp`` has no metadata (the save did not finish).
    """
    if not os.path.exists(os.path.join(tmp, METADATA)):
        raise error(f"checkpoint {tmp} has no {METADATA} after saving")
    if os.path.exists(final):  # a re-save of the same step: the old one goes first
        shutil.rmtree(final)
    os.rename(tmp, final)
    write_latest(os.path.dirname(final), os.path.basename(final))


def storage_files(path: str) -> dict:
    """``{MetadataIndex: storage info}`` of the checkpoint at ``path`` (where each chunk's bytes are)."""
    import torch.distributed.checkpoint as dcp  # here: importing this module (every CLI run does) stays light

    return dcp.FileSystemReader(path).read_metadata().storage_data


def referenced_elsewhere(save_dir: str, names) -> set[str]:
    """The files (paths relative to ``save_dir``, ``step-M/file``) that the checkpoints ``names`` reference in
    other directories."""
    out = set()
    for name in names:
        for info in storage_files(os.path.join(save_dir, name)).values():
            rel = info.relative_path
            if rel.startswith("../"):
                out.add(os.path.normpath(rel[3:]))
    return out


def prune(save_dir: str, keep: int) -> None:
    """Delete what the newest ``keep`` complete checkpoints (and ``latest``'s) do not need (see the module
    docstring); rank 0 only."""
    complete = [name for _, name in complete_steps(save_dir)]
    latest = find_latest(save_dir)
    kept = set(complete[-keep:]) if keep > 0 else set(complete)
    if latest is not None:
        kept.add(os.path.basename(latest))
    needed = referenced_elsewhere(save_dir, sorted(kept))
    for name in os.listdir(save_dir):
        if not STEP_DIR.match(name) or name in kept:
            continue
        folder = os.path.join(save_dir, name)
        keep_files = {os.path.basename(f) for f in needed if os.path.dirname(f) == name}
        if not keep_files:
            shutil.rmtree(folder, ignore_errors=True)
            continue
        # Metadata first: from here on the directory is a store, never mistaken for a checkpoint.
        for f in [METADATA] + sorted(os.listdir(folder)):
            if f not in keep_files and os.path.exists(os.path.join(folder, f)):
                os.remove(os.path.join(folder, f))


# ---- one writer per directory -------------------------------------------------------------------------------

LOCK = ".lock"


class DirectoryLock:
    """The right to write checkpoints into ``save_dir``, held by one job at a time (its rank 0).

    An exclusive ``flock`` on ``save_dir/.lock``, which the kernel releases when the holder dies however it died, so
    a dead owner's lock is simply taken over; the file names the owner (host, pid, start time) for the message a
    second job gets while the owner lives. (On network file systems without working ``flock`` — some NFS setups —
    the lock is only as good as the file system's.)

    Raises (``acquire``):
        error: another live process holds the lock (naming it), or the lock file cannot be opened.
    """

    def __init__(self, save_dir: str, error=RuntimeError):
        self.save_dir, self.error, self._fd = save_dir, error, None
        self.took_over: str | None = None  # the previous owner's description when a dead owner's lock was taken

    def acquire(self) -> DirectoryLock:
        import fcntl
        import json
        import socket
        import time

        os.makedirs(self.save_dir, exist_ok=True)
        path = os.path.join(self.save_dir, LOCK)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise self.error(f"--save {self.save_dir}: cannot open the lock file {path}: {e.strerror}") from None
        previous = _read_owner(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise self.error(
                f"--save {self.save_dir} is in use by another job ({previous or 'owner unknown'}); one "
                f"job at a time may write a checkpoint directory: wait for it, stop it, or save "
                f"elsewhere"
            ) from None
        self.took_over = previous or None
        owner = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(owner).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None


def _read_owner(fd: int) -> str:
    import json

    try:
        owner = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"pid {owner['pid']} on host {owner['host']} since {owner['since']}"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return ""


def copy_beside(src: str, dst: str) -> None:
    """Copy file ``src`` to ``dst`` whole (through a temporary name and a rename: a reader never sees half of it);
    nothing when ``src`` does not exist or is ``dst``."""
    if os.path.abspath(src) != os.path.abspath(dst) and os.path.exists(src):
        shutil.copyfile(src, dst + ".tmp")
        os.replace(dst + ".tmp", dst)


# A HuggingFace tokenizer directory's files: the tokenizer, its configuration (special tokens, the chat template in
# older layouts) and the chat template file of newer ones. They travel together with a model.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def copy_tokenizer(src_dir: str, dst_dir: str) -> None:
    """Copy the tokenizer files ``src_dir`` has (``TOKENIZER_FILES``) into ``dst_dir``, each whole."""
    for name in TOKENIZER_FILES:
        copy_beside(os.path.join(src_dir, name), os.path.join(dst_dir, name))
