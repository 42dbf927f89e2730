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
# The peer versions the calibration's development and check sets are modelled with (benchmarks/peer/: the versions
# their rows name, or the first release holding a kernel a row's version predates: peer.resolve_version), each in
# its own directory where `megakernels bench --static --peer-csv` imports it from (never into the venv: one version
# each). The command installs a missing version by itself too; these keep the tests off the network.
PEERS=$(.venv/bin/python -c "from megakernels.bench.static import peer; print(peer.default_peer_root())")
for v in 0.2.1 0.3.0 0.4.0 0.6.0 0.6.2 0.7.0 0.8.0 0.8.1 0.8.2; do
  if [ ! -d "$PEERS/liger-kernel-$v/liger_kernel" ]; then
    "${PIP[@]}" install --quiet --no-deps --target "$PEERS/liger-kernel-$v" "liger-kernel==$v"
  fi
done
.venv/bin/python - <<'PY'
import megakernels
print("megakernels ready: backends", ", ".join(b for b in ("cpu", "cuda_emu", "cuda") if megakernels.has_backend(b)))
PY
