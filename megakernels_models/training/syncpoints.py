"""Named points where a test can hold a training run: the deterministic way to act *during* something (a signal
in the middle of a run, a kill inside a checkpoint write) without sleeping and hoping to hit a window.

With ``MEGAKERNELS_SYNC_DIR=DIR`` in the environment (spawned ranks inherit it), ``reach(name)`` on rank ``r``
writes ``DIR/<name>.<r>`` (holding the process id) and then, while ``DIR/<name>.hold`` exists, waits for it to be
removed. A test creates the ``.hold`` file, starts the run, waits for the ``.<r>`` files, acts (signals, kills),
and removes the ``.hold`` file to let the run go on. Without the variable ``reach`` returns at once. A held rank
keeps its watchdog fed (``megakernels.parallel.watchdog``, phase ``held at <name>``): a hold is not a hang.

The points the trainer marks:

- ``start``: a rank begins to set training up, before its stop signals' handlers exist (a spawned rank holds the
  signals until then);
- ``step-<N>``: after optimizer step N (1-based), before the stop conditions are checked;
- ``checkpoint-write-<N>``: inside torch.distributed.checkpoint's write of the checkpoint of step N, after this
  rank's data files are written and before the metadata (the commit) is: in the writer thread for ``--async-save``;
- ``checkpoint-failed-<N>``: the save of step N failed and its temporary directory is removed (``note``);
- ``signal``: the exit signal arrived (``note``: never held).
"""

from __future__ import annotations

import os
import time

import torch.distributed as dist

from megakernels.parallel import watchdog

ENV = "MEGAKERNELS_SYNC_DIR"
_POLL_S = 0.002


def _root() -> str | None:
    return os.environ.get(ENV) or None


def note(name: str) -> None:
    """Record that this rank passed ``name`` (``DIR/<name>.<rank>``), without holding."""
    root = _root()
    if root is None:
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = os.path.join(root, f"{name}.{rank}")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)  # a watcher never reads a half-written file


def reach(name: str) -> None:
    """Record that this rank reached ``name`` and wait while ``DIR/<name>.hold`` exists (see the module docstring)."""
    root = _root()
    if root is None:
        return
    note(name)
    hold = os.path.join(root, f"{name}.hold")
    if not os.path.exists(hold):
        return
    # A held rank is the test's doing, not a hang: it keeps its watchdog fed, then resumes the phase it was in
    # (unless another thread has reported a phase since: a hold in the asynchronous checkpoint writer).
    phase, holding = watchdog.current_phase(), f"held at {name}"
    while os.path.exists(hold):  # waiting on a condition the test controls, not on time
        watchdog.progress(holding)
        time.sleep(_POLL_S)
    if phase is not None and watchdog.current_phase() == holding:
        watchdog.progress(phase)
