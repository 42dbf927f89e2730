#!/usr/bin/env bash
# GPU validation (docs/design.md §3). On a CUDA machine with torch, nvcc (and triton) already installed and no
# network: builds the extension in place for the local GPU arch only, runs every `cuda`-marked test, the static
# cost report (`megakernels bench --static`: what the model predicts for each kernel), then the key benchmarks on
# the GPU through `megakernels bench` — the norm, bias-GeLU and softmax families at rows >= 4k, AdamW (50x1M and
# 1x100M params), FlashAttention d128 bf16 at s 4k/8k (causal and not), cross-entropy, the FP8 GEMM (tensorwise and
# blockwise, against bf16 torch.matmul, at Llama-3-8B's linear layers) and a GPT-1.3B end-to-end run (the trainer +
# the eager-GPT baseline). Logs, JSON and PNG plots go to OUTDIR (one folder per benchmark
# stage); the summary at the end (benchmarks/gpu_summary.py) shows each stage's result, the numbers
# against the docs/benchmarks.md targets (pass/fail, % of target), and every measurement beside the static model's
# prediction (the first GPU run calibrates the model). Aimed at < 8 minutes on an H100/H200 (torch.compile
# baselines are skipped here for time; `megakernels bench --device cuda` runs them). The peer stage times our
# kernels and Liger-Kernel's at the shapes of its published development rows (benchmarks/peer/liger_dev.csv) and
# writes OUTDIR/peer/measured.csv in Liger's CSV format, rows for the kernel calibration set; the machine has no
# network, so Liger-Kernel comes from a wheel directory: MEGAKERNELS_PEER_WHEELS=DIR (pip install --no-index;
# without it, or if the install fails, only our kernels are timed and the stage says so).
#   scripts/gpu_check.sh OUTDIR                 # the whole check
#   scripts/gpu_check.sh --summary-only OUTDIR  # re-render the summary from OUTDIR's stages.tsv and JSON files
# Exit status: 0 when every stage passed, 1 otherwise, 2 for a usage error. Targets missed do not change it
# (benchmarks never fail on time).
set -uo pipefail
usage() { echo "usage: scripts/gpu_check.sh [--summary-only] OUTDIR" >&2; exit 2; }
SUMMARY_ONLY=0
if [ $# -eq 2 ] && [ "$1" = "--summary-only" ]; then SUMMARY_ONLY=1; shift; fi
if [ $# -ne 1 ] || [ -z "$1" ] || [[ $1 == -* ]]; then usage; fi
OUT=$1
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

summary() {  # summary TITLE: the closing table, also saved as OUTDIR/summary.txt
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" benchmarks/gpu_summary.py "$OUT" --title "$1" \
    | tee "$OUT/summary.txt"
}

if [ $SUMMARY_ONLY -eq 1 ]; then
  [ -d "$OUT" ] || { echo "gpu_check: $OUT is not a directory" >&2; exit 2; }
  summary "gpu_check summary of $OUT"
  exit $?
fi
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: torch sees no CUDA device" >&2
  exit 1
fi
ARCH=$("$PY" -c "import torch; a, b = torch.cuda.get_device_capability(); print(f'{a}{b}')")
GPU=$("$PY" -c "import torch; print(torch.cuda.get_device_name())")
START=$(date +%s)
STAGES=(build tests static bench_norms bench_softmax bench_adamw bench_attention bench_cross_entropy bench_fp8 bench_peer
  bench_e2e train_fp8)
declare -A STATUS
for s in "${STAGES[@]}"; do STATUS[$s]=skipped; done

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
  BENCH=("$PY" -m megakernels_models.cli bench)
  stage static static.txt "$PY" -m costmodel --static --out "$OUT/static"  # the tool beside the package
  stage bench_norms bench_norms.txt "${BENCH[@]}" --ops norms,bias_gelu --device cuda --dtype bfloat16 \
    --no-compile --out "$OUT/norms"
  stage bench_softmax bench_softmax.txt "${BENCH[@]}" --ops softmax --device cuda --dtype bfloat16 --no-compile \
    --out "$OUT/softmax"
  stage bench_adamw bench_adamw.txt "${BENCH[@]}" --ops adamw --device cuda --out "$OUT/adamw"
  stage bench_attention bench_attention.txt "${BENCH[@]}" --ops flash_attention --device cuda --dtype bfloat16 \
    --head-dims 128 --seqlens 4096,8192 --out "$OUT/attention"
  stage bench_cross_entropy bench_cross_entropy.txt "${BENCH[@]}" --ops cross_entropy --device cuda \
    --dtype bfloat16 --out "$OUT/cross_entropy"
  stage bench_fp8 bench_fp8.txt "${BENCH[@]}" --ops fp8_gemm --device cuda --out "$OUT/fp8"
  if [ -n "${MEGAKERNELS_PEER_WHEELS:-}" ]; then
    "$PY" -m pip install -q --no-index --no-deps --find-links "$MEGAKERNELS_PEER_WHEELS" liger-kernel \
      >"$OUT/peer_install.log" 2>&1 || echo "gpu_check: liger-kernel did not install (see peer_install.log)"
  fi
  stage bench_peer bench_peer.txt "$PY" -m costmodel --measure-peers benchmarks/peer/liger_dev.csv --device cuda \
    --out "$OUT/peer"
  stage bench_e2e bench_e2e.txt "${BENCH[@]}" --e2e gpt-1.3b --device cuda --micro-batch-size 4 --steps 5 \
    --warmup 2 --out "$OUT/e2e"
  # FP8 training steps beside the bf16 ones of bench_e2e (same preset, batch and steps), both recipes
  train_fp8() {
    local r
    for r in tensorwise blockwise; do
      "${BENCH[@]}" --e2e gpt-1.3b --device cuda --micro-batch-size 4 --steps 5 --warmup 2 --precision fp8 \
        --fp8-recipe "$r" --out "$OUT/e2e_fp8_$r" || return 1
    done
  }
  stage train_fp8 train_fp8.txt train_fp8
fi

: >"$OUT/stages.tsv"
for s in "${STAGES[@]}"; do printf '%s\t%s\n' "$s" "${STATUS[$s]}" >>"$OUT/stages.tsv"; done
[ -f "$OUT/pytest_cuda.log" ] && printf 'pytest\t%s\n' "$(tail -n 1 "$OUT/pytest_cuda.log")" >>"$OUT/stages.tsv"
TITLE="gpu_check on $GPU (sm_$ARCH), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u +%F)"
if ! summary "$TITLE"; then  # the Python summary failed: print the stages at least
  echo "$TITLE"; cat "$OUT/stages.tsv"
fi
echo "total $(($(date +%s) - START))s; logs, JSON and PNGs in $OUT" | tee -a "$OUT/summary.txt"
for s in "${STAGES[@]}"; do [[ ${STATUS[$s]} == ok* ]] || exit 1; done
exit 0
