#!/usr/bin/env bash
# Builds the test cluster's binaries from the Go module proxy into a versioned
# cache: kube-apiserver, kube-controller-manager, kube-scheduler, kubectl,
# the kubelet and kube-proxy (for the real node, e2e/node/), etcd and kwok,
# plus KWOK's stage definitions. Does nothing when the cache is complete.
# Prints the cache directory on stdout.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"

cache_root=${GPUHEALTH_CACHE:-$HOME/.cache/gpuhealth}
bin_dir="$cache_root/cluster-k8s-$K8S_VERSION-etcd-$ETCD_VERSION-kwok-$KWOK_VERSION"
kubernetes_cmds=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
# The stamp names what the cache holds: a cache from before the kubelet was
# built is completed, not rebuilt.
stamp="$bin_dir/.complete"
if [[ "$K8S" == "$NODE_K8S" ]]; then
  kubernetes_cmds+=(kubelet kube-proxy)
  stamp="$bin_dir/.complete-with-node"
fi
if [[ -f "$stamp" ]]; then
  echo "$bin_dir"
  exit 0
fi

log() { echo "[cluster-build] $*" >&2; }
export GOFLAGS=-buildvcs=false CGO_ENABLED=0
# The checksum database is not reachable from these machines; the module
# proxy is. Without this, `go mod tidy` fails verifying new modules.
export GOSUMDB=off
# Two cores and a few GiB: limit parallel compile jobs to keep memory bounded.
export GOMAXPROCS=${GOMAXPROCS:-2}
mkdir -p "$bin_dir"
work=$(mktemp -d "$cache_root/build.XXXXXX")
trap 'rm -rf "$work"' EXIT

minor_patch=${K8S_VERSION#v1.}   # 36.3
ldflags=(-s -w
  -X "k8s.io/component-base/version.gitVersion=$K8S_VERSION"
  -X "k8s.io/component-base/version.gitMajor=1"
  -X "k8s.io/component-base/version.gitMinor=${minor_patch%%.*}"
  -X "k8s.io/component-base/version.gitTreeState=clean"
  -X "k8s.io/component-base/version.buildDate=1970-01-01T00:00:00Z"
  -X "k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION"
  -X "k8s.io/client-go/pkg/version.gitMajor=1"
  -X "k8s.io/client-go/pkg/version.gitMinor=${minor_patch%%.*}")

build_kubernetes() {
  log "building Kubernetes $K8S_VERSION (10-25 minutes on 2 cores)"
  local dir="$work/k8s"
  mkdir -p "$dir"
  cd "$dir"
  # k8s.io/kubernetes points its staging modules at local folders; derive the
  # replace list from its own go.mod, pinning each to the matching v0.x.y tag.
  local upstream_gomod
  upstream_gomod=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  {
    echo "module gpuhealth.local/k8sbins"
    echo
    echo "go $(go env GOVERSION | sed 's/^go//; s/\.[0-9]*$//')"
    echo
    echo "require k8s.io/kubernetes $K8S_VERSION"
    echo
    echo "replace ("
    grep -E '^\s*k8s\.io/[a-z0-9-]+ => \./staging/' "$upstream_gomod" |
      awk -v v="v0.$minor_patch" '{print "\t" $1 " => " $1 " " v}'
    echo ")"
  } >go.mod
  {
    printf '//go:build tools\n\npackage tools\n\nimport (\n'
    printf '\t_ "k8s.io/kubernetes/cmd/%s"\n' "${kubernetes_cmds[@]}"
    printf ')\n'
  } >tools.go
  go mod tidy >&2
  for cmd in "${kubernetes_cmds[@]}"; do
    [[ -x "$bin_dir/$cmd" ]] && continue
    log "go build $cmd"
    go build -trimpath -ldflags "${ldflags[*]}" -o "$bin_dir/$cmd" "k8s.io/kubernetes/cmd/$cmd"
  done
}

build_etcd() {
  log "building etcd $ETCD_VERSION"
  local dir="$work/etcd"
  mkdir -p "$dir"
  cd "$dir"
  cat >go.mod <<GOMOD
module gpuhealth.local/etcdbin

go $(go env GOVERSION | sed 's/^go//; s/\.[0-9]*$//')

require go.etcd.io/etcd/server/v3 $ETCD_VERSION
GOMOD
  # The same entry point as etcd's own main.go.
  cat >main.go <<'GO'
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
  go mod tidy >&2
  go build -trimpath -ldflags "-s -w" -o "$bin_dir/etcd" .
}

build_kwok() {
  log "building kwok $KWOK_VERSION"
  GOBIN="$bin_dir" go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  local src
  src="$(go env GOMODCACHE)/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize/stage"
  mkdir -p "$bin_dir/stages"
  cp -r "$src"/. "$bin_dir/stages/"
  chmod -R u+w "$bin_dir/stages"
}

# etcd and kwok do not change with the Kubernetes minor: another minor's
# cache lends them.
lend_tools() {
  local other
  for other in "$cache_root"/cluster-k8s-*-etcd-$ETCD_VERSION-kwok-$KWOK_VERSION; do
    [[ "$other" != "$bin_dir" && -x "$other/etcd" && -x "$other/kwok" && -d "$other/stages" ]] || continue
    log "etcd and kwok from $other"
    cp -r "$other/etcd" "$other/kwok" "$other/stages" "$bin_dir/"
    return 0
  done
  return 1
}
[[ -x "$bin_dir/etcd" && -x "$bin_dir/kwok" && -d "$bin_dir/stages" ]] || lend_tools || true
[[ -x "$bin_dir/etcd" ]] || build_etcd
[[ -x "$bin_dir/kwok" && -d "$bin_dir/stages" ]] || build_kwok
for cmd in "${kubernetes_cmds[@]}"; do
  [[ -x "$bin_dir/$cmd" ]] || { build_kubernetes; break; }
done
touch "$stamp"
log "done: $bin_dir"
echo "$bin_dir"
