"""Loads the compiled library (megakernels._C), which registers the ``torch.ops.megakernels`` ops."""

from __future__ import annotations

try:
    from megakernels import _C  # noqa: F401
except ImportError as e:  # pragma: no cover - only without a build
    raise ImportError(
        "megakernels: the compiled extension megakernels._C is missing or does not load "
        f"({e}). Build it with `pip install --no-build-isolation -e .` (or `bash scripts/setup.sh`) "
        "against the torch you run with."
    ) from e
