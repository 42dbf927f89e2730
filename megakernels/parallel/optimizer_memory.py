"""Bytes per parameter of ``ParallelOptimizer``'s state, by precision, ZeRO-1 and CPU offload: the figures the dry
run and ``megakernels plan`` use, and that ``ParallelOptimizer.memory_bytes`` measures on the tensors (the tests
check one against the other)."""

from __future__ import annotations

from megakernels.precisions import DTYPES
from megakernels.validation import positive_int


def memory_bytes_per_param(
    precision: str, distributed: bool, dp: int = 1, offload: bool = False
) -> tuple[float, float, float]:
    """Device bytes per parameter on one rank as ``(params, grads, optimizer state)`` with fp32 ``main_grad``
    buffers, Megatron-LM's accounting: fp32 params 4 + 4 + 8 (two moments); bf16/fp16 params 2 + 4 + 12 (fp32 master
    and two moments); the optimizer state divided by ``dp`` when ``distributed`` (ZeRO-1). With ``offload`` the
    optimizer state is in host memory (``host_bytes_per_param``): 0 on the device.

    Raises:
        ValueError: an unknown ``precision`` or ``dp < 1``.
    """
    if precision not in DTYPES:
        raise ValueError(f"memory_bytes_per_param: precision must be one of {list(DTYPES)}, got {precision!r}")
    positive_int(dp, "dp", where="memory_bytes_per_param")
    half = precision != "fp32"
    optimizer = 0.0 if offload else 12.0 if half else 8.0
    return (2.0 if half else 4.0), 4.0, optimizer / dp if distributed else optimizer


def grads_summed(world: int, microbatches: int, chunks: int, half: bool, offload: bool) -> bool:
    """Whether the data-parallel gradient buffers need fp32: something is summed into them (another process's
    gradients, a second micro-batch, a second model chunk's copy of a shared weight) or the params are fp32 or the
    optimizer is offloaded. Otherwise the trainer keeps them in the params' 16 bits (each param's one gradient of the
    step, the same values; ``megakernels_models.training.train.main_grad_dtype``): 2 bytes a parameter, not 4."""
    return not (world == 1 and microbatches == 1 and chunks == 1 and half and not offload)


def host_bytes_per_param(distributed: bool, dp: int = 1) -> float:
    """Host bytes per parameter of one rank with ``offload``: an fp32 master, two fp32 moments and an fp32 gradient
    copy, 16 (any precision: an fp32 parameter also gets a host master, the device copy being the model's), divided
    by ``dp`` when ``distributed``."""
    positive_int(dp, "dp", where="host_bytes_per_param")
    return 16.0 / dp if distributed else 16.0


def muon_bytes_per_param(precision: str, distributed: bool, dp: int = 1, sharded: bool = False) -> float:
    """Device bytes of optimizer state per parameter that Muon steps (``megakernels.parallel.muon``): its fp32
    momentum (4), plus the fp32 master (4) of a 16-bit parameter; divided by ``dp`` when ``distributed`` (ZeRO-1:
    the owners' momenta, the pieces' masters). ``sharded`` (FSDP: the sharded fp32 parameters are the masters):
    the momentum only, over ``dp``.

    Raises:
        ValueError: an unknown ``precision`` or ``dp < 1``.
    """
    if precision not in DTYPES:
        raise ValueError(f"muon_bytes_per_param: precision must be one of {list(DTYPES)}, got {precision!r}")
    positive_int(dp, "dp", where="muon_bytes_per_param")
    if sharded:
        return 4.0 / dp
    state = 8.0 if precision != "fp32" else 4.0
    return state / dp if distributed else state
