"""Training precisions, written once: their names, the dtypes they compute in, and the dtype names benchmarks take.

``fp8`` trains the transformer blocks' linears in FP8 (``megakernels.ops.fp8.RECIPES``) on a 16-bit or fp32 base
precision; every other precision is one dtype. Importing this module does not import torch (command-line parsers
read the names); ``DTYPES`` imports it on first use.
"""

from __future__ import annotations

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
HALF = ("bf16", "fp16")  # the 16-bit precisions (mixed precision: fp32 master weights and optimizer state)
# torch's dtype names (what ``megakernels bench --dtype`` prints) -> the precision computing in that dtype
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def __getattr__(name: str):
    if name == "DTYPES":  # precision -> torch dtype
        import torch

        return {p: getattr(torch, n) for n, p in DTYPE_NAMES.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_of(name: str):
    """The torch dtype of a precision (``"bf16"``) or of a torch dtype name (``"bfloat16"``).

    Raises:
        ValueError: any other name (fp8 has no single dtype).
    """
    import torch

    precision = DTYPE_NAMES.get(name, name)
    if precision not in DTYPE_NAMES.values():
        known = ", ".join([*DTYPE_NAMES.values(), *DTYPE_NAMES])
        raise ValueError(f"precision must be one of {known}, got {name!r}")
    return getattr(torch, next(n for n, p in DTYPE_NAMES.items() if p == precision))
