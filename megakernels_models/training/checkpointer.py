"""The trainer's checkpoint saving: synchronous or asynchronous (``--async-save``), always incremental.

Asynchronous. At the step boundary every model and optimizer tensor is copied into host buffers (pinned for CUDA
tensors, allocated once and reused: at most one save is in flight, so one set suffices), which is the only part of a
save the training waits for; a background thread then runs torch.distributed.checkpoint's save of the staged copies —
DCP's asynchronous save, thread flavour: stage, then ``dcp.save`` in a thread — over a gloo process group of its own,
``megakernels.parallel``'s ``checkpoint_group()`` (collectives of a second thread must not interleave with the
training's on the same group). The commit (rename, ``latest``, pruning; ``checkpoint_store``) is done by rank 0 in that
thread after DCP returned there, which is after every rank's files and the metadata are written. A save waits for the
previous one (at most one in flight). A failed write leaves the previous checkpoint ``latest`` and is reported at the
next step boundary (``poll``) or at the next save, whichever sees it first; the end of training waits for the last save
and raises if it failed. The thread is DCP's ``async_save`` design done here rather than called, because
``async_save``'s signature and staging differ across the torch versions we support and the incremental step below must
run between staging and DCP's planning.

Incremental. Each rank hashes (BLAKE2b) the bytes of every tensor it is about to write; an entry whose bytes
equal those of the previous checkpoint this run saved on every rank holding it (frozen parameters and their
untouched optimizer states, ``--freeze``) is left out of the DCP save, and the new checkpoint's metadata points at
the file that already holds it (``checkpoint.Writer``). The first save of a run writes everything. Hashing runs
in the writer thread for asynchronous saves.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os

import torch
import torch.distributed as dist

import megakernels.parallel as mpu
from megakernels_models.training import checkpoint
from megakernels_models.training import checkpoint_store as store


def _digest(value) -> bytes | None:
    """BLAKE2b of a tensor's (or a ShardedTensor's local shards') dtype, shape and bytes; None for other values."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(value, ShardedTensor):
        parts = [s.tensor for s in value.local_shards()]
    elif isinstance(value, torch.Tensor):
        parts = [value]
    else:
        return None
    h = hashlib.blake2b(digest_size=16)
    for t in parts:
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.digest()


