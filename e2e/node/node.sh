#!/usr/bin/env bash
# One real node beside the KWOK nodes of the local cluster: a kubelet and
# containerd on this machine, joined to the cluster in $GPUHEALTH_CLUSTER_DIR
# (started with GPUHEALTH_CLUSTER_NODE=1, see e2e/cluster/cluster.sh), with
# the NVML stand-in's GPUs given to pods as the NVIDIA Container Toolkit
# gives a GPU node's (README.md here).
#
#   node.sh up      join the node (needs root and the stand-in's GPUs in
#                   $GPUHEALTH_STANDIN_ROOT, its binaries in
#                   $GPUHEALTH_NVML_STANDIN); prints NAME=value lines
#   node.sh down    stop it and remove everything it made on this machine;
#                   exits 1, listing them, if anything is left
#   node.sh import ARCHIVE...
#                   import OCI image archives into the node's containerd
#
# The kubelet keeps its default root, /var/lib/kubelet (the device-plugin
# directory does not follow --root-dir, and the shipped manifests mount the
# PodResources socket from there): one real node per machine.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
state=${GPUHEALTH_CLUSTER_DIR:-$repo/target/e2e-cluster}
node_dir=$state/node
log() { echo "[node] $*" >&2; }
logs="$node_dir/logs"
# shellcheck source=../cluster/wait.sh
source "$here/../cluster/wait.sh"

NAME=gpuhealth-real-0
# Pods' addresses: a private range that exists only on this machine's bridge.
POD_CIDR=10.214.0.0/24
BRIDGE=gpuhealth-cni0
CNI_CONF=/etc/cni/net.d/10-gpuhealth.conflist
CDI_DIR=/var/run/cdi
CONTAINERD_SOCKET=/run/containerd/containerd.sock
# Where the NVIDIA runtime's shared edits mount the stand-in's GPUs' state,
# and where nvidia-persistenced's socket is on a GPU node.
STANDIN_IN_CONTAINER=/run/nvidia-standin
PERSISTENCED_SOCKET=/run/nvidia-persistenced/socket
# Where the GPU Operator's driver container keeps its root on the host.
DRIVER_ROOT=/run/nvidia/driver
components=(containerd kubelet kube-proxy)

alive() { [[ -f "$node_dir/pids/$1" ]] && kill -0 "$(cat "$node_dir/pids/$1")" 2>/dev/null; }

