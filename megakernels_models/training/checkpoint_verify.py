"""Verified checkpoints: a digest of every stored chunk, written with the checkpoint and checked when it is loaded.

What is hashed. torch.distributed.checkpoint (DCP) stores each chunk of each entry (a tensor shard, a ZeRO-completed
Adam moment, the RNG states, the ``meta`` JSON) as a byte range of one data file, named in the checkpoint's
``.metadata`` (``storage_data``: file, offset, length). Each rank, right after its data files are written, reads its
byte ranges back and hashes them (BLAKE2b, 128 bits); the digests travel to the coordinating rank with DCP's own
write results, and ``DIR/step-N/.digests.json`` is written *before* DCP's ``.metadata`` — the metadata is the commit,
so a complete checkpoint always has its digests. An incremental checkpoint's entries that point at an older step's
file (``../step-M/...``) carry the digests that step recorded for them.

Hashing the stored bytes rather than the tensors makes verification independent of the layout that loads the
checkpoint: a flipped byte in any shard, moment or metadata entry is found whatever reads it, and the check needs
no model. ``verify(path)`` checks every range (file present, long enough, digest equal) and returns one line per
problem, naming the entry, the chunk and the file; ``megakernels checkpoint verify DIR`` runs it from the command
line; ``select`` (used when resuming) tries the newest checkpoint first and falls back to the newest one that
verifies, saying so. Checkpoints written before digests existed load unchecked (with a note).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import sys

import torch.distributed as dist

from megakernels_models.training import checkpoint_store as store

DIGESTS = ".digests.json"
ALGORITHM = "blake2b-128"
_BLOCK = 1 << 22  # read back in 4 MiB pieces: a large shard never needs its size in memory again


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded (missing, incomplete, damaged, or for another model)."""


def digest_range(path: str, offset: int, length: int) -> str | None:
    """Hex BLAKE2b of ``length`` bytes at ``offset`` of the file ``path``; None when the file is shorter."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left:
            block = f.read(min(left, _BLOCK))
            if not block:
                return None
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def range_key(relative_path: str, offset: int, length: int) -> str:
    """The digest table's key of a byte range of a checkpoint file."""
    return f"{os.path.normpath(relative_path)}@{offset}+{length}"


def _chunk(index) -> str:
    """A chunk's name in messages: its entry and, for a shard, its offset in the full tensor."""
    offset = getattr(index, "offset", None)
    return index.fqn if offset is None or not any(offset) else f"{index.fqn} (chunk at {tuple(offset)})"


def read_metadata(path: str):
    """DCP's metadata of the checkpoint at ``path``.

    Raises:
        CheckpointError: the metadata file is missing, truncated or not DCP metadata (naming the file).
    """
    meta_file = os.path.join(path, store.METADATA)
    try:
        with open(meta_file, "rb") as f:
            md = pickle.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: no {store.METADATA} file (not a complete checkpoint)") from None
    except Exception as e:  # noqa: BLE001 - unpickling garbage raises almost anything
        raise CheckpointError(
            f"checkpoint {path}: {meta_file} is unreadable (truncated or damaged): {type(e).__name__}: {e}"
        ) from None
    if getattr(md, "storage_data", None) is None or getattr(md, "state_dict_metadata", None) is None:
        raise CheckpointError(f"checkpoint {path}: {meta_file} is not a torch.distributed.checkpoint metadata file")
    return md


# ---- writing --------------------------------------------------------------------------------------------------


def digest_of(checkpoint_dir: str, info) -> str | None:
    """The digest of the byte range a DCP storage info (``relative_path``, ``offset``, ``length``) describes, read
    back from ``checkpoint_dir``."""
    return digest_range(os.path.join(checkpoint_dir, info.relative_path), info.offset, info.length)


def write_digests(checkpoint_dir: str, digests: dict[str, str], previous: str | None = None) -> None:
    """Write the digest table of the checkpoint being committed at ``checkpoint_dir`` (before its metadata), adding
    the recorded digests of the ranges it reuses from the checkpoint ``previous`` (an incremental save)."""
    table = dict(digests)
    if previous is not None:
        here = os.path.basename(os.path.normpath(previous))
        for key, value in _load_table(previous).items():
            rel, _, extent = key.rpartition("@")
            # the previous checkpoint's own files are ../<previous>/file from here (references never chain)
            table.setdefault(f"{rel if rel.startswith('../') else f'../{here}/{rel}'}@{extent}", value)
    tmp = os.path.join(checkpoint_dir, DIGESTS + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"algorithm": ALGORITHM, "ranges": table}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(checkpoint_dir, DIGESTS))


def _load_table(path: str) -> dict[str, str]:
    """The digest table of the checkpoint at ``path`` ({} when it has none).

    Raises:
        CheckpointError: the table exists but is unreadable.
    """
    file = os.path.join(path, DIGESTS)
    if not os.path.exists(file):
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
        if data.get("algorithm") != ALGORITHM or not isinstance(data.get("ranges"), dict):
            raise ValueError(f"expected algorithm {ALGORITHM!r} and a 'ranges' mapping")
        return data["ranges"]
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {path}: {file} is unreadable: {e}") from None


# ---- checking -------------------------------------------------------------------------------------------------


def has_digests(path: str) -> bool:
    return os.path.exists(os.path.join(path, DIGESTS))


