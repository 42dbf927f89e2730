#!/usr/bin/env bash
# Sets up everything megakernels needs on a fresh machine: a virtual environment in .venv with torch (a CUDA
# build, so the CUDA kernels compile and link even without a GPU), the test/benchmark tools, and the compiled
# extension built in place. Idempotent: re-running only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${MEGAKERNELS_TORCH:-torch==2.14.1}

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check)
"${PIP[@]}" install --quiet "$TORCH_SPEC" ninja setuptools wheel
# --no-build-isolation: build against the torch just installed instead of fetching a second one.
"${PIP[@]}" install --quiet --no-build-isolation -e ".[train,test,bench]"
# The static GPU cost model (costmodel/): a development tool beside the package, not in its wheel; it adds its modes
# to `megakernels bench` (--static, --measure-peers) through an entry point.
"${PIP[@]}" install --quiet --no-build-isolation --no-deps -e costmodel
# The peer versions the calibration's development and check sets are modelled with (benchmarks/peer/: the versions
# their rows name, or the first release holding a kernel a row's version predates), each in its own directory where
# `megakernels bench --static --peer-csv` imports it from (never into the venv: one version each). A missing version
# is an error naming the command that installs it; these keep the tests off the network.
PEERS=$(.venv/bin/python -c "from costmodel.peers import install; print(install.default_peer_root())")
for v in $(.venv/bin/python -c "from costmodel.peers import install; print(' '.join(install.RELEASES_USED))"); do
  if [ ! -d "$PEERS/liger-kernel-$v/liger_kernel" ]; then
    "${PIP[@]}" install --quiet --no-deps --target "$PEERS/liger-kernel-$v" "liger-kernel==$v"
  fi
done
.venv/bin/python - <<'PY'
import megakernels
print("megakernels ready: backends", ", ".join(b for b in ("cpu", "cuda_emu", "cuda") if megakernels.has_backend(b)))
PY
