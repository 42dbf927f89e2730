#!/usr/bin/env bash
# GPU validation (DESIGN.md §3). On a CUDA machine with torch, nvcc (and triton) already installed and no
# network: builds the extension in place for the local GPU arch only, runs every `cuda`-marked test, then the
# kernel benchmarks on the GPU (norm family, softmax family, AdamW, FlashAttention, cross-entropy, end-to-end GPT-1.3B training). Logs and JSON go to OUTDIR; a summary table is printed at the end.
#   scripts/gpu_check.sh OUTDIR
# Exit status: 0 when every stage passed, 1 otherwise, 2 for a usage error.
set -uo pipefail
if [ $# -ne 1 ] || [ -z "$1" ]; then
  echo "usage: scripts/gpu_check.sh OUTDIR" >&2
  exit 2
fi
OUT=$1
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: torch sees no CUDA device" >&2
  exit 1
fi
ARCH=$("$PY" -c "import torch; a, b = torch.cuda.get_device_capability(); print(f'{a}{b}')")
GPU=$("$PY" -c "import torch; print(torch.cuda.get_device_name())")
START=$(date +%s)
declare -A STATUS=([build]=skipped [tests]=skipped [bench_norms]=skipped [bench_softmax]=skipped [bench_adamw]=skipped [bench_attention]=skipped
                  [bench_cross_entropy]=skipped)

stage() {  # stage NAME LOG CMD...: run CMD with its output in OUTDIR/LOG, record ok/FAIL and the seconds taken
  local name=$1 log=$2 t0 rc
  shift 2
  t0=$(date +%s)
  "$@" >"$OUT/$log" 2>&1
  rc=$?
  STATUS[$name]="$([ $rc -eq 0 ] && echo ok || echo "FAIL (rc $rc, see $log)") $(($(date +%s) - t0))s"
  return $rc
}

if stage build build.log env MEGAKERNELS_CUDA_ARCHS="$ARCH" "$PY" setup.py -q build_ext --inplace; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  stage tests pytest_cuda.log "$PY" -m pytest -m cuda -x -q -p no:cacheprovider tests
  stage bench_norms bench_norms.txt "$PY" -m benchmarks.norms --device cuda --out "$OUT"
  stage bench_softmax bench_softmax.txt "$PY" -m benchmarks.softmax --device cuda --out "$OUT"
  stage bench_adamw bench_adamw.txt "$PY" -m benchmarks.adamw --device cuda --out "$OUT"
  stage bench_attention bench_attention.txt "$PY" -m benchmarks.attention --device cuda --dtype bfloat16 \
    --seqlens 1024,4096,16384 --out "$OUT"
  stage bench_cross_entropy bench_cross_entropy.txt "$PY" -m benchmarks.cross_entropy --device cuda \
    --dtype bfloat16 --out "$OUT"
  stage bench_e2e bench_e2e.txt "$PY" -m benchmarks.e2e --device cuda --preset gpt-1.3b --micro-batch-size 4 \
    --steps 5 --out "$OUT"
fi

{
  echo "gpu_check on $GPU (sm_$ARCH), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u +%F)"
  printf '%-20s %s\n' stage result
  for s in build tests bench_norms bench_softmax bench_adamw bench_attention bench_cross_entropy; do printf '%-20s %s\n' "$s" "${STATUS[$s]}"; done
  [ -f "$OUT/pytest_cuda.log" ] && echo "pytest: $(tail -n 1 "$OUT/pytest_cuda.log")"
  echo "total $(($(date +%s) - START))s; logs and JSON in $OUT"
} | tee "$OUT/summary.txt"
for s in build tests bench_norms bench_softmax bench_adamw bench_attention bench_cross_entropy; do [[ ${STATUS[$s]} == ok* ]] || exit 1; done
exit 0