def verify(path: str, share: tuple[int, int] = (0, 1)) -> list[str]:
    """Problems of the checkpoint at ``path`` (empty when it verifies): an unreadable metadata or digest table, a
    missing or short data file, a chunk whose bytes differ from its recorded digest. ``share = (i, n)`` checks only
    every n-th chunk from the i-th (ranks split the reading); a checkpoint without digests is only checked for its
    files' presence and lengths."""
    try:
        md = read_metadata(path)
        table = _load_table(path)
    except CheckpointError as e:
        return [str(e)]
    problems = []
    items = sorted(md.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset))
    for i, (index, info) in enumerate(items):
        if i % share[1] != share[0]:
            continue
        file = os.path.normpath(os.path.join(path, info.relative_path))
        where = f"{_chunk(index)} in {file}"
        if not os.path.exists(file):
            problems.append(f"checkpoint {path}: {where}: the file is missing")
            continue
        if os.path.getsize(file) < info.offset + info.length:
            problems.append(
                f"checkpoint {path}: {where}: the file is truncated ({os.path.getsize(file)} bytes, the "
                f"chunk ends at {info.offset + info.length})"
            )
            continue
        if not table:
            continue
        expected = table.get(range_key(info.relative_path, info.offset, info.length))
        if expected is None:
            problems.append(f"checkpoint {path}: {where}: no recorded digest")
        elif digest_range(file, info.offset, info.length) != expected:
            problems.append(
                f"checkpoint {path}: {where}: the bytes do not match the digest recorded at save time "
                "(the file was changed or damaged after the save)"
            )
    return problems


def verify_collective(path: str) -> list[str]:
    """``verify`` with the chunks split over the ranks of the world (every rank calls it; every rank gets every
    problem)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return verify(path)
    mine = verify(path, (dist.get_rank(), dist.get_world_size()))
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, mine)
    return sorted({p for v in views for p in v})


def candidates(load_dir: str) -> list[str]:
    """The checkpoints a resume may start from, best first: ``load_dir`` itself if it is one; else the one ``latest``
    names, then every other complete ``step-N``, newest first."""
    if os.path.exists(os.path.join(load_dir, store.METADATA)):
        return [load_dir]
    if not os.path.exists(load_dir):
        return []
    first = store.find_latest(load_dir, error=CheckpointError)
    rest = [os.path.join(load_dir, name) for _, name in reversed(store.complete_steps(load_dir))]
    return ([first] if first else []) + [p for p in rest if p != first]


def select(load_dir: str, say=print) -> str | None:
    """The checkpoint to resume from: the newest candidate (``candidates``) that verifies, each skipped one reported
    through ``say`` (a line without the program's name) with its problems; None when ``load_dir`` holds no checkpoint
    yet. Collective when a process
    group is initialised (every rank gets the same answer).

    Raises:
        CheckpointError: no candidate verifies (naming each one's first problem), or ``load_dir`` is a single
            checkpoint that does not.
    """
    found = candidates(load_dir)
    failures = []
    for path in found:
        problems = verify_collective(path)
        if not problems:
            if failures:
                say(f"warning: falling back to {path}, the newest checkpoint that verifies")
            if not has_digests(path):
                say(f"note: {path} was saved without digests; loading it unchecked")
            return path
        failures.append(f"{path}: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
        say(
            f"warning: checkpoint {path} fails verification: {problems[0]}"
            + (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else "")
        )
    if failures:
        raise CheckpointError(f"--load {load_dir}: no checkpoint verifies: " + "; ".join(failures))
    return None


# ---- the command line -----------------------------------------------------------------------------------------


def add_parser(sub) -> None:
    p = sub.add_parser("checkpoint", help="inspect checkpoints (verify their digests)", description="Checkpoint tools.")
    actions = p.add_subparsers(dest="action", required=True)
    v = actions.add_parser(
        "verify",
        help="check every stored chunk against the digest recorded when it was saved",
        description="Check every chunk of a checkpoint (DIR/step-N) or of every complete "
        "checkpoint in a save directory against the digests recorded at save time. Exit status "
        "0 when all verify, 1 when any does not, 2 when DIR holds no checkpoint.",
    )
    v.add_argument("dir", metavar="DIR", help="a checkpoint (step-N) or a --save directory")
    v.set_defaults(_run=_run_verify)


def _run_verify(ns: argparse.Namespace) -> int:
    root = ns.dir
    if not os.path.isdir(root):
        print(f"megakernels checkpoint verify: {root}: no such directory", file=sys.stderr)
        return 2
    if os.path.exists(os.path.join(root, store.METADATA)):
        paths = [root]
    else:
        paths = [
            os.path.join(root, name)
            for name in sorted(os.listdir(root))
            if store.STEP_DIR.match(name)
            and os.path.isdir(os.path.join(root, name))
            and os.path.exists(os.path.join(root, name, store.METADATA))
        ]
    if not paths:
        print(
            f"megakernels checkpoint verify: {root}: no checkpoint (step-N directory with {store.METADATA})",
            file=sys.stderr,
        )
        return 2
    status = 0
    for path in paths:
        problems = verify(path)
        if problems:
            status = 1
            print(f"{path}: FAILED")
            for p in problems:
                print(f"  {p}")
        elif not has_digests(path):
            print(f"{path}: readable (saved without digests: contents not checked)")
        else:
            md = read_metadata(path)
            print(f"{path}: ok ({len(md.storage_data)} chunks)")
    return status