launch() { # name args...
  local name=$1
  shift
  setsid "$@" >>"$node_dir/logs/$name.log" 2>&1 </dev/null &
  echo $! >"$node_dir/pids/$name"
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

pki() { # the node's identities, signed by the cluster's CA
  local d=$node_dir/pki address
  address=$(cat "$state/node-address")
  mkdir -p "$d"
  sign() { # name subject extensions
    openssl req -newkey rsa:2048 -nodes -subj "$2" -keyout "$d/$1.key" -out "$d/$1.csr" 2>/dev/null
    printf '%s\n' "$3" >"$d/$1.ext"
    openssl x509 -req -in "$d/$1.csr" -CA "$state/pki/ca.crt" -CAkey "$state/pki/ca.key" \
      -CAcreateserial -days 365 -extfile "$d/$1.ext" -out "$d/$1.crt" 2>/dev/null
  }
  # As the Node authorizer and NodeRestriction know a kubelet.
  sign kubelet-client "/O=system:nodes/CN=system:node:$NAME" "extendedKeyUsage=clientAuth"
  sign kubelet-serving "/CN=system:node:$NAME" \
    "subjectAltName=IP:$address,DNS:$NAME
extendedKeyUsage=serverAuth"
  sign kube-proxy "/CN=system:kube-proxy" "extendedKeyUsage=clientAuth"
}

kubeconfig() { # name cert-name
  local server
  server=$(awk '/server:/ {print $2; exit}' "$state/admin.kubeconfig")
  cat >"$node_dir/$1.kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster: {server: $server, certificate-authority: $state/pki/ca.crt}
users:
- name: $1
  user: {client-certificate: $node_dir/pki/$2.crt, client-key: $node_dir/pki/$2.key}
contexts:
- name: local
  context: {cluster: local, user: $1}
current-context: local
KC
}

# The NVIDIA Container Toolkit's CDI spec for the stand-in's GPUs, as
# `nvidia-ctk cdi generate` writes one: `nvidia.com/gpu=<index>`, `=<UUID>`
# and `=all`, each GPU's device node, and the shared edits every GPU
# device brings: NVML, nvidia-smi, nvidia-persistenced's socket (the
# stand-in's GPUs are files, so their "device nodes" are bind mounts).
nvidia_cdi_spec() {
  python3 - "$GPUHEALTH_STANDIN_ROOT" "$GPUHEALTH_NVML_STANDIN" "$node_dir/cdi/nvidia.json" \
    "$STANDIN_IN_CONTAINER" "$PERSISTENCED_SOCKET" <<'PY'
import json, os, sys
root, standin, out, in_container, socket = sys.argv[1:]
bind = ["rbind", "rw"]
gpus = []
i = 0
while os.path.exists(f"{root}/gpu/{i}"):
    keys = dict(l.split("=", 1) for l in open(f"{root}/gpu/{i}").read().splitlines() if "=" in l)
    minor = int(keys.get("minor", i))
    gpus.append((str(i), keys["uuid"], {"hostPath": f"{root}/dev/nvidia{minor}",
                                         "containerPath": f"/dev/nvidia{minor}", "options": bind}))
    i += 1
devices = []
for index, uuid, mount in gpus:
    for name in (index, uuid):
        devices.append({"name": name, "containerEdits": {"mounts": [mount]}})
devices.append({"name": "all", "containerEdits": {"mounts": [m for _, _, m in gpus]}})
shared = [
    {"hostPath": f"{standin}/libnvidia-ml.so.1", "containerPath": "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1", "options": ["ro", "nosuid", "nodev", "rbind"]},
    {"hostPath": f"{standin}/nvidia-smi", "containerPath": "/usr/bin/nvidia-smi", "options": ["ro", "nosuid", "nodev", "rbind"]},
    {"hostPath": root, "containerPath": in_container, "options": bind},
]
if os.path.exists(socket):
    shared.append({"hostPath": socket, "containerPath": socket, "options": ["nosuid", "nodev", "rbind", "noexec"]})
spec = {"cdiVersion": "0.6.0", "kind": "nvidia.com/gpu", "devices": devices,
        "containerEdits": {"env": [f"NVML_STANDIN_ROOT={in_container}"], "mounts": shared}}
os.makedirs(os.path.dirname(out), exist_ok=True)
json.dump(spec, open(out, "w"), indent=1)
PY
}

# A driver container's root, where the GPU Operator's DaemonSet keeps it
# (../../config/agent/driver-root mounts it): the stand-in's NVML,
# nvidia-smi and nvidia-persistenced beside the C library they were built
# against (the agent runs this root's nvidia-smi with this root's loader),
# laid out as Debian's; the stand-in GPUs' state where the stand-in finds
# it from where it is installed (var/lib/nvml-standin), a mount of its
# own, so that it stays writable under the root's read-only mount. The root
# is a shared mount of its own, as a driver container's is (the agent
# follows it with HostToContainer propagation, which needs one).
driver_root() {
  local libs=$DRIVER_ROOT/usr/lib/$(cc -print-multiarch) loader lib
  mkdir -p "$DRIVER_ROOT"
  mountpoint -q "$DRIVER_ROOT" || mount --bind "$DRIVER_ROOT" "$DRIVER_ROOT"
  mount --make-rshared "$DRIVER_ROOT"
  mkdir -p "$libs" "$DRIVER_ROOT/usr/bin" "$DRIVER_ROOT/lib64" \
    "$DRIVER_ROOT/var/lib/nvml-standin" "$DRIVER_ROOT/run/nvidia-persistenced"
  cp "$GPUHEALTH_NVML_STANDIN/libnvidia-ml.so.1" "$libs/"
  cp "$GPUHEALTH_NVML_STANDIN/nvidia-smi" "$GPUHEALTH_NVML_STANDIN/nvidia-persistenced" "$DRIVER_ROOT/usr/bin/"
  for lib in $(ldd "$GPUHEALTH_NVML_STANDIN/nvidia-smi" | grep -oE '/[^ ]+'); do
    cp -L "$lib" "$libs/"
  done
  loader=$(ldd "$GPUHEALTH_NVML_STANDIN/nvidia-smi" | grep -oE '/[^ ]*ld-linux[^ ]*')
  ln -sfn "${libs#"$DRIVER_ROOT"}/$(basename "$loader")" "$DRIVER_ROOT/lib64/$(basename "$loader")"
  mountpoint -q "$DRIVER_ROOT/var/lib/nvml-standin" ||
    mount --bind "$GPUHEALTH_STANDIN_ROOT" "$DRIVER_ROOT/var/lib/nvml-standin"
}

containerd_config() { # containerd-bin-dir
  mkdir -p "$node_dir/bin"
  # Both handlers' runtime is our stand-in, told where runc is and where
  # the stand-in's GPU device files are (a privileged container sees
  # them); the `nvidia` handler's also where the toolkit's CDI spec is.
  local runtime=$repo/target/node-standins/gpuhealth-nvidia-runtime
  local common="GPUHEALTH_HOST_GPU_DEVICES=$GPUHEALTH_STANDIN_ROOT/dev GPUHEALTH_RUNC=$(command -v runc)"
  cat >"$node_dir/bin/runc" <<SH
#!/bin/sh
$common exec $runtime "\$@"
SH
  cat >"$node_dir/bin/nvidia-container-runtime" <<SH
#!/bin/sh
GPUHEALTH_CDI_DIRS=$node_dir/cdi $common exec $runtime "\$@"
SH
  chmod +x "$node_dir/bin/runc" "$node_dir/bin/nvidia-container-runtime"
  cat >"$node_dir/containerd.toml" <<TOML
version = 3
root = "/var/lib/containerd"
state = "/run/containerd"
[grpc]
  address = "$CONTAINERD_SOCKET"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "$(cat "$node_dir/pause.ref")"
[plugins.'io.containerd.cri.v1.runtime']
  enable_cdi = true
  cdi_spec_dirs = ["$CDI_DIR"]
  # Root here lacks CAP_SYS_RESOURCE: without this every sandbox fails.
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "$node_dir/bin/runc"
        SystemdCgroup = false
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.nvidia]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.nvidia.options]
        BinaryName = "$node_dir/bin/nvidia-container-runtime"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "/etc/cni/net.d"
