"""Refuse a model that cannot fit, before anything is allocated: ``megakernels train`` compares the dry-run's memory
estimate (``costs.memory``: weights, gradients, optimizer state and activations per device, on the meta device) with
what this machine can give, and stops with both numbers instead of an allocator traceback, or an OOM kill minutes
later with no message at all.

- On the CPU every local rank (``--nproc``, or torchrun's ``LOCAL_WORLD_SIZE``) lives in this machine's memory:
  ranks × the per-device estimate (plus the host optimizer state of ``--offload-optimizer``) must fit the memory
  available to the processes, the least of ``MemAvailable`` in ``/proc/meminfo`` and this cgroup's limit
  (``memory.max`` of cgroup v2, ``memory.limit_in_bytes`` of v1, the process's cgroup and its ancestors); one rank's
  share must also fit ``RLIMIT_AS``, the address-space limit of each process.
- On CUDA the per-device estimate must fit the device's free memory (``torch.cuda.mem_get_info`` of the rank's
  GPU); the host optimizer state of ``--offload-optimizer`` is checked against the host as above.

The estimate leaves out what every process has besides the model (the CUDA context, allocator slack, Python), so it
only refuses what cannot fit. ``--no-memory-check`` skips the check (an estimate can be wrong for a new shape);
``--dry-run`` never needs it. It runs where the arguments are validated before the world starts: in a process that
already holds a ``torch.distributed`` world (a caller that made its own) the meta model cannot be built, and the
check is left to that caller.
"""

from __future__ import annotations

import os
import resource

from megakernels_models.models.config import human
from megakernels_models.settings import ArgumentError

MEMINFO = "/proc/meminfo"
PROC_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"
# cgroup v1 writes "no limit" as the largest page-aligned int64
_V1_UNLIMITED = 1 << 62


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except (OSError, ValueError):
        return None


def _mem_available() -> int | None:
    for line in (_read(MEMINFO) or "").splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            return int(parts[1]) * 1024 if len(parts) >= 2 and parts[1].isdigit() else None
    return None


def _cgroup_limit() -> tuple[int, str] | None:
    """The smallest memory limit of this process's cgroup and its ancestors (v2, else v1), with the file."""
    best = None
    for line in (_read(PROC_CGROUP) or "").splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":
            base, name = CGROUP_ROOT, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = os.path.join(CGROUP_ROOT, "memory"), "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):  # a container often sees only its own root
            file = os.path.join(base, *parts[:depth], name)
            text = _read(file)
            if text and text.isdigit() and int(text) < _V1_UNLIMITED and (best is None or int(text) < best[0]):
                best = (int(text), file)
    return best


