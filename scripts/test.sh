#!/usr/bin/env bash
# The whole test suite on a fresh machine (README, .ci/run): set up, then
#   1. CMake build of csrc without Python: every .cu compiled for sm_90 by nvcc (a compile error fails here),
#      plus the C++ tests (emulator and emulated kernels, plain / AddressSanitizer / ThreadSanitizer) via ctest;
#   2. pytest: the Python test suite (cpu and cuda_emu backends; cuda-marked tests skip without a GPU) and the
#      benchmark suite in quick mode (runs every benchmark once, times nothing), on two pytest-xdist workers with
#      whole files per worker (a file's spawned worlds and module fixtures are shared by its tests).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh

# Use the machine's toolkit for the CMake build (CMake finds nvcc by CUDACXX or PATH).
if [ -z "${CUDACXX:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDACXX=/usr/local/cuda/bin/nvcc; fi
cmake -S . -B build/cmake -DCMAKE_BUILD_TYPE=Release -DMEGAKERNELS_CUDA_ARCHS=90 >/dev/null
cmake --build build/cmake -j 2
ctest --test-dir build/cmake --output-on-failure -j 2

.venv/bin/python -m pytest tests benchmarks --benchmark-disable -q -p no:cacheprovider -n 2 --dist loadfile
