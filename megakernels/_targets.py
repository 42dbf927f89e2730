"""The CUDA build's flags, written once: setup.py (which loads this file by path: it runs before the package is
installed) and the tools that compile the kernels as the build does read them here. The architectures' limits are
in ``megakernels.machines``. Standard library only.
"""

from __future__ import annotations

# nvcc flags of csrc/<family>/<family>_cuda.cu, before the -gencode of each architecture.
NVCC_FLAGS = ("-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo")


def gencode(arch: int | str) -> list[str]:
    """nvcc's flags to build SASS for ``sm_<arch>`` (``arch``: 90, "9.0" or "90")."""
    arch = str(arch).strip().replace(".", "")
    return ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
