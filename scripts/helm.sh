#!/usr/bin/env bash
# Helm, built from its Go module into the cached toolchain on first use (as
# e2e/cluster/build.sh builds the control plane), then run with the given
# arguments: `scripts/helm.sh lint charts/gpuhealth`. With no arguments,
# prints the binary's path.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=../e2e/cluster/versions.env
source "$here/../e2e/cluster/versions.env"

cache_root=${GPUHEALTH_CACHE:-$HOME/.cache/gpuhealth}
bin_dir="$cache_root/helm-$HELM_VERSION"
helm="$bin_dir/helm"
if [[ ! -x "$helm" ]]; then
  echo "[helm] building Helm $HELM_VERSION (a few minutes on 2 cores)" >&2
  mkdir -p "$bin_dir"
  # The checksum database is not reachable from these machines; the module
  # proxy is.
  GOSUMDB=off GOFLAGS=-buildvcs=false CGO_ENABLED=0 GOMAXPROCS=${GOMAXPROCS:-2} \
    GOBIN="$bin_dir.tmp" go install -trimpath \
    -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$HELM_VERSION" \
    "helm.sh/helm/v4/cmd/helm@$HELM_VERSION" >&2
  mv "$bin_dir.tmp/helm" "$helm" && rmdir "$bin_dir.tmp"
fi
if [[ $# -eq 0 ]]; then
  echo "$helm"
else
  exec "$helm" "$@"
fi
