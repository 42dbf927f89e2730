"""This machine as results and caches name it (the host; the GPUs it may have are megakernels.machines): the CPU's
model and instruction-set flags, and the cache folder.

- ``cpu()``: ``{"model", "flags"}`` of the first processor in ``/proc/cpuinfo`` (``model name`` and ``flags``;
  ``Features`` and the implementer/part numbers on Arm), else ``lscpu``'s ``Model name`` and ``Flags``, else
  ``platform.processor()`` and no flags. Every benchmark result the package writes records both
  (``megakernels.bench.common.machine``): two machines sold as the same kind can differ in what their hypervisor
  exposes (AVX-512, AMX), and a figure means little without it.
- ``cpu_key()``: the model and a digest of the flags, for the caches of what was measured on this CPU (the fp32
  GEMM route of ``megakernels.ops.gemm``, the trainer's CPU peak).
- ``cache_dir()``: ``$MEGAKERNELS_CACHE``, else ``~/.cache/megakernels``.

Nothing here decides anything by vendor or model: measured choices are keyed by the CPU, never derived from it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import subprocess

CPUINFO = "/proc/cpuinfo"


def cache_dir() -> str:
    """``$MEGAKERNELS_CACHE`` if set, else ``~/.cache/megakernels`` (the folder of every cache of measurements)."""
    return os.environ.get("MEGAKERNELS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "megakernels")


def _from_cpuinfo(text: str) -> dict | None:
    """The first processor's model and flags from ``/proc/cpuinfo``'s text (None without a model)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough: the others repeat it
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    model = fields.get("model name") or fields.get("hardware") or fields.get("cpu model")
    if not model and "cpu implementer" in fields:  # Arm: no model name, the implementer and part numbers
        model = f"Arm implementer {fields['cpu implementer']} part {fields.get('cpu part', '?')}"
    if not model:
        return None
    return {"model": model, "flags": fields.get("flags") or fields.get("features") or ""}


def _from_lscpu() -> dict | None:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    fields = {}
    for line in out.stdout.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip().lower()] = value.strip()
    if not fields.get("model name"):
        return None
    return {"model": fields["model name"], "flags": fields.get("flags", "")}


@functools.cache
def cpu() -> dict:
    """``{"model": str, "flags": str}`` of this machine's CPU (module docstring; flags space-separated, "" when
    nothing lists them)."""
    try:
        with open(CPUINFO, encoding="utf-8", errors="replace") as f:
            found = _from_cpuinfo(f.read())
    except OSError:
        found = None
    found = found or _from_lscpu()
    return found or {"model": platform.processor() or platform.machine() or "unknown CPU", "flags": ""}


def cpu_key() -> str:
    """This CPU in a cache key: its model and the first 12 hex digits of the flags' SHA-256."""
    info = cpu()
    digest = hashlib.sha256(" ".join(sorted(info["flags"].split())).encode()).hexdigest()[:12]
    return f"{info['model']}|flags={digest}"
