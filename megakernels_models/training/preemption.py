"""Stopping a run cleanly: on a signal (preemption, Ctrl-C), after N steps, or after M minutes — every rank
finishes the step it is in, the trainer saves a checkpoint, and the process exits 0 saying where it saved.

The signal (``--exit-signal``, SIGTERM by default; SIGUSR1 is what Slurm's ``--signal`` sends ahead of a time
limit) only sets a flag: the handler never raises, so a signal can arrive anywhere (inside a collective, inside a
checkpoint write) and a second one during the save changes nothing. SIGINT (a terminal's Ctrl-C) stops the same
way whatever ``--exit-signal`` is; a second SIGINT to the process raises ``KeyboardInterrupt``: the run ends at
once, without saving (checkpoints are written atomically: the latest complete one stays). At each step boundary
``should_stop`` decides for the whole world: the flag and the elapsed time are combined by one MAX all-reduce, so a
signal that reached one rank, or reached the ranks at different steps, stops every rank after the same step (a rank
that stopped alone would leave the others waiting in the next step's collectives). ``--exit-interval`` depends on
the step only and needs no agreement.

The ranks a launcher spawns hold these signals blocked from their start (``megakernels.parallel.launch``): entering
``StopConditions`` installs the handlers and unblocks them, so a signal sent while a rank was still starting up is
delivered then, and stops the run after its first step; leaving restores the mask and the handlers.
"""

from __future__ import annotations

import signal
import threading
import time

import torch
import torch.distributed as dist

from megakernels_models.training import syncpoints

SIGNALS = ("SIGTERM", "SIGUSR1", "none")


def stop_signals(exit_signal: str) -> tuple[int, ...]:
    """The signals a run stops on: ``exit_signal`` (unless ``"none"``) and SIGINT.

    Raises:
        ValueError: an unknown ``exit_signal``.
    """
    if exit_signal not in SIGNALS:
        raise ValueError(f"--exit-signal must be one of {', '.join(SIGNALS)}, got {exit_signal!r}")
    return tuple(dict.fromkeys(([] if exit_signal == "none" else [getattr(signal, exit_signal)]) + [signal.SIGINT]))


class StopConditions:
    """The stop conditions of a run; install the signal handler with ``with StopConditions(...) as stop:``.

    Args:
        exit_signal: ``"SIGTERM"``, ``"SIGUSR1"`` or ``"none"`` (no handler: the signal's default action); SIGINT
            is always handled (module docstring).
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
        self.signals = stop_signals(exit_signal)
        self.exit_interval, self.exit_duration_mins, self.device = exit_interval, exit_duration_mins, device
        self.t0 = time.monotonic()
        self.received = 0  # signals received (a count: tests see the second one arrive)
        self.first: int | None = None  # the first signal received (its number)
        self._interrupts = 0
        self._previous: dict = {}
        self._mask = None

    def __enter__(self) -> StopConditions:
        # Python runs handlers in the main thread only; elsewhere (a test's thread) the signals keep their action.
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._on_signal) for sig in self.signals}
            self._mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signals)  # held since the rank started
        return self

    def __exit__(self, *exc) -> None:
        if self._mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)
            self._mask = None
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts > 1:  # a second Ctrl-C: now, without saving
                raise KeyboardInterrupt
        self.received += 1
        if self.first is None:
            self.first = signum
        syncpoints.note("signal")

    def should_stop(self, step: int) -> str | None:
        """After optimizer step ``step`` (1-based): why the run stops now (the same answer on every rank: the
        highest-numbered first signal of any rank), or None. Collective over the world, so every rank calls it."""
        minutes = (time.monotonic() - self.t0) / 60.0
        flags = torch.tensor([float(self.first or 0), minutes], dtype=torch.float64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        got_signal, minutes = flags.tolist()
        if got_signal:
            return signal.Signals(int(got_signal)).name
        if self.exit_duration_mins is not None and minutes >= self.exit_duration_mins:
            return f"--exit-duration-mins {self.exit_duration_mins:g} ({minutes:.1f} minutes)"
        if self.exit_interval and step % self.exit_interval == 0:
            return f"--exit-interval {self.exit_interval}"
        return None