TOML
}

cni_config() {
  mkdir -p "$(dirname "$CNI_CONF")"
  cat >"$CNI_CONF" <<JSON
{
  "cniVersion": "1.0.0",
  "name": "gpuhealth",
  "plugins": [
    {"type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}},
    {"type": "loopback"}
  ]
}
JSON
}

kubelet_config() { # port
  local address
  address=$(cat "$state/node-address")
  cat >"$node_dir/kubelet.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# Who may call the kubelet: client certificates of the cluster's CA, and
# bearer tokens, each asked of the API server (webhook), never anonymous.
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $state/pki/ca.crt}
authorization: {mode: Webhook}
address: $address
port: $1
readOnlyPort: 0
healthzPort: 0
tlsCertFile: $node_dir/pki/kubelet-serving.crt
tlsPrivateKeyFile: $node_dir/pki/kubelet-serving.key
containerRuntimeEndpoint: unix://$CONTAINERD_SOCKET
cgroupDriver: cgroupfs
# This machine's cgroups are hybrid v1.
failCgroupV1: false
failSwapOn: false
clusterDomain: cluster.local
# A test machine's disk and memory: evict only when nearly out.
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
YAML
}

kube_proxy_config() {
  cat >"$node_dir/kube-proxy.yaml" <<YAML
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $node_dir/kube-proxy.kubeconfig}
hostnameOverride: $NAME
clusterCIDR: $POD_CIDR
mode: iptables
conntrack: {maxPerCore: 0}
healthzBindAddress: 127.0.0.1:$(free_port)
metricsBindAddress: 127.0.0.1:$(free_port)
YAML
}

