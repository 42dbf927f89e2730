"""Pipeline parallelism: the model's layers split into stages on the ranks of ``state.pp_group()``, micro-batches
flowing through them (Megatron-LM; Narayanan et al. 2021).

- ``schedules``  the order of work per rank as data (``schedule_order``), its exchanges with the neighbours
                 (``communication_plan``), a timeline simulator (``simulate``, ``format_schedule``; also
                 ``python -m megakernels.parallel.pipeline.schedules --pp 4 --microbatches 8 [--vpp 2]``) and the
                 closed-form ``bubble_fraction``
- ``executor``   ``forward_backward``: one step of a schedule with the caller's ``forward_step``
- ``p2p``        activations and gradients between neighbouring stages, sends and receives batched together
- ``wgrad``      the zero-bubble schedules' deferred weight gradients (B computes input gradients, W the rest)
- ``memory``     a step's activation bytes, measured (``forward_backward(..., stats={})``)

Trade-offs, ``p`` stages, ``m`` micro-batches, ``v`` model chunks per rank:

============  ================  ====================================  ========================================
schedule      bubble            activations held (micro-batches)      cost
============  ================  ====================================  ========================================
gpipe         (p-1)/m           m                                     simplest; memory grows with m
1f1b          (p-1)/m           p - rank (at most p)                  the default
interleaved   (p-1)/(v·m)       up to p + (p-1-2·rank)/v              v times the messages; m % p == 0
zb-h1         (p-1)/(3m) (*)    p on every rank, until W              weight gradients deferred (W passes)
zb-v          (p-1)/(6m) (*)    p on every rank (2p half-chunks)      two chunks in a V; 2× the messages
forward_only  (p-1)/m           one at a time (no backward)           evaluation
============  ================  ====================================  ========================================

(*) at T_F = T_B = T_W (backward = 2 × forward, half of it weight gradients) and m >= p; ``simulate`` for others.

More micro-batches shrink the bubble of every schedule; only 1F1B (interleaving, the zero-bubble schedules) keep
memory bounded while doing so, which is why they are the ones used for training.
"""

__all__ = [
    "SCHEDULES",
    "ZERO_BUBBLE",
    "ALL_SCHEDULES",
    "schedule_order",
    "communication_plan",
    "Exchange",
    "bubble_fraction",
    "simulate",
    "format_schedule",
    "forward_backward",
    "p2p",
    "wgrad",
    "memory",
]

_HOME = {"forward_backward": "executor"}


def __getattr__(name):
    # Loaded on first use: `python -m megakernels.parallel.pipeline.schedules` must not find its own module
    # already imported by this package.
    import importlib

    if name in ("p2p", "wgrad", "memory"):
        return importlib.import_module(f"{__name__}.{name}")
    if name in __all__:
        return getattr(importlib.import_module(f"{__name__}.{_HOME.get(name, 'schedules')}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
