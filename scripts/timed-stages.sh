#!/usr/bin/env bash
# `make test`'s stages one after another, each timed: the table is printed
# at the end (or where a stage failed) and kept in target/test-times.md,
# so that what makes the run long is measured rather than guessed.
set -uo pipefail
cd "$(dirname "$0")/.."
make=${MAKE:-make}
out=target/test-times.md
mkdir -p target
rows=()
total=0
report() {
  {
    echo "| stage | seconds | |"
    echo "|---|---:|---|"
    printf '%s\n' "${rows[@]}"
    echo "| **total** | $total | |"
  } | tee "$out"
}
for stage in "$@"; do
  start=$SECONDS
  "$make" "$stage"
  rc=$?
  took=$((SECONDS - start))
  total=$((total + took))
  if ((rc != 0)); then
    rows+=("| $stage | $took | failed ($rc) |")
    echo "[test] stage $stage failed after $took s" >&2
    report
    exit "$rc"
  fi
  rows+=("| $stage | $took | |")
done
report
