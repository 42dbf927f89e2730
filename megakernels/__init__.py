"""megakernels: fused C++/CUDA/Triton kernels for training large Transformers the Megatron-LM way.

- ``megakernels.ops``   functional fused ops (torch.library custom ops: autograd, torch.compile, fake tensors)
- ``megakernels.nn``    drop-in modules built on them
- ``megakernels.optim`` FusedAdamW and multi-tensor utilities (L2 norm, gradient clipping)
- ``megakernels.parallel`` tensor/sequence parallelism: process groups, mappings, parallel layers and blocks
- ``megakernels.backend(name)`` selects ``auto``/``cpu``/``cuda``/``cuda_emu`` (docs/design.md §3)
- ``megakernels.cpu_isa()`` the instruction set the CPU kernels run (chosen at run time in a portable build)
"""

from megakernels._backend import BACKENDS, backend, cpu_isa, current_backend, has_backend

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "backend",
    "cpu_isa",
    "current_backend",
    "has_backend",
    "ops",
    "nn",
    "optim",
    "parallel",
    "__version__",
]


def __getattr__(name):
    # Submodules load on first use so that `import megakernels` stays cheap.
    if name in ("ops", "nn", "optim", "parallel", "triton"):
        import importlib

        return importlib.import_module(f"megakernels.{name}")
    raise AttributeError(f"module 'megakernels' has no attribute {name!r}")
