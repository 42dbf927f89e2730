"""Random streams for tensor parallelism: dropout that must differ across TP ranks and dropout that must not.

Outside a tensor-parallel region every TP rank holds the same activations (the residual stream, or its sequence
shard under sequence parallelism, where each rank's tokens are distinct anyway), so dropout there must draw the
same mask on every TP rank — they use the default generator, seeded identically. Inside a TP region (attention
probabilities of this rank's heads) the ranks hold different slices of one tensor, and identical masks would
correlate the dropout of different heads; there dropout runs inside ``get_rng_tracker().fork()``, which swaps the
default generator of the device in use for a named stream seeded per TP rank, then swaps it back, leaving the
default stream exactly where it was (Megatron-LM's ``CudaRNGStatesTracker``, here for CPU and CUDA generators).

    model_parallel_seed(1234)                 # default stream: 1234 on all ranks; TP stream: 1234 + 2718 + tp_rank
    x = dropout(x)                            # same mask on every TP rank
    with get_rng_tracker().fork():
        p = dropout(attention_probs)          # a different mask per TP rank
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint

from megakernels.parallel import state
from megakernels.validation import positive_int

MODEL_PARALLEL_RNG = "model-parallel-rng"
_TP_SEED_OFFSET = 2718


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _get_state(device: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()


def _set_state(device: str, s: torch.Tensor) -> None:
    if device == "cuda":
        torch.cuda.set_rng_state(s)
    else:
        torch.set_rng_state(s)


def _seeded_state(device: str, seed: int) -> torch.Tensor:
    """The generator state ``seed`` produces on ``device``, without disturbing the current one."""
    saved = _get_state(device)
    try:
        if device == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)
        return _get_state(device)
    finally:
        _set_state(device, saved)


class RNGStatesTracker:
    """Named generator states for one device type (``"cpu"`` or ``"cuda"``, the current CUDA device).

    ``add(name, seed)`` creates a stream; ``fork(name)`` runs a block with the default generator of the device set
    to that stream and saves the advanced stream when the block ends (also on an exception).
    """

    def __init__(self, device: str | None = None):
        device = _default_device() if device is None else device
        if device not in ("cpu", "cuda"):
            raise ValueError(f"RNGStatesTracker: device must be 'cpu' or 'cuda', got {device!r}")
        self.device = device
        self.reset()

    def reset(self) -> None:
        """Forget every stream."""
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()

    def add(self, name: str, seed: int) -> None:
        """Create the stream ``name`` from ``seed``.

        Raises:
            ValueError: ``name`` already exists, or ``seed`` is already used by another stream (two streams with
                one seed would draw the same masks).
        """
        if name in self._states:
            raise ValueError(f"RNGStatesTracker.add: stream {name!r} already exists")
        if seed in self._seeds:
            raise ValueError(f"RNGStatesTracker.add: seed {seed} is already used by another stream")
        self._states[name] = _seeded_state(self.device, seed)
        self._seeds.add(seed)

    def names(self) -> list[str]:
        return list(self._states)

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every stream's state (for checkpoints)."""
        return {k: v.clone() for k, v in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the streams' states (from ``get_states``)."""
        self._states = {k: v.clone() for k, v in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block on stream ``name`` instead of the device's default generator.

        Raises:
            KeyError: no stream ``name`` (``model_parallel_seed`` or ``add`` first).
        """
        if name not in self._states:
            raise KeyError(
                f"RNGStatesTracker.fork: no stream {name!r}; call model_parallel_seed(seed) or "
                f"add({name!r}, seed) first (streams: {self.names()})"
            )
        saved = _get_state(self.device)
        _set_state(self.device, self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_state(self.device)
            _set_state(self.device, saved)


_tracker: RNGStatesTracker | None = None


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (for CUDA generators when CUDA is available, else the CPU generator)."""
    global _tracker
    if _tracker is None:
        _tracker = RNGStatesTracker()
    return _tracker


def model_parallel_seed(seed: int, device: str | None = None) -> None:
    """Seed the default generator of ``device`` with ``seed`` (identical on every TP rank) and the tracker's
    ``"model-parallel-rng"`` stream with ``seed + 2718 + tp_rank()`` (distinct per TP rank).

    Needs ``initialize``; resets the tracker (replacing it when ``device`` differs from its device). Seeds only
    ``device``'s generator (``"cuda"`` when available, else ``"cpu"``), so weight initialisation, which draws from
    the CPU generator, is untouched on a CUDA machine.

    Raises:
        ValueError: ``seed`` not a non-negative int, or an unknown ``device``.
        RuntimeError: ``initialize`` has not run.
    """
    global _tracker
    positive_int(seed, "seed", where="model_parallel_seed", minimum=0)
    device = _default_device() if device is None else device
    tracker = get_rng_tracker()
    if tracker.device != device:
        tracker = _tracker = RNGStatesTracker(device)
    tp_seed = seed + _TP_SEED_OFFSET + state.tp_rank()
    tracker.reset()
    if device == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)
    tracker.add(MODEL_PARALLEL_RNG, tp_seed)


def checkpoint(fn, *args):
    """``fn(*args)`` without saving its activations: backward runs it again (activation recomputation).

    The recomputation must draw the same dropout masks as the original forward, on the default generators and on
    the tracker's per-TP-rank streams alike. ``torch.utils.checkpoint`` replays the default CPU/CUDA generators;
    this adds the tracker: its streams are rewound to where they were when the forward started, for the
    recomputation only, and put back afterwards, so the streams also continue exactly as without recomputation.
    """
    tracker = get_rng_tracker()
    at_forward: dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def forward_context():
        at_forward.update(tracker.get_states())
        yield

    @contextlib.contextmanager
    def recompute_context():
        now = tracker.get_states()
        tracker.set_states(at_forward)
        try:
            yield
        finally:
            tracker.set_states(now)

    return torch.utils.checkpoint.checkpoint(
        fn,
        *args,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=lambda: (forward_context(), recompute_context()),
    )
