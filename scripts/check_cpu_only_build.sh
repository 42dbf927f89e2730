#!/usr/bin/env bash
# The CPU-only build (MEGAKERNELS_FORCE_CPU_ONLY=1): builds the extension without the CUDA kernels from a clean
# export of HEAD in a temporary directory, then runs the backend and op tests against it (backends cpu and
# cuda_emu; the cuda-marked tests skip, as on a machine without a GPU). Uses the .venv of scripts/setup.sh.
# A few CPU-minutes of compiling, which is why CI (scripts/test.sh) does not run it; CI compiles the one unit that
# differs from the full build (tests/test_cpu_only_build.py: the bindings reference no CUDA launcher).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
git archive HEAD | tar -x -C "$WORK"
cd "$WORK"
MEGAKERNELS_FORCE_CPU_ONLY=1 "$ROOT/.venv/bin/python" setup.py build_ext --inplace > build.log 2>&1 || {
  tail -50 build.log; exit 1; }
grep -q "CPU-only build (MEGAKERNELS_FORCE_CPU_ONLY=1)" build.log
"$ROOT/.venv/bin/python" - <<'PY'
import megakernels
assert megakernels.__file__.startswith(__import__("os").getcwd()), megakernels.__file__
assert megakernels.has_backend("cpu") and not megakernels.has_backend("cuda"), "the CPU-only build has CUDA"
print("CPU-only build: backends", [b for b in ("cpu", "cuda_emu", "cuda") if megakernels.has_backend(b)])
PY
"$ROOT/.venv/bin/python" -m pytest tests/test_backend.py tests/ops -q -p no:cacheprovider -n 2