def host_memory() -> dict:
    """What this machine gives the training processes: ``{"available": (bytes, source) | None, "per_process":
    (bytes, source) | None}`` (None: nothing readable or no limit). The tests replace this function."""
    candidates = []
    avail = _mem_available()
    if avail is not None:
        candidates.append((avail, f"MemAvailable in {MEMINFO}"))
    cgroup = _cgroup_limit()
    if cgroup is not None:
        candidates.append((cgroup[0], f"the cgroup limit {cgroup[1]}"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return {
        "available": min(candidates) if candidates else None,
        "per_process": (soft, "RLIMIT_AS (ulimit -v)") if soft != resource.RLIM_INFINITY else None,
    }


def device_memory(index: int) -> tuple[int, int]:
    """``(free, total)`` bytes of CUDA device ``index`` (``torch.cuda.mem_get_info``). The tests replace this."""
    import torch

    return torch.cuda.mem_get_info(index)


def estimate(args, cfg) -> dict:
    """The dry run's memory model for trainer arguments ``args`` and model ``cfg``: ``{"device": bytes per device
    (the most loaded stage), "host": host optimizer bytes per rank (``--offload-optimizer``, else 0)}``."""
    from megakernels_models.planning import costs

    mem = costs.memory(costs.MetaModel(cfg), costs.Layout.of(args, cfg))
    return {"device": mem["total"], "host": mem["host_optimizer_bytes"] if args.offload_optimizer else 0.0}


def weight_bytes(args, cfg) -> float:
    """A lower bound of the bytes of ``cfg``'s weights in the training's parameter dtype, counted from the shapes
    without building anything: the linear layers' weights (the active experts' for a MoE layer) and the word
    embedding once, as ``ModelConfig.forward_flops_per_token`` counts them (2 FLOPs a weight a token); biases,
    norms, the position table, the vocabulary's padding and an untied output layer left out."""
    import torch

    flops = cfg.forward_flops_per_token()
    return (flops["layers_gemm"] + flops["head"]) / 2 * torch.empty((), dtype=args.param_dtype()).element_size()


def _check_weights(args, cfg, ranks: int, host: dict, skip: str) -> None:
    """Refuse a model whose weights alone cannot fit (for sizes the meta model cannot be built at): the machine's
    ranks hold at least their share of one copy of the weights."""
    share = weight_bytes(args, cfg) / max(1, args.world_size())
    what = f"its weights alone in {args.base_precision()}, counted from the model's sizes"
    if args.device == "cpu" and host["available"] is not None and ranks * share > host["available"][0]:
        limit, source = host["available"]
        raise ArgumentError(
            f"the model needs at least {human(ranks * share, 'B')} of memory ({what}) but this machine has "
            f"{human(limit, 'B')} available ({source}){skip}"
        )
    if args.device == "cuda":
        _check_gpu(f"at least {human(share, 'B')}", share, what, skip)


def _check_gpu(amount: str, need: float, what: str, skip: str) -> None:
    """Refuse ``need`` bytes per GPU (said as ``amount``, for ``what``) more than this rank's GPU has free."""
    index = int(os.environ.get("LOCAL_RANK", "0"))
    free, total = device_memory(index)
    if need > free:
        raise ArgumentError(
            f"the model needs {amount} per GPU ({what}) but cuda:{index} has {human(free, 'B')} free of "
            f"{human(total, 'B')}{skip}"
        )


def check(args, cfg) -> None:
    """Refuse ``args``/``cfg`` when the estimate is more than this machine has (see the module docstring). Sizes
    whose weights even the meta device cannot describe (a tensor past 2**63 bytes) are refused by the same rule,
    the weights alone counted from the sizes (``weight_bytes``).

    Raises:
        ArgumentError: one line with the estimate, the limit and where the limit was read, and ``--no-memory-check``.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return  # the meta model needs a world of its own; the caller that made this one validated before it
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or args.world_size())
    host = host_memory()
    skip = "; --no-memory-check trains anyway"
    try:
        need = estimate(args, cfg)
    except ArgumentError:  # sizes past what even the meta device describes: the weights alone do not fit
        _check_weights(args, cfg, ranks, host, skip)
        raise
    on_host = need["device"] + need["host"] if args.device == "cpu" else need["host"]
    what = "model state and activations" if args.device == "cpu" else "host optimizer state (--offload-optimizer)"
    if on_host and host["available"] is not None and ranks * on_host > host["available"][0]:
        limit, source = host["available"]
        raise ArgumentError(
            f"the model needs about {human(ranks * on_host, 'B')} of memory ({ranks} rank(s) × "
            f"{human(on_host, 'B')} of {what}, the --dry-run estimate) but this machine has "
            f"{human(limit, 'B')} available ({source}){skip}"
        )
    if on_host and host["per_process"] is not None and on_host > host["per_process"][0]:
        limit, source = host["per_process"]
        raise ArgumentError(
            f"each rank needs about {human(on_host, 'B')} of memory ({what}, the --dry-run estimate) "
            f"but a process may use {human(limit, 'B')} ({source}){skip}"
        )
    if args.device == "cuda":
        what = "model state and activations, the --dry-run estimate"
        _check_gpu(f"about {human(need['device'], 'B')}", need["device"], what, skip)
