"""Optional split of each training step's time into phases, and peak memory, for ``megakernels bench --e2e``.

Off unless ``TrainArgs.step_timers`` is set; then the trainer calls ``start()`` at the top of a step, runs every
forward through ``wrap_forward``, calls ``mark(phase)`` after the pipeline, the gradient finalisation and the
optimizer step, and ``finish(record)`` at the end (on every rank: ranks exchange their numbers there). Disabled,
each call returns at once.

Phases of one optimizer step, on each rank:

- ``forward``: time inside the trainer's ``forward_step`` (every micro-batch's forward, the loss included; tensor-
  parallel collectives inside the layers count here, they are not separable without a profiler);
- ``bubble``: time blocked in pipeline exchanges (the executor's ``exchange_hook``): waiting for the neighbouring stage
(the
  pipeline bubble) plus the transfers themselves, which on one node are the small part;
- ``backward``: the rest of the pipeline phase: the backward passes (with their tensor-parallel collectives and the
  launch of the overlapped data-parallel bucket reductions), plus zeroing the gradient buffers, batch assembly and
  the loss all-reduce (small);
- ``communication``: ``finalize_model_grads``: the data-parallel gradient reduction not hidden behind backward and
  the tied-embedding / sequence-parallel gradient sums (waiting there for a slower rank, e.g. the other end of
  the pipeline for the tied embedding, counts here too);
- ``optimizer``: ``opt.step()``: loss-scale check, global grad-norm (an all-reduce), AdamW, and under ZeRO-1 the
  parameter all-gather.

Clocks: CUDA events on the current stream on a GPU (resolved once per step, in ``finish``), ``perf_counter`` on
the CPU. Peak memory since the timers were created: ``torch.cuda.max_memory_allocated`` on a GPU, the process's
peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``) on the CPU.

The exchanges are timed through the pipeline executor's ``exchange_hook`` (``forward_backward(...,
exchange_hook=timers.exchange_hook)``), which wraps the exchange function of one step.
"""

from __future__ import annotations

import resource
import time

import torch
import torch.distributed as dist

PHASES = ("forward", "backward", "bubble", "communication", "optimizer")
FIELDS = (*PHASES, "total", "peak_memory_bytes")


def _rss_peak_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def _reset_rss_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set (Linux >= 4.0)
    except OSError:
        pass


class StepTimers:
    """Per-step phase times and peak memory of this rank (see the module docstring); a no-op when disabled."""

    def __init__(self, enabled: bool, device: torch.device, clock=time.perf_counter):
        """``clock``: seconds on the host (CPU runs; a GPU's phases are timed by CUDA events)."""
        self.enabled, self.device, self._clock = bool(enabled), torch.device(device), clock
        if not self.enabled:
            return
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_rss_peak()
        self._active, self._marks, self._spans = False, {}, {"forward": [], "bubble": []}

    def _now(self):
        if self._cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return self._clock()

    def _seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self._cuda else b - a

    def _timed(self, fn, span: str):
        def timed(*args, **kwargs):
            if not self._active:
                return fn(*args, **kwargs)
            t0 = self._now()
            try:
                return fn(*args, **kwargs)
            finally:
                self._spans[span].append((t0, self._now()))

        return timed

    def start(self) -> None:
        """The top of a training step."""
        if not self.enabled:
            return
        self._marks, self._spans = {"start": self._now()}, {"forward": [], "bubble": []}
        self._active = True

    @property
    def exchange_hook(self):
        """For ``forward_backward(exchange_hook=...)``: times each pipeline exchange (None when disabled)."""
        return (lambda communicate: self._timed(communicate, "bubble")) if self.enabled else None

    def wrap_forward(self, forward_step):
        """``forward_step`` timed while a step is being timed (evaluation forwards are not)."""
        return self._timed(forward_step, "forward") if self.enabled else forward_step

    def mark(self, phase: str) -> None:
        """The end of ``phase``: ``"pipeline"`` (forward, backward, bubble), ``"communication"``, ``"optimizer"``."""
        if self.enabled and self._active:
            self._marks[phase] = self._now()

    def finish(self, record: dict | None) -> None:
        """End the step: every rank's phase seconds, total and peak memory go into ``record["step_timers"]``
        (``{"fields": FIELDS, "per_rank": [[...], ...]}``) when ``record`` is given (the logging rank).

        Called on every rank of the world (the numbers are gathered over it)."""
        if not self.enabled:
            return
        self._active = False
        if self._cuda:
            torch.cuda.synchronize(self.device)
        m = self._marks
        span = {k: sum(self._seconds(a, b) for a, b in v) for k, v in self._spans.items()}
        pipeline = self._seconds(m["start"], m["pipeline"])
        values = {
            "forward": span["forward"],
            "bubble": span["bubble"],
            "backward": max(0.0, pipeline - span["forward"] - span["bubble"]),
            "communication": self._seconds(m["pipeline"], m["communication"]),
            "optimizer": self._seconds(m["communication"], m["optimizer"]),
            "total": self._seconds(m["start"], m["optimizer"]),
            "peak_memory_bytes": float(
                torch.cuda.max_memory_allocated(self.device) if self._cuda else _rss_peak_bytes()
            ),
        }
        mine = torch.tensor(
            [values[f] for f in FIELDS], dtype=torch.float64, device=self.device if self._cuda else "cpu"
        )
        if dist.is_initialized() and dist.get_world_size() > 1:
            every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(every, mine)
        else:
            every = [mine]
        if record is not None:
            record["step_timers"] = {"fields": list(FIELDS), "per_rank": [t.tolist() for t in every]}
