"""Stopping a run cleanly: on a signal (preemption), after N steps, or after M minutes — every rank finishes the
step it is in, the trainer saves a checkpoint, and the process exits 0 saying where it saved.

The signal (``--exit-signal``, SIGTERM by default; SIGUSR1 is what Slurm's ``--signal`` sends ahead of a time
limit) only sets a flag: the handler never raises, so a signal can arrive anywhere (inside a collective, inside a
checkpoint write) and a second one during the save changes nothing. At each step boundary ``should_stop`` decides
for the whole world: the flag and the elapsed time are combined by one MAX all-reduce, so a signal that reached
one rank, or reached the ranks at different steps, stops every rank after the same step (a rank that stopped
alone would leave the others waiting in the next step's collectives). ``--exit-interval`` depends on the step only
and needs no agreement.
"""

from __future__ import annotations

import signal
import threading
import time

import torch
import torch.distributed as dist

from megakernels_models.training import syncpoints

SIGNALS = ("SIGTERM", "SIGUSR1", "none")


class StopConditions:
    """The stop conditions of a run; install the signal handler with ``with StopConditions(...) as stop:``.

    Args:
        exit_signal: ``"SIGTERM"``, ``"SIGUSR1"`` or ``"none"`` (no handler: the signal's default action).
        exit_interval: stop after every step that is a multiple of it (None: never).
        exit_duration_mins: stop after the first step that ends this many minutes after construction (None: never).
        device: where the agreement all-reduce's tensor lives (the process group's device; default the CPU).

    Raises:
        ValueError: an unknown ``exit_signal``.
    """

    def __init__(
        self,
        exit_signal: str = "SIGTERM",
        exit_interval: int | None = None,
        exit_duration_mins: float | None = None,
        device=None,
    ):
        if exit_signal not in SIGNALS:
            raise ValueError(f"--exit-signal must be one of {', '.join(SIGNALS)}, got {exit_signal!r}")
        self.signal = None if exit_signal == "none" else getattr(signal, exit_signal)
        self.exit_interval, self.exit_duration_mins, self.device = exit_interval, exit_duration_mins, device
        self.t0 = time.monotonic()
        self.received = 0  # signals received (a count: tests see the second one arrive)
        self._previous = None

    def __enter__(self) -> StopConditions:
        # Python runs handlers in the main thread only; elsewhere (a test's thread) the signal keeps its action.
        if self.signal is not None and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(self.signal, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(self.signal, self._previous)
            self._previous = None

    def _on_signal(self, signum, frame) -> None:
        self.received += 1
        syncpoints.note("signal")

    def should_stop(self, step: int) -> str | None:
        """After optimizer step ``step`` (1-based): why the run stops now (the same answer on every rank), or None.
        Collective over the world when a signal or a duration is watched, so every rank calls it."""
        if self.signal is not None or self.exit_duration_mins is not None:
            minutes = (time.monotonic() - self.t0) / 60.0
            flags = torch.tensor([float(self.received > 0), minutes], dtype=torch.float64, device=self.device)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            got_signal, minutes = flags.tolist()
            if got_signal:
                return signal.Signals(self.signal).name
            if self.exit_duration_mins is not None and minutes >= self.exit_duration_mins:
                return f"--exit-duration-mins {self.exit_duration_mins:g} ({minutes:.1f} minutes)"
        if self.exit_interval and step % self.exit_interval == 0:
            return f"--exit-interval {self.exit_interval}"
        return None