class Checkpointer:
    """Saves checkpoints into ``save_dir`` (every rank constructs it: rank 0 takes the directory's lock,
    ``checkpoint_store.DirectoryLock``, held until ``close``). The saves run over ``megakernels.parallel``'s
    ``checkpoint_group()``, a gloo group that ``initialize`` made.

    Args:
        save_dir: the checkpoint directory. keep: complete checkpoints kept (``--keep-checkpoints``).
        async_save: write in a background thread (see the module docstring).
        train_config: the run's resolved settings, stored with each checkpoint.
        timeout: seconds a collective of the save waits for a peer (the trainer's ``--timeout``): the group's,
            given to ``initialize``; None to take it as it is.

    Raises:
        CheckpointError: another live job holds ``save_dir``'s lock (on every rank).
        ValueError: ``timeout`` is not the one ``initialize`` gave the group.
    """

    def __init__(
        self,
        save_dir: str,
        keep: int,
        async_save: bool = False,
        train_config: dict | None = None,
        timeout: float | None = None,
    ):
        self.save_dir, self.keep, self.async_save, self.train_config = save_dir, keep, async_save, train_config
        # A group made without a timeout waits torch's default (30 minutes) for a peer, not the world's.
        if timeout is not None and abs((mpu.group_timeout() or float("inf")) - timeout) > 1e-6:
            raise ValueError(
                f"Checkpointer: timeout {timeout} s differs from the {mpu.group_timeout()} s that "
                "megakernels.parallel.initialize gave the checkpoint group"
            )
        self.group = mpu.checkpoint_group()
        self._lock = None
        self.failures = 0  # saves that failed in a row (reset by one that succeeds)
        outcome = [None, None]
        if dist.get_rank() == 0:
            try:
                self._lock = store.DirectoryLock(save_dir, error=checkpoint.CheckpointError).acquire()
                outcome[1] = self._lock.took_over
            except checkpoint.CheckpointError as e:
                outcome[0] = str(e)
        dist.broadcast_object_list(outcome, src=0, group=self.group)
        if outcome[0] is not None:
            self.group = None
            raise checkpoint.CheckpointError(outcome[0])
        if outcome[1] and dist.get_rank() == 0:
            print(
                f"megakernels train: note: took over {save_dir}'s lock from a job that is gone ({outcome[1]})",
                flush=True,
            )
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "checkpoint-writer") if async_save else None
        self._pending: tuple[int, concurrent.futures.Future] | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        self._digests: dict[str, bytes] = {}  # of the last checkpoint this run committed
        self._last: str | None = None

    # ---- saving -------------------------------------------------------------------------------------------------

    def save(self, step: int, chunks, opt, config) -> str | None:
        """Save the checkpoint of ``step`` (collective; every rank calls it). Returns the error of the previous
        asynchronous save if it failed (else None).

        Raises:
            CheckpointError and DCP's errors: a synchronous save that failed.
        """
        error = self.wait()
        stage = self._stage if self.async_save else None
        sd = checkpoint.state_to_save(step, chunks, opt, config, self.train_config, stage=stage)
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException; DCP: a save imports it

        if not self.async_save:
            try:
                self._write(sd, step)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported; training goes on
                return self._failed(step, e)
            self.failures = 0
            return error
        if any(b.is_pinned() for b in self._buffers.values()):
            torch.cuda.current_stream().synchronize()  # the non-blocking device-to-host copies have landed
        self._pending = (step, self._pool.submit(self._write, sd, step))
        return error

    def _stage(self, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            self._buffers[key] = buf
        buf.copy_(t, non_blocking=t.is_cuda)
        return buf

    def _write(self, sd: dict, step: int) -> str:
        digests = {k: d for k, d in ((k, _digest(v)) for k, v in sd.items()) if d is not None}
        reuse = self._unchanged(digests) if self._last is not None else set()
        path = checkpoint.write(
            {k: v for k, v in sd.items() if k not in reuse},
            self.save_dir,
            step,
            keep=self.keep,
            train_config=self.train_config,
            group=self.group,
            reuse=reuse,
            previous=os.path.join(self.save_dir, self._last) if reuse else None,
        )
        self._digests, self._last = digests, os.path.basename(path)
        return path

    def _unchanged(self, digests: dict[str, bytes]) -> set[str]:
        """The entries unchanged since the last checkpoint on every rank that holds them (collective)."""
        same = {k for k, d in digests.items() if self._digests.get(k) == d}
        views = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(views, (same, set(digests) - same), group=self.group)
        unchanged = set().union(*(s for s, _ in views))
        return unchanged - set().union(*(c for _, c in views))

    # ---- the save in flight -------------------------------------------------------------------------------------

    def poll(self) -> str | None:
        """If the asynchronous save in flight has finished: None when it succeeded, else its error (as a line)."""
        if self._pending is None or not self._pending[1].done():
            return None
        return self.wait()

    def wait(self) -> str | None:
        """Wait for the save in flight; None when it succeeded (or there is none), else its error (as a line)."""
        if self._pending is None:
            return None
        step, future = self._pending
        self._pending = None
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException; imported by the save

        try:
            future.result()
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported to the trainer, which carries on
            return self._failed(step, e, "asynchronous ")
        self.failures = 0
        return None

    def _failed(self, step: int, e: BaseException, kind: str = "") -> str:
        """Count a failed save; its one-line report."""
        self.failures += 1
        latest = store.find_latest(self.save_dir)
        kept = f"{os.path.basename(latest)} stays latest" if latest else "there is no checkpoint yet"
        text = str(e) if isinstance(e, checkpoint.CheckpointError) else checkpoint.describe_error(e)
        return f"the {kind}save of step {step} failed ({text}); {kept}"

    def close(self, raise_error: bool = True) -> None:
        """Wait for the last save, release the writer thread and the process group (which
        ``megakernels.parallel.destroy`` destroys; idempotent).

        Raises:
            CheckpointError: the last asynchronous save failed (with ``raise_error``).
        """
        try:
            error = self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            self.group = None  # megakernels.parallel.destroy() destroys it
            if self._lock is not None:
                self._lock.release()
                self._lock = None
        if error and raise_error:
            raise checkpoint.CheckpointError(error)
