#!/usr/bin/env bash
# Runs a command with the local test cluster: reuses a running one (and
# leaves it running), or starts one and stops it when the command ends,
# whatever its outcome. The command sees GPUHEALTH_E2E_KUBECONFIG.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [[ -n "${GPUHEALTH_E2E_KUBECONFIG:-}" ]]; then
  exec "$@"
fi
if "$here/cluster.sh" status; then
  echo "[cluster] reusing the running cluster" >&2
else
  trap '"$here/cluster.sh" down' EXIT INT TERM
fi
GPUHEALTH_E2E_KUBECONFIG=$("$here/cluster.sh" up | tail -n 1)
export GPUHEALTH_E2E_KUBECONFIG
"$@"
