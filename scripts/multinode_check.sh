#!/usr/bin/env bash
# The multi-node checks (tests/multinode): two Linux network namespaces joined by a veth pair as two hosts on this
# machine, torchrun on each across them (tp inside a node × dp across, pp across, checkpoints moving between two
# nodes and one, a --tp across nodes refused, a node lost with and without elastic settings), and examples/
# slurm_train.sbatch under a real Slurm started here (Debian's slurm-wlm + munge). Root only; nothing leaves the
# machine.
#
#   bash scripts/multinode_check.sh [REPEAT] [pytest args...]     # REPEAT (default 3) runs of every check
#   MULTINODE_RESULTS=benchmarks/results bash scripts/multinode_check.sh   # and write the dated results report
#
# Each repetition is one `pytest tests/multinode` (MEGAKERNELS_MULTINODE=1: the test suite leaves these out); about
# 12 minutes each on 2 cores (Slurm holds a requeued job about 2.5 minutes before it starts it again). They are not
# part of scripts/test.sh: they need root, network namespaces and Slurm's packages, and three repetitions take
# longer than CI's budget; their last results are committed under benchmarks/results/. Whatever happens — a failure,
# Ctrl-C, a kill of pytest — the namespaces, every process on them (the training jobs and Slurm's and munge's
# daemons run there) and their /etc/netns files are removed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
REPEAT=3
if [[ ${1:-} =~ ^[0-9]+$ ]]; then REPEAT=$1; shift; fi

if [ "$(id -u)" != 0 ]; then
  echo "multinode_check: needs root (network namespaces, Slurm's daemons)" >&2
  exit 2
fi
for tool in ip unshare nsenter slurmctld slurmd sbatch munged; do
  if ! command -v "$tool" >/dev/null; then
    echo "multinode_check: $tool is missing (apt-get install iproute2 util-linux slurm-wlm munge)" >&2
    exit 2
  fi
done

work=$(mktemp -d /tmp/multinode-check.XXXXXX)
status=1
cleanup() {
  # the namespaces of a pytest that did not get to remove them (their creator is gone), and all on them
  "$PY" -c 'from tests.multinode.cluster import remove_leftovers; print(*remove_leftovers())' || true
  if [ "$status" = 0 ]; then rm -rf "$work"; else echo "multinode_check: logs kept in $work" >&2; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# torchrun, srun's tasks and the Slurm jobs find this checkout and the venv's torchrun on their path
# absolute: Slurm's job steps start in other directories, where a relative .venv/bin finds no torchrun
export PATH="$(cd "$(dirname "$PY")" && pwd):$PATH"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MEGAKERNELS_MULTINODE=1

status=0
records=() junits=()
for i in $(seq 1 "$REPEAT"); do
  echo "=== multinode_check: repetition $i of $REPEAT"
  records+=("$work/records-$i.jsonl") junits+=("$work/junit-$i.xml")
  MEGAKERNELS_MULTINODE_RECORD="$work/records-$i.jsonl" "$PY" -m pytest tests/multinode -q -p no:cacheprovider \
    --basetemp "$work/pytest-$i" --junitxml "$work/junit-$i.xml" "$@" || status=1
done

if [ -n "${MULTINODE_RESULTS:-}" ]; then
  "$PY" -m tests.multinode.report --records "${records[@]}" --junit "${junits[@]}" --out "$MULTINODE_RESULTS" \
    --command "bash scripts/multinode_check.sh $REPEAT${*:+ $*}" || status=1
fi
exit $status
