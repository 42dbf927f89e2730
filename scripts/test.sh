#!/usr/bin/env bash
# The whole test suite on a fresh machine (README, .ci/run):
#   1. CMake build of the C++ tests without Python (emulator and emulated kernels, plain / AddressSanitizer /
#      ThreadSanitizer) and ctest. It needs neither Python nor torch, so it runs in the background from the start,
#      beside the set-up and pytest; its log is build/cpp-tests.log, its result checked at the end. It skips the
#      kernel libraries (MEGAKERNELS_KERNEL_LIBS=OFF): the extension build compiles the same CPU kernels, and every
#      .cu for sm_90 with nvcc (a compile error fails the set-up; checked below that the CUDA kernels were built);
#   2. set-up (scripts/setup.sh), the lint and format checks (scripts/lint.sh: ruff, clang-format), then pytest:
#      the Python test suite (cpu and cuda_emu backends; cuda-marked tests skip without a GPU) and the benchmark suite in quick mode (runs every benchmark once, times nothing), on two
#      pytest-xdist workers with whole files per worker (a file's spawned worlds and module fixtures are shared by
#      its tests).
# `scripts/test.sh --all` adds the `slow` set (stress variants of tested features: more families at a layout, longer
# fault sequences, the sanitizer runs of the largest C++ kernel tests); without it, CI's default, they are left out.
set -euo pipefail
MARKS=(-m "not slow")
CTEST_SLOW=(-LE slow)
if [ "${1:-}" = "--all" ]; then MARKS=(); CTEST_SLOW=(); shift; fi
if [ $# -gt 0 ]; then echo "usage: scripts/test.sh [--all]" >&2; exit 2; fi
cd "$(dirname "$0")/.."
mkdir -p build
source scripts/compiler_cache.sh  # one compiler cache for the CMake build and the extension (scripts/setup.sh)

# Use the machine's toolkit for the CMake build (CMake finds nvcc by CUDACXX or PATH).
if [ -z "${CUDACXX:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDACXX=/usr/local/cuda/bin/nvcc; fi
(
  set -euo pipefail
  cmake -S . -B build/cmake -DCMAKE_BUILD_TYPE=Release -DMEGAKERNELS_KERNEL_LIBS=OFF $MEGAKERNELS_CMAKE_LAUNCHER >/dev/null
  # at the lowest priority (nice 19): the emulator runs a CUDA block's threads as host threads (hundreds, yielding
  # while they wait), which would otherwise take the cores from pytest's workers, the longer part of the run; so
  # niced, the C++ side runs in the cores' idle time (pytest's waits for processes and timeouts) and ends before it
  nice -n 19 cmake --build build/cmake -j 2
  nice -n 19 ctest --test-dir build/cmake --output-on-failure -j 2 "${CTEST_SLOW[@]}"
) > build/cpp-tests.log 2>&1 &
CPP=$!
trap 'kill $CPP 2>/dev/null || true' EXIT

# Nothing runs the CUDA kernels here: the extension compiles them for one architecture.
MEGAKERNELS_CUDA_ARCHS=${MEGAKERNELS_CUDA_ARCHS:-90} bash scripts/setup.sh
if [ -n "${CUDACXX:-}" ] || command -v nvcc >/dev/null; then
  .venv/bin/python -c "import megakernels, sys; megakernels.has_backend('cuda') or sys.exit(
      'nvcc is installed but the extension was built without its CUDA kernels: the .cu files were not compiled')"
fi

# Bytecode: where the environment sets PYTHONDONTWRITEBYTECODE (this machine kind's does), every Python process of
# the run in a fresh clone (hundreds: the xdist workers, each spawned world's fork server, every CLI run) compiles
# every module it imports from source, about twice the import time of a compiled one. The run writes its bytecode
# on first import and reads it after, under build/pycache (PYTHONPYCACHEPREFIX), so the source tree and the venv
# stay as they are.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="$PWD/build/pycache"

# A fresh Inductor cache for each run: a cache shared with another run (another checkout, or an earlier commit)
# handed back code compiled against an older signature of a custom op (flash_attn_fwd called with 11 arguments
# by a graph cached from a checkout whose op took them), failing torch.compile tests that pass on their own.
rm -rf build/inductor-cache
export TORCHINDUCTOR_CACHE_DIR="$PWD/build/inductor-cache"

status=0
bash scripts/lint.sh || status=1  # ruff (lint + format) and clang-format: a failure fails the run, after the tests
.venv/bin/python -m pytest tests benchmarks --benchmark-disable -q -p no:cacheprovider -n 2 --dist loadfile "${MARKS[@]}" \
  || status=$?

cpp_status=0
wait $CPP || cpp_status=$?
trap - EXIT
if [ $cpp_status -ne 0 ]; then
  echo "C++ build or tests FAILED (exit $cpp_status); build/cpp-tests.log ends with:" >&2
  tail -n 80 build/cpp-tests.log >&2
  status=1
else
  echo "C++ build and tests: $(grep -E 'tests passed' build/cpp-tests.log | tail -1)"
fi
exit $status
