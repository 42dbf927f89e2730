"""The GPU targets, written once: the nvcc flags of the CUDA build and each architecture's limits.

setup.py (which loads this file by path: it runs before the package is installed), the static cost model
(megakernels.bench.static) and the Triton compile check (megakernels.triton.compile_check) all read them here.
Standard library only.
"""

from __future__ import annotations

# nvcc flags of csrc/<family>/<family>_cuda.cu, before the -gencode of each architecture.
NVCC_FLAGS = ("-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo")

# Opt-in shared memory per block (bytes): sm_90 (H100/H200) 227 KiB, sm_80 (A100) 163 KiB.
SHARED_LIMIT = {90: 232448, 80: 166912}
# Shared memory per SM (bytes): sm_90 228 KiB.
SHARED_PER_SM = {90: 233472, 80: 167936}


def gencode(arch: int | str) -> list[str]:
    """nvcc's flags to build SASS for ``sm_<arch>`` (``arch``: 90, "9.0" or "90")."""
    arch = str(arch).strip().replace(".", "")
    return ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
