#!/usr/bin/env bash
# Builds what the real node (node.sh) runs beside the cluster's kubelet and
# kube-proxy (e2e/cluster/build.sh builds those): containerd v2 from its Go
# module (Debian's 1.6 has no CDI) into a versioned cache, and our Go
# stand-ins (standins/: NVIDIA's device plugin and container runtime) into
# target/node-standins. Prints the containerd cache directory on stdout.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
log() { echo "[node-build] $*" >&2; }
export GOFLAGS=-buildvcs=false CGO_ENABLED=0 GOSUMDB=off GOMAXPROCS=${GOMAXPROCS:-2}

cache_root=${GPUHEALTH_CACHE:-$HOME/.cache/gpuhealth}
bin_dir="$cache_root/node-containerd-$CONTAINERD_VERSION"
if [[ ! -f "$bin_dir/.complete" ]]; then
  log "building containerd $CONTAINERD_VERSION"
  mkdir -p "$bin_dir"
  work=$(mktemp -d "$cache_root/node-build.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  (
    cd "$work"
    cat >go.mod <<GOMOD
module gpuhealth.local/containerdbin

go $(go env GOVERSION | sed 's/^go//; s/\.[0-9]*$//')

require github.com/containerd/containerd/v2 $CONTAINERD_VERSION
GOMOD
    cat >tools.go <<'GO'
//go:build tools

package tools

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
)
GO
    go mod tidy >&2
    for cmd in containerd containerd-shim-runc-v2 ctr; do
      log "go build $cmd"
      go build -trimpath -tags no_btrfs -ldflags "-s -w" -o "$bin_dir/$cmd" \
        "github.com/containerd/containerd/v2/cmd/$cmd"
    done
  )
  touch "$bin_dir/.complete"
fi

# Ours: rebuilt every time (Go's build cache makes an unchanged one instant).
standins="$repo/target/node-standins"
mkdir -p "$standins"
(
  cd "$here/standins"
  GOFLAGS="$GOFLAGS -mod=mod" go build -trimpath -o "$standins/" ./cmd/...
)
echo "$bin_dir"
