#!/usr/bin/env bash
# Lint and format checks (CI runs them through scripts/test.sh; pre-commit runs the same tools):
#   ruff check          Python lint (pyproject.toml [tool.ruff.lint])
#   ruff format --check Python formatting
#   clang-format        C++/CUDA formatting of csrc/ (.clang-format)
# `scripts/lint.sh --fix` applies the fixes and the formatting instead of checking.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${LINT_BIN:-.venv/bin}
mapfile -t CSRC < <(git ls-files 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh')
if [ "${1:-}" = "--fix" ]; then
  "$BIN/ruff" check --fix .
  "$BIN/ruff" format .
  "$BIN/clang-format" -i --style=file "${CSRC[@]}"
  exit 0
fi
status=0
"$BIN/ruff" check --output-format concise . || status=1
"$BIN/ruff" format --check . || status=1
"$BIN/clang-format" --dry-run -Werror --style=file "${CSRC[@]}" || status=1
if [ $status -eq 0 ]; then
  echo "lint: ruff check, ruff format and clang-format ($((${#CSRC[@]})) C++/CUDA files) clean"
fi
exit $status