up() {
  [[ $EUID -eq 0 ]] || { log "a kubelet needs root"; return 1; }
  [[ -f "$state/node-address" ]] || {
    log "the cluster in $state was not started for a real node: GPUHEALTH_CLUSTER_NODE=1 e2e/cluster/cluster.sh up"
    return 1
  }
  : "${GPUHEALTH_STANDIN_ROOT:?the stand-in GPUs directory}" "${GPUHEALTH_NVML_STANDIN:?the NVML stand-in binaries}"
  if alive kubelet; then
    log "the node is up"
    echo "NODE=$NAME"
    return 0
  fi
  local cluster_bin containerd_bin kubectl
  cluster_bin=$(cat "$state/bin")
  kubectl=("$cluster_bin/kubectl" --kubeconfig "$state/admin.kubeconfig")
  containerd_bin=$("$here/build.sh")
  mkdir -p "$node_dir/logs" "$node_dir/pids" "$node_dir/cdi"
  sysctl -n net.ipv4.ip_forward >"$node_dir/ip_forward"
  sysctl -qw net.ipv4.ip_forward=1

  pki
  kubeconfig kubelet kubelet-client
  kubeconfig kube-proxy kube-proxy
  # The API server's identity at the kubelet may use its API; kube-proxy
  # reads Services and EndpointSlices.
  "${kubectl[@]}" apply -f - >/dev/null <<YAML
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: gpuhealth-e2e-apiserver-kubelet}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: system:kubelet-api-admin}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: kube-apiserver-kubelet-client}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: gpuhealth-e2e-kube-proxy}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: system:node-proxier}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: system:kube-proxy}]
---
apiVersion: node.k8s.io/v1
kind: RuntimeClass
metadata: {name: nvidia}
handler: nvidia
YAML

  # The sandbox image, built here and imported below.
  cc -static -O2 -o "$repo/target/node-standins/pause" "$here/pause.c"
  python3 "$repo/images/pack.py" --bin-dir "$repo/target/node-standins" --out "$node_dir/images" \
    --repository gpuhealth.local/e2e "$here/pause.Dockerfile" | tail -n 1 >&2
  sed 's/@.*//' "$node_dir/images/pause.ref" >"$node_dir/pause.ref"
  nvidia_cdi_spec
  driver_root
  containerd_config "$containerd_bin"
  cni_config
  log "starting containerd"
  PATH="$containerd_bin:$PATH" launch containerd "$containerd_bin/containerd" --config "$node_dir/containerd.toml"
  wait_for containerd 60 "$containerd_bin/ctr" --address "$CONTAINERD_SOCKET" version
  import "$node_dir/images/pause.oci.tar"

  local port
  port=$(free_port)
  kubelet_config "$port"
  log "starting the kubelet as $NAME"
  # The GPU Operator's label for its device plugin; nvidia.com/gpu.present
  # is GPU feature discovery's to set, once the GPUs are found (a test sets
  # it).
  launch kubelet "$cluster_bin/kubelet" --config "$node_dir/kubelet.yaml" \
    --kubeconfig "$node_dir/kubelet.kubeconfig" --hostname-override "$NAME" \
    --node-ip "$(cat "$state/node-address")" \
    --node-labels nvidia.com/gpu.deploy.device-plugin=true
  wait_for "the Node to be Ready" 180 "${kubectl[@]}" wait --for=condition=Ready "node/$NAME" --timeout=1s
  kube_proxy_config
  log "starting kube-proxy"
  launch kube-proxy "$cluster_bin/kube-proxy" --config "$node_dir/kube-proxy.yaml"
  for c in "${components[@]}"; do
    alive "$c" || { log "$c exited; its log:"; tail -n 40 "$node_dir/logs/$c.log" >&2; return 1; }
  done
  log "ready: node $NAME"
  echo "NODE=$NAME"
  echo "CTR=$containerd_bin/ctr --address $CONTAINERD_SOCKET -n k8s.io"
}

import() {
  local containerd_bin archive ref
  containerd_bin=$("$here/build.sh")
  for archive in "$@"; do
    "$containerd_bin/ctr" --address "$CONTAINERD_SOCKET" -n k8s.io images import "$archive" >&2
    # The name with its digest too, as a pull by digest leaves it, so that a
    # manifest can name the image exactly.
    ref=${archive%.oci.tar}.ref
    if [[ -f "$ref" ]]; then
      "$containerd_bin/ctr" --address "$CONTAINERD_SOCKET" -n k8s.io images tag --force \
        "$(sed 's/@.*//' "$ref")" "$(sed 's/:[^:@]*@/@/' "$ref")" >/dev/null
    fi
  done
}

stop_pid() { # name
  local pid
  [[ -f "$node_dir/pids/$1" ]] || return 0
  pid=$(cat "$node_dir/pids/$1")
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
}

# The cgroups the kubelet and containerd made, deepest first, in every
# hierarchy (hybrid v1: one a controller, and the unified one).
our_cgroups() {
  find /sys/fs/cgroup -mindepth 2 -type d \( -name 'kubepods*' -o -path '*/kubepods*' \) 2>/dev/null |
    awk '{print length($0) " " $0}' | sort -rn | cut -d' ' -f2-
}

