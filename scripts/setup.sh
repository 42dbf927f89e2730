#!/usr/bin/env bash
# Sets up everything megakernels needs on a fresh machine: a virtual environment in .venv with torch (a CUDA
# build, so the CUDA kernels compile and link even without a GPU), the test/benchmark tools, and the compiled
# extension built in place. Idempotent: re-running only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/compiler_cache.sh  # ccache for the extension build, when this machine has or can install it

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${MEGAKERNELS_TORCH:-torch==2.14.1}

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check)
# The dependencies (torch, the build tools, the train/test/bench extras of pyproject.toml) come from a wheelhouse
# shared by every checkout on this machine: pip fills it with what is missing (through this machine's pip
# configuration: its indexes and constraints), and installs come from it alone, through uv when it installs (links
# from its cache: seconds where unpacking torch and its CUDA libraries takes minutes), else through pip.
WHEELS=${MEGAKERNELS_WHEELHOUSE:-$HOME/.cache/megakernels/wheels}
mkdir -p build "$WHEELS"
.venv/bin/python - "$TORCH_SPEC" > build/requirements.txt <<'PY'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
print("\n".join([sys.argv[1], "ninja", "setuptools", "wheel", *project["dependencies"],
                 *extras["train"], *extras["test"], *extras["bench"]]))
PY
from_wheelhouse() {
  if [ -x .venv/bin/uv ]; then
    .venv/bin/uv pip install --quiet --python .venv/bin/python --no-index --find-links "$WHEELS" "$@"
  else
    "${PIP[@]}" install --quiet --no-index --find-links "$WHEELS" "$@"
  fi
}
if [ ! -x .venv/bin/uv ]; then
  "${PIP[@]}" install --quiet --no-index --find-links "$WHEELS" uv 2>/dev/null \
    || { "${PIP[@]}" wheel --quiet -w "$WHEELS" uv && "${PIP[@]}" install --quiet --no-index --find-links "$WHEELS" uv; } \
    || echo "megakernels: uv could not be installed; installing with pip"
fi
if ! from_wheelhouse -r build/requirements.txt 2>/dev/null; then
  "${PIP[@]}" wheel --quiet -w "$WHEELS" -r build/requirements.txt
  from_wheelhouse -r build/requirements.txt
fi
# The extension is built in place with its objects kept in build/temp: a re-run rebuilds only what changed, and the
# paths stay inside the checkout, so the compiler cache serves a fresh clone what any other checkout compiled. Then
# the packages are installed editable around it (--no-deps: installed above; --no-index: nothing to fetch).
.venv/bin/python setup.py -q build_ext --inplace --build-temp build/temp
MEGAKERNELS_EXTENSION_BUILT=1 "${PIP[@]}" install --quiet --no-index --no-build-isolation --no-deps -e .
# The static GPU cost model (costmodel/): a development tool beside the package, not in its wheel; it adds its modes
# to `megakernels bench` (--static, --measure-peers) through an entry point.
"${PIP[@]}" install --quiet --no-index --no-build-isolation --no-deps -e costmodel
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
