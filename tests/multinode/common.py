"""What the multi-node checks share: the model and batch (the layout suite's), the environment of a run, the JSONL
log's losses and layouts, and the comparison with the single process's curve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RTOL = 1e-5  # fp32, dropout 0: as tests/models/test_layouts.py
DEADLINE_S = 300.0
# The layout suite's model and batch (tests/models/test_layouts.py's BASE), as flags.
FLAGS = [
    "--preset",
    "none",
    "--model",
    "gpt",
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-heads",
    "4",
    "--seq-length",
    "16",
    "--dropout",
    "0",
    "--steps",
    "6",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--lr",
    "5e-3",
    "--min-lr",
    "5e-4",
    "--warmup-steps",
    "2",
    "--clip-grad",
    "0.5",
    "--eval-interval",
    "0",
    "--corpus-bytes",
    "262144",
    "--seed",
    "7",
    "--no-progress",
]


def wait_until(done, timeout: float, what, interval: float = 0.1, give_up=None) -> float | None:
    """Poll ``done()`` every ``interval`` s until it is true; the monotonic time it was. There is no event to wait
    on across network namespaces and Slurm daemons, so the checks poll an external condition under a deadline.
    ``give_up()`` true (a process the condition waits on exited): None, unless ``done()`` holds then.

    Raises:
        TimeoutError: ``done()`` still false after ``timeout`` s; the message names ``what`` (a string, or a
            callable for a message that reports the state at that moment)."""
    deadline = time.monotonic() + timeout
    while True:
        if done():
            return time.monotonic()
        if give_up is not None and give_up():
            return time.monotonic() if done() else None
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what() if callable(what) else what} after {timeout:g} s")
        time.sleep(interval)


def env(**extra) -> dict:
    """This process's environment for a run: this checkout first on the path, one thread a rank, nothing of an
    enclosing torchrun job or sync directory."""
    out = dict(os.environ, OMP_NUM_THREADS="1")
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    for k in (
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
        "MEGAKERNELS_SYNC_DIR",
    ):
        out.pop(k, None)
    out.update(extra)
    return out


def train(flags: list[str], **kw) -> subprocess.CompletedProcess:
    """``megakernels train`` in this process's host (one node), to the end."""
    return subprocess.run(
        [sys.executable, "-m", "megakernels_models.cli", "train", *flags],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        env=kw.pop("env", env()),
        **kw,
    )


def steps(path) -> dict[int, float]:
    """step -> loss of a JSONL log (a step logged by two attempts: the later)."""
    out = {}
    with open(path) as f:
        for rec in map(json.loads, f):
            if "loss" in rec:
                out[rec["step"]] = rec["loss"]
    return out


def layouts(path) -> list[dict]:
    """The ``layout`` of each launch that logged into ``path``, in order."""
    with open(path) as f:
        return [rec["layout"] for rec in map(json.loads, f) if "layout" in rec]


def compare(got: dict[int, float], reference: dict[int, float], which) -> float:
    """Assert the losses of the steps ``which`` equal the reference's to RTOL; the largest relative difference."""
    assert sorted(got) == list(which), (sorted(got), list(which))
    worst = 0.0
    for s in which:
        diff = abs(got[s] - reference[s]) / abs(reference[s])
        assert diff <= RTOL, (s, got, reference)
        worst = max(worst, diff)
    return worst


def record(check: str, **figures) -> None:
    """Append one check's figures to ``$MEGAKERNELS_MULTINODE_RECORD`` (a JSON-lines file the script turns into
    the results report); nothing without it."""
    path = os.environ.get("MEGAKERNELS_MULTINODE_RECORD")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"check": check, "time": time.time(), **figures}) + "\n")