our_mounts() {
  awk '{print $2}' /proc/mounts |
    grep -E "^(/var/lib/kubelet|/run/containerd|/var/lib/containerd|/run/netns|/var/run/netns|$DRIVER_ROOT)(/|\$)" |
    awk '{print length($0) " " $0}' | sort -rn | cut -d' ' -f2- || true
}

our_chains() { # iptables or ip6tables
  command -v "$1-save" >/dev/null || return 0
  "$1-save" 2>/dev/null | grep -E '^:(KUBE-|CNI-)' | cut -d' ' -f1 || true
}

without_our_rules() { # iptables or ip6tables
  command -v "$1-save" >/dev/null || return 0
  local rules
  rules=$("$1-save" 2>/dev/null) || return 0
  grep -qE 'KUBE-|CNI-' <<<"$rules" || return 0
  # Our chains, and every rule that names one.
  grep -vE 'KUBE-|CNI-' <<<"$rules" | "$1-restore"
}

leftovers() {
  local found=()
  [[ -n "$(our_mounts)" ]] && found+=("mounts: $(our_mounts | tr '\n' ' ')")
  [[ -n "$(our_cgroups)" ]] && found+=("cgroups: $(our_cgroups | head -3 | tr '\n' ' ')")
  ip link show "$BRIDGE" >/dev/null 2>&1 && found+=("the bridge $BRIDGE")
  [[ -n "$(our_chains iptables)$(our_chains ip6tables)" ]] && found+=("iptables chains")
  [[ -n "$(ls /run/netns 2>/dev/null)" ]] && found+=("network namespaces: $(ls /run/netns | tr '\n' ' ')")
  local d
  for d in /var/lib/kubelet /var/lib/cni /run/containerd /var/lib/containerd "$CNI_CONF" /var/lib/gpuhealth-agent "$DRIVER_ROOT"; do
    [[ -e $d ]] && found+=("$d")
  done
  printf '%s\n' "${found[@]}"
}

down() {
  [[ -d "$node_dir" ]] || [[ -d /var/lib/kubelet ]] || return 0
  stop_pid kube-proxy
  stop_pid kubelet
  # Every process of every pod, then their cgroups.
  local cg
  while read -r cg; do
    [[ -n $cg ]] || continue
    { xargs -r kill -KILL <"$cg/cgroup.procs"; } 2>/dev/null || true
  done < <(our_cgroups)
  stop_pid containerd
  pkill -KILL -f 'containerd-shim-runc-v2 .*-address /run/containerd/containerd.sock' 2>/dev/null || true
  sleep 0.5
  while read -r cg; do
    [[ -n $cg ]] && rmdir "$cg" 2>/dev/null || true
  done < <(our_cgroups)
  local m
  while read -r m; do
    [[ -n $m ]] && umount -l "$m" 2>/dev/null || true
  done < <(our_mounts)
  local ns
  for ns in $(ls /run/netns 2>/dev/null); do ip netns delete "$ns" 2>/dev/null || rm -f "/run/netns/$ns"; done
  ip link del "$BRIDGE" 2>/dev/null || true
  without_our_rules iptables
  without_our_rules ip6tables
  # The node's disk too: the agent's journal (the shipped hostPath), the
  # driver root and the stand-in GPUs the test laid out.
  rm -rf "$DRIVER_ROOT"
  rmdir "$(dirname "$DRIVER_ROOT")" 2>/dev/null || true
  rm -rf /var/lib/kubelet /var/lib/cni /run/containerd /var/lib/containerd "$CNI_CONF" \
    "$CDI_DIR/k8s.device-plugin.nvidia.com-gpu.json" /var/lib/gpuhealth-agent /var/lib/gpuhealth-e2e-host
  if [[ -f "$node_dir/ip_forward" ]]; then
    sysctl -qw "net.ipv4.ip_forward=$(cat "$node_dir/ip_forward")"
  fi
  rm -rf "$node_dir"
  local left
  left=$(leftovers)
  if [[ -n $left ]]; then
    log "left behind:"
    echo "$left" >&2
    return 1
  fi
  log "down: nothing left behind"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  import)
    shift
    import "$@"
    ;;
  *)
    echo "usage: $0 up|down|import ARCHIVE..." >&2
    exit 2
    ;;
esac
