#!/usr/bin/env bash
# The workload controllers the test cluster can run on request
# (GPUHEALTH_CLUSTER_JOBS=1, cluster.sh): JobSet and LeaderWorkerSet, built
# from their own Go modules at the versions in versions.env.
#
#   controllers.sh build   build both managers into a versioned cache, with
#                          the CRDs and webhook manifests from the same
#                          modules; does nothing when the cache is complete;
#                          prints the cache directory on stdout
#
# cluster.sh starts them as host processes (webhooks served on loopback).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"

cache_root=${GPUHEALTH_CACHE:-$HOME/.cache/gpuhealth}
dir="$cache_root/controllers-jobset-$JOBSET_VERSION-lws-$LWS_VERSION"
stamp="$dir/.complete"

build() {
  if [[ -f "$stamp" ]]; then
    echo "$dir"
    return 0
  fi
  log() { echo "[controllers-build] $*" >&2; }
  export GOFLAGS=-buildvcs=false CGO_ENABLED=0
  # The checksum database is not reachable from these machines; the module
  # proxy is.
  export GOSUMDB=off
  # Two cores: keep compile jobs, and memory, bounded.
  export GOMAXPROCS=${GOMAXPROCS:-2}
  mkdir -p "$cache_root"
  local work
  work=$(mktemp -d "$cache_root/controllers-build.XXXXXX")
  # shellcheck disable=SC2064 # expand now: $work is local
  trap "rm -rf '$work'" EXIT
  rm -rf "$dir"
  mkdir -p "$dir"

  # module version main-package name: builds the module's own main package
  # with its own go.mod and go.sum (the versions upstream tested), from a
  # writable copy (the module cache is read-only), and copies what
  # cluster.sh applies: the CRDs and the webhook kustomization (patched by
  # `kubectl kustomize` at start; see cluster.sh).
  one() {
    local module=$1 version=$2 main=$3 name=$4 src
    log "building $name $version"
    src=$(go mod download -json "$module@$version" |
      python3 -c 'import json,sys; d=json.load(sys.stdin); print(d.get("Dir") or sys.exit(d.get("Error")))')
    cp -r "$src" "$work/$name"
    chmod -R u+w "$work/$name"
    (
      cd "$work/$name"
      go build -trimpath -o "$dir/$name-controller" \
        -ldflags "-s -w -X $module/pkg/version.GitVersion=$version" "$main"
    )
    mkdir -p "$dir/$name/crds" "$dir/$name/webhook"
    local crds webhook
    case $name in
      jobset) crds=config/components/crd/bases webhook=config/components/webhook ;;
      lws) crds=config/crd/bases webhook=config/webhook ;;
    esac
    cp "$src/$crds"/*.yaml "$dir/$name/crds/"
    cp -r "$src/$webhook"/. "$dir/$name/webhook/"
    chmod -R u+w "$dir/$name"
  }
  # JobSet's manager is the module's root package; LWS's is ./cmd.
  one sigs.k8s.io/jobset "$JOBSET_VERSION" . jobset
  one sigs.k8s.io/lws "$LWS_VERSION" ./cmd lws
  touch "$stamp"
  log "done: $dir"
  echo "$dir"
}

case "${1:-}" in
  build) build ;;
  *)
    echo "usage: $0 build" >&2
    exit 2
    ;;
esac
