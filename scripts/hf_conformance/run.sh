#!/usr/bin/env bash
# run.sh TRANSFORMERS_TREE FAMILY TAG [plugin options]: transformers' tests/models/FAMILY, junit XML in
# build/hf_conformance/FAMILY-TAG.xml (see README.md beside this file).
set -euo pipefail
tree=$1 family=$2 tag=$3
shift 3
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out="$root/build/hf_conformance"
mkdir -p "$out"
cd "$tree"
HF_HUB_OFFLINE=1 PYTHONPATH="$here:$root" "$root/.venv/bin/python" -m pytest -p megakernels_tft "tests/models/$family" \
  -p no:cacheprovider -q --timeout=300 --junitxml="$out/$family-$tag.xml" "$@" > "$out/$family-$tag.log" 2>&1 || true
tail -n 2 "$out/$family-$tag.log"
