"""The kernels ``megakernels bench --static`` reports: one entry per kernel x config x shape x dtype.

A family adds its kernels with a function decorated by ``@register`` that returns ``Entry`` objects; each entry's
``evaluate`` compiles (cached) and returns the measured resources and the prediction. Adding a kernel family is a
few lines in a module of this package (and its import in ``FAMILY_MODULES``).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

# Modules of this package that register entries (imported on first use).
FAMILY_MODULES = ["attention", "streaming", "elementwise", "gemm", "fp8", "muon"]

_BUILDERS: list[Callable[[], list]] = []


@dataclasses.dataclass
class Entry:
    """One kernel (or one pass of several launches) at one config, shape and dtype.

    ``evaluate()`` returns a dict with at least registers, spill_bytes, shared_bytes, mma, tma,
    instructions_per_element or instructions_per_iteration, and predicted_fraction. ``key``: among the shipped
    configs the test suite checks (no spills, shared memory that fits, wgmma where it must)."""

    name: str
    config: str
    shape: str
    dtype: str
    evaluate: Callable[[], dict]
    arch: int = 90
    family: str = ""
    key: bool = True
    needs_wgmma: bool = False
    bench: dict | None = None  # the `megakernels bench` row it predicts: {op, pass, shape, variant}

    def row(self) -> dict:
        """The JSON object of this entry: identity, then what ``evaluate`` measured (or its ``error``)."""
        head = {
            "name": self.name,
            "family": self.family,
            "config": self.config,
            "shape": self.shape,
            "dtype": self.dtype,
            "arch": f"sm_{self.arch}",
            "bench": self.bench,
        }
        try:
            return {**head, **self.evaluate()}
        except (RuntimeError, ValueError, OSError) as e:  # a kernel that cannot be analysed is reported, not fatal
            return {**head, "error": f"{type(e).__name__}: {e}"}


def register(builder: Callable[[], list]) -> Callable[[], list]:
    """Decorator: ``builder()`` returns this family's entries."""
    _BUILDERS.append(builder)
    return builder


def entries(families: list[str] | None = None) -> list[Entry]:
    """Every registered entry (of ``families`` when given), in registration order."""
    for mod in FAMILY_MODULES:
        importlib.import_module(f"costmodel.{mod}")
    out = [e for b in _BUILDERS for e in b()]
    return [e for e in out if families is None or e.family in families]
