#!/usr/bin/env bash
# Draws the plots of a benchmark run with matplotlib, from a virtual
# environment kept with the other caches (~/.cache/gpuhealth).
set -euo pipefail
venv=${GPUHEALTH_BENCH_VENV:-$HOME/.cache/gpuhealth/bench-venv}
if ! "$venv/bin/python" -c 'import matplotlib' 2>/dev/null; then
  echo "[bench] installing matplotlib into $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q 'matplotlib>=3.8,<4'
fi
exec "$venv/bin/python" "$(dirname "$0")/plot.py" "$@"
