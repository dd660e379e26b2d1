#!/usr/bin/env bash
# A real local Kubernetes control plane on loopback, with KWOK simulating
# nodes: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok.
#
#   cluster.sh up      start (or reuse) the cluster; prints the kubeconfig path
#   cluster.sh down    stop every process and remove the state directory
#   cluster.sh status  exit 0 when the cluster answers
#   cluster.sh restart COMPONENT
#                      SIGKILL one component (etcd, kube-apiserver, ...) and
#                      start it again as it was started; waits until the
#                      API server is ready again (the chaos runs use it)
#
# State (certificates, etcd data, logs, pids) lives in $GPUHEALTH_CLUSTER_DIR,
# default <repo>/target/e2e-cluster. Ports are picked free at start. K8S
# picks the Kubernetes minor (versions.env: 1.36 unless set); a running
# cluster of another minor is not reused.
#
# With GPUHEALTH_CLUSTER_NODE=1, `up` starts a cluster a real node can join
# (e2e/node/node.sh): the API server listens on the node's address
# ($NODE_ADDRESS, added to this machine's loopback interface, which pods
# reach through the `kubernetes` Service) instead of loopback, and reaches the
# kubelet with a client certificate of its own.
#
# With GPUHEALTH_CLUSTER_JOBS=1, `up` also runs the JobSet and LeaderWorkerSet
# controllers (built by controllers.sh) as host processes, with their CRDs
# and their admission webhooks, served on loopback; a running cluster
# without them gets them. `down` stops them whatever the variable says.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
state=${GPUHEALTH_CLUSTER_DIR:-$repo/target/e2e-cluster}
log() { echo "[cluster] $*" >&2; }
logs="$state/logs"
# shellcheck source=wait.sh
source "$here/wait.sh"
# shellcheck source=versions.env
source "$here/versions.env"

kubeconfig="$state/admin.kubeconfig"
components=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok)
# The real node's address: private, on this machine's loopback interface
# only (this kernel has no dummy links).
NODE_ADDRESS=10.213.0.1
with_node() { [[ "${GPUHEALTH_CLUSTER_NODE:-0}" == 1 ]]; }
# Started after the cluster, stopped before it (start_jobs).
job_controllers=(jobset-controller lws-controller)
with_jobs() { [[ "${GPUHEALTH_CLUSTER_JOBS:-0}" == 1 ]]; }

alive() {
  [[ -f "$state/pids/$1" ]] || return 1
  local pid
  pid=$(cat "$state/pids/$1")
  kill -0 "$pid" 2>/dev/null || return 1
  # Exited but not yet reaped (init reaps the components, in its own time)
  # is not alive: the state follows the command's name in parentheses.
  [[ "$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f1)" != Z ]]
}

answers() {
  [[ -f "$kubeconfig" && -f "$state/bin" ]] || return 1
  # A cluster started without the audit log a caller asks for is not the
  # cluster it needs: `up` starts it again with one.
  [[ "${GPUHEALTH_CLUSTER_AUDIT:-0}" != 1 || -f "$state/audit-policy.yaml" ]] || return 1
  ! with_node || [[ -f "$state/node-address" ]] || return 1
  [[ "$(cat "$state/k8s" 2>/dev/null)" == "$K8S" ]] || return 1
  local bin
  bin=$(cat "$state/bin")
  for c in "${components[@]}"; do alive "$c" || return 1; done
  "$bin/kubectl" --kubeconfig "$kubeconfig" get --raw /readyz >/dev/null 2>&1
}

terminate() { # component
  [[ -f "$state/pids/$1" ]] || return 0
  local pid
  pid=$(cat "$state/pids/$1")
  # Each component runs in its own process group (setsid).
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
  rm -f "$state/pids/$1"
}

stop() {
  [[ -d "$state" ]] || return 0
  local c
  # A real node first: its kubelet still talks to this API server.
  if [[ -d "$state/node" ]]; then
    GPUHEALTH_CLUSTER_DIR=$state "$here/../node/node.sh" down || true
  fi
  # Reverse order: clients first (the job controllers, when started), etcd
  # last.
  for c in "${job_controllers[@]}"; do terminate "$c"; done
  for ((i = ${#components[@]} - 1; i >= 0; i--)); do
    terminate "${components[i]}"
  done
  if [[ -f "$state/node-address" ]]; then
    ip addr del "$NODE_ADDRESS/32" dev lo 2>/dev/null || true
  fi
  rm -rf "$state"
}

free_ports() {
  python3 - "$1" <<'PY'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}

pki() {
  local d="$state/pki"
  mkdir -p "$d"
  (
    cd "$d"
    openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=gpuhealth-e2e-ca" \
      -keyout ca.key -out ca.crt 2>/dev/null
    sign() { # name subject extensions
      openssl req -newkey rsa:2048 -nodes -subj "$2" -keyout "$1.key" -out "$1.csr" 2>/dev/null
      printf '%s\n' "$3" >"$1.ext"
      openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
        -extfile "$1.ext" -out "$1.crt" 2>/dev/null
    }
    sign apiserver "/CN=kube-apiserver" \
      "subjectAltName=IP:127.0.0.1,IP:10.96.0.1,IP:$NODE_ADDRESS,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc
extendedKeyUsage=serverAuth"
    sign admin "/O=system:masters/CN=admin" "extendedKeyUsage=clientAuth"
    # How the API server proves itself to a kubelet (logs, exec, the
    # kubelet's webhook authorization asks what this user may do).
    sign kubelet-client "/CN=kube-apiserver-kubelet-client" "extendedKeyUsage=clientAuth"
    openssl genrsa -out sa.key 2048 2>/dev/null
    openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
  )
}

write_kubeconfig() { # port address
  cat >"$kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters:
- name: gpuhealth-e2e
  cluster:
    server: https://$2:$1
    certificate-authority: $state/pki/ca.crt
users:
- name: admin
  user:
    client-certificate: $state/pki/admin.crt
    client-key: $state/pki/admin.key
contexts:
- name: gpuhealth-e2e
  context:
    cluster: gpuhealth-e2e
    user: admin
current-context: gpuhealth-e2e
KC
}

launch() { # name args...
  local name=$1
  shift
  # How it was started, for `restart`.
  mkdir -p "$state/cmd"
  printf '%s\0' "$@" >"$state/cmd/$name"
  # fd 9 is the `up` lock: the components must not hold it. Appended, so
  # that a restart keeps what came before.
  setsid "$@" >>"$state/logs/$name.log" 2>&1 </dev/null 9>&- &
  echo $! >"$state/pids/$name"
}

restart() { # component
  local c=$1 pid bin
  if [[ ! -f "$state/cmd/$c" || ! -f "$state/pids/$c" ]]; then
    log "no running $c started by this script in $state (started before restarts existed? cluster.sh down, then up)"
    return 1
  fi
  bin=$(cat "$state/bin")
  pid=$(cat "$state/pids/$c")
  kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
  for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  local args=()
  mapfile -d '' -t args <"$state/cmd/$c"
  log "restarting $c"
  launch "$c" "${args[@]}"
  wait_for "the API server after restarting $c" 120 \
    "$bin/kubectl" --kubeconfig "$kubeconfig" get --raw /readyz
  # A job controller is back once its webhooks answer again.
  case $c in
    jobset-controller) wait_for "the JobSet webhooks" 60 webhook_defaults "$bin" jobset ;;
    lws-controller) wait_for "the LeaderWorkerSet webhooks" 60 webhook_defaults "$bin" lws ;;
  esac
}

kwok_config() {
  local stages="$1/stages" out="$state/kwok.yaml"
  : >"$out"
  for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
    pod/general/pod-create.yaml pod/general/pod-init-container-running.yaml \
    pod/general/pod-init-container-completed.yaml pod/general/pod-ready.yaml \
    pod/general/pod-complete.yaml pod/general/pod-delete.yaml; do
    echo "---" >>"$out"
    cat "$stages/$f" >>"$out"
  done
  # Ours: what KWOK's stock stages leave out (see each file).
  for f in "$here"/stages/*.yaml; do
    echo "---" >>"$out"
    cat "$f" >>"$out"
  done
}

# The job controllers' webhooks: the API server runs on this machine, so it
# calls them at https://127.0.0.1:PORT, trusting a CA of their own (the
# controllers' own certificate management, which writes a Secret for an
# in-cluster Service, is turned off in their configuration).
webhook_pki() { # dir
  (
    cd "$1"
    openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=gpuhealth-e2e-webhook-ca" \
      -keyout ca.key -out ca.crt 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" -keyout tls.key -out tls.csr 2>/dev/null
    printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n' >tls.ext
    openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
      -extfile tls.ext -out tls.crt 2>/dev/null
  )
}

# The webhook configurations as each module's kustomization writes them (its
# own rules, object selectors and failure policies), with the in-cluster
# Service swapped for the loopback URL and the CA, and named apart as the
# modules' default installs name them (jobset-, lws-).
webhook_configs() { # bin kustomization prefix port cafile
  "$1/kubectl" kustomize "$2" |
    "$1/kubectl" --kubeconfig "$kubeconfig" create --dry-run=client -o json -f - |
    python3 -c '
import base64, json, sys
prefix, port, cafile = sys.argv[1:]
ca = base64.b64encode(open(cafile, "rb").read()).decode()
# kubectl writes one JSON document per object, one after the other.
text, docs, at, dec = sys.stdin.read(), [], 0, json.JSONDecoder()
while text[at:].strip():
    o, at = dec.raw_decode(text, len(text) - len(text[at:].lstrip()))
    docs.append(o)
items = []
for o in docs:
    if not o["kind"].endswith("WebhookConfiguration"):
        continue  # the Service the URL replaces
    o["metadata"] = {"name": prefix + "-" + o["metadata"]["name"]}
    for w in o["webhooks"]:
        path = w["clientConfig"]["service"].get("path", "/")
        w["clientConfig"] = {"url": "https://127.0.0.1:%s%s" % (port, path), "caBundle": ca}
    items.append(o)
json.dump({"apiVersion": "v1", "kind": "List", "items": items}, sys.stdout, indent=1)
' "$3" "$4" "$5"
}

# Whether the webhooks answer through the API server: a server-side dry run
# comes back with what only the mutating webhook writes (JobSet's DNS
# hostnames, LWS's subdomain policy).
webhook_defaults() { # bin kind
  local manifest field want
  case $2 in
    jobset)
      manifest='{"apiVersion":"jobset.x-k8s.io/v1alpha2","kind":"JobSet","metadata":{"name":"webhook-check","namespace":"default"},"spec":{"replicatedJobs":[{"name":"w","template":{"spec":{"template":{"spec":{"containers":[{"name":"c","image":"none"}]}}}}}]}}'
      field='{.spec.network.enableDNSHostnames}' want=true
      ;;
    lws)
      manifest='{"apiVersion":"leaderworkerset.x-k8s.io/v1","kind":"LeaderWorkerSet","metadata":{"name":"webhook-check","namespace":"default"},"spec":{"leaderWorkerTemplate":{"workerTemplate":{"spec":{"containers":[{"name":"c","image":"none"}]}}}}}'
      field='{.spec.networkConfig.subdomainPolicy}' want=Shared
      ;;
  esac
  [[ "$(echo "$manifest" | "$1/kubectl" --kubeconfig "$kubeconfig" create --dry-run=server \
    -o jsonpath="$field" -f - 2>/dev/null)" == "$want" ]]
}

jobs_running() {
  local c
  # Written last by start_jobs: a start cut short is started again.
  [[ -f "$state/jobs/ready" ]] || return 1
  for c in "${job_controllers[@]}"; do alive "$c" || return 1; done
}

start_jobs() { # bin
  local bin=$1 ctl d="$state/jobs" c
  local k=(--kubeconfig "$kubeconfig")
  ctl=$("$here/controllers.sh" build)
  # What is left of an earlier start (one exited): start both afresh.
  for c in "${job_controllers[@]}"; do terminate "$c"; done
  rm -rf "$d"
  mkdir -p "$d/certs"
  log "installing the JobSet and LeaderWorkerSet CRDs"
  # Server-side: LWS's CRDs are too large for client-side apply's
  # last-applied annotation.
  "$bin/kubectl" "${k[@]}" apply --server-side --force-conflicts \
    -f "$ctl/jobset/crds" -f "$ctl/lws/crds" >/dev/null
  # Retried: `kubectl wait` fails outright on a CRD with no conditions yet.
  wait_for "the CRDs" 60 "$bin/kubectl" "${k[@]}" wait --for condition=Established --timeout 10s \
    crd/jobsets.jobset.x-k8s.io crd/leaderworkersets.leaderworkerset.x-k8s.io \
    crd/disaggregatedsets.disaggregatedset.x-k8s.io
  webhook_pki "$d/certs"
  local js_webhook js_metrics js_health lws_webhook lws_metrics lws_health
  read -r js_webhook js_metrics js_health lws_webhook lws_metrics lws_health < <(free_ports 6)
  # One replica each: no leader election. Everything on loopback, on free
  # ports, so that clusters run side by side. The metrics endpoints serve
  # TLS (JobSet's from the same certificate directory) and ask the API
  # server who may read them.
  cat >"$d/jobset.yaml" <<CFG
apiVersion: config.jobset.x-k8s.io/v1alpha1
kind: Configuration
leaderElection:
  leaderElect: false
internalCertManagement:
  enable: false
webhook:
  host: 127.0.0.1
  port: $js_webhook
  certDir: $d/certs
metrics:
  bindAddress: 127.0.0.1:$js_metrics
  certDir: $d/certs
health:
  healthProbeBindAddress: 127.0.0.1:$js_health
CFG
  cat >"$d/lws.yaml" <<CFG
apiVersion: config.lws.x-k8s.io/v1alpha1
kind: Configuration
leaderElection:
  leaderElect: false
internalCertManagement:
  enable: false
webhook:
  host: 127.0.0.1
  port: $lws_webhook
  certDir: $d/certs
metrics:
  bindAddress: 127.0.0.1:$lws_metrics
health:
  healthProbeBindAddress: 127.0.0.1:$lws_health
CFG
  printf 'jobset webhook=%s metrics=%s health=%s\nlws webhook=%s metrics=%s health=%s\n' \
    "$js_webhook" "$js_metrics" "$js_health" "$lws_webhook" "$lws_metrics" "$lws_health" >"$d/ports"
  log "starting the JobSet and LeaderWorkerSet controllers"
  launch jobset-controller "$ctl/jobset-controller" "${k[@]}" --config "$d/jobset.yaml"
  # LWS's --leader-elect flag defaults to true and overrides its
  # configuration: say it here too.
  launch lws-controller "$ctl/lws-controller" "${k[@]}" --config "$d/lws.yaml" --leader-elect=false
  wait_for "the JobSet controller" 120 curl -sf "http://127.0.0.1:$js_health/readyz"
  wait_for "the LeaderWorkerSet controller" 120 curl -sf "http://127.0.0.1:$lws_health/readyz"
  webhook_configs "$bin" "$ctl/jobset/webhook" jobset "$js_webhook" "$d/certs/ca.crt" >"$d/jobset-webhooks.json"
  webhook_configs "$bin" "$ctl/lws/webhook" lws "$lws_webhook" "$d/certs/ca.crt" >"$d/lws-webhooks.json"
  "$bin/kubectl" "${k[@]}" apply --server-side --force-conflicts \
    -f "$d/jobset-webhooks.json" -f "$d/lws-webhooks.json" >/dev/null
  wait_for "the JobSet webhooks" 60 webhook_defaults "$bin" jobset
  wait_for "the LeaderWorkerSet webhooks" 60 webhook_defaults "$bin" lws
  for c in "${job_controllers[@]}"; do
    alive "$c" || { log "$c exited; its log:"; tail -n 40 "$state/logs/$c.log" >&2; return 1; }
  done
  touch "$d/ready"
  log "JobSet and LeaderWorkerSet controllers ready ($(tr '\n' ' ' <"$d/ports"))"
}

start() {
  # One `up` at a time: concurrent test processes share the cluster.
  mkdir -p "$(dirname "$state")"
  exec 9>"$state.lock"
  flock 9
  if answers; then
    if with_jobs && ! jobs_running; then start_jobs "$(cat "$state/bin")"; fi
    log "reusing the running cluster in $state"
    echo "$kubeconfig"
    return 0
  fi
  stop
  local bin
  bin=$("$here/build.sh")
  mkdir -p "$state/logs" "$state/pids" "$state/etcd"
  echo "$bin" >"$state/bin"
  echo "$K8S" >"$state/k8s"
  pki
  read -r etcd_client etcd_peer api cm sched kwok_port < <(free_ports 6)
  # Where the API server listens, and what it advertises: loopback, and a
  # documentation address nothing connects to (with the endpoint reconciler
  # off, the apiserver never uses it, but it refuses to start on a host
  # without a default route unless one is given); or, for a real node, the
  # node's address on this machine, advertised so that the
  # `kubernetes` Service leads pods there.
  local listen=127.0.0.1 apiserver_net=(--advertise-address 192.0.2.1 --endpoint-reconciler-type none)
  if with_node; then
    ip addr replace "$NODE_ADDRESS/32" dev lo
    echo "$NODE_ADDRESS" >"$state/node-address"
    listen=$NODE_ADDRESS
    apiserver_net=(--advertise-address "$NODE_ADDRESS"
      --kubelet-client-certificate "$state/pki/kubelet-client.crt"
      --kubelet-client-key "$state/pki/kubelet-client.key"
      --kubelet-certificate-authority "$state/pki/ca.crt"
      --kubelet-preferred-address-types InternalIP)
  fi
  write_kubeconfig "$api" "$listen"
  local k=(--kubeconfig "$kubeconfig")

  log "starting etcd on 127.0.0.1:$etcd_client"
  launch etcd "$bin/etcd" --name e2e --data-dir "$state/etcd" \
    --listen-client-urls "http://127.0.0.1:$etcd_client" --advertise-client-urls "http://127.0.0.1:$etcd_client" \
    --listen-peer-urls "http://127.0.0.1:$etcd_peer" --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer" \
    --initial-cluster "e2e=http://127.0.0.1:$etcd_peer" --unsafe-no-fsync --log-level warn
  wait_for etcd 60 curl -sf "http://127.0.0.1:$etcd_client/health"

  log "starting kube-apiserver on 127.0.0.1:$api"
  # DRA's DeviceTaintRule (per-GPU quarantine) is a beta API off by
  # default in 1.36: served in resource.k8s.io/v1beta2, and heeded by the
  # scheduler (and the controller manager's eviction, for NoExecute) only
  # with DRADeviceTaintRules on. From 1.37 it is GA (resource.k8s.io/v1),
  # on by default: nothing to turn on.
  local dra_gates=() dra_apis=()
  if [[ "$K8S" == 1.36 ]]; then
    dra_gates=(--feature-gates=DRADeviceTaintRules=true)
    dra_apis=(--runtime-config resource.k8s.io/v1beta2=true)
  fi
  # The audit log, when asked for (`make chaos`): every write, with the
  # User-Agent that names the replica making it, and the Lease writes whole,
  # so that the chaos checker judges leadership from the API server's own
  # record (e2e/src/audit.rs). Off by default: it costs the benchmark time.
  local audit=()
  if [[ "${GPUHEALTH_CLUSTER_AUDIT:-0}" == 1 ]]; then
    cat >"$state/audit-policy.yaml" <<'POLICY'
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: RequestResponse
  verbs: [create, update, patch]
  resources: [{group: coordination.k8s.io, resources: [leases]}]
- level: Metadata
  verbs: [create, update, patch, delete, deletecollection]
- level: None
POLICY
    audit=(--audit-policy-file "$state/audit-policy.yaml" --audit-log-path "$state/audit.log"
      --audit-log-format json --audit-log-maxsize 2000 --audit-log-maxbackup 1)
  fi
  launch kube-apiserver "$bin/kube-apiserver" "${dra_gates[@]}" "${dra_apis[@]}" "${audit[@]}" \
    --etcd-servers "http://127.0.0.1:$etcd_client" \
    --bind-address "$listen" --secure-port "$api" "${apiserver_net[@]}" \
    --service-cluster-ip-range 10.96.0.0/16 \
    --client-ca-file "$state/pki/ca.crt" \
    --tls-cert-file "$state/pki/apiserver.crt" --tls-private-key-file "$state/pki/apiserver.key" \
    --service-account-issuer https://kubernetes.default.svc \
    --service-account-key-file "$state/pki/sa.pub" \
    --service-account-signing-key-file "$state/pki/sa.key" \
    --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction \
    --allow-privileged=true --profiling=false
  wait_for kube-apiserver 120 "$bin/kubectl" "${k[@]}" get --raw /readyz

  log "starting kube-controller-manager, kube-scheduler and kwok"
  launch kube-controller-manager "$bin/kube-controller-manager" "${k[@]}" "${dra_gates[@]}" \
    --authentication-kubeconfig "$kubeconfig" --authorization-kubeconfig "$kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$cm" --leader-elect=false \
    --service-account-private-key-file "$state/pki/sa.key" --root-ca-file "$state/pki/ca.crt" \
    --use-service-account-credentials=false --profiling=false
  launch kube-scheduler "$bin/kube-scheduler" "${k[@]}" "${dra_gates[@]}" \
    --authentication-kubeconfig "$kubeconfig" --authorization-kubeconfig "$kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$sched" --leader-elect=false --profiling=false
  kwok_config "$bin"
  launch kwok "$bin/kwok" "${k[@]}" --config "$state/kwok.yaml" \
    --manage-all-nodes=false --manage-nodes-with-annotation-selector kwok.x-k8s.io/node=fake \
    --node-lease-duration-seconds 40 --cidr 10.0.0.0/16 --node-ip 10.0.0.1 \
    --server-address "127.0.0.1:$kwok_port"

  # The controller manager is working once it has made the default
  # ServiceAccount, which every pod needs.
  wait_for "the default ServiceAccount" 120 "$bin/kubectl" "${k[@]}" get serviceaccount default -n default
  for c in "${components[@]}"; do
    alive "$c" || { log "$c exited; its log:"; tail -n 40 "$state/logs/$c.log" >&2; return 1; }
  done
  if with_jobs; then start_jobs "$bin"; fi
  log "ready: export KUBECONFIG=$kubeconfig"
  echo "$kubeconfig"
}

case "${1:-}" in
  up) start ;;
  down) stop ;;
  status) answers ;;
  restart) restart "${2:?which component}" ;;
  *)
    echo "usage: $0 up|down|status|restart COMPONENT" >&2
    exit 2
    ;;
esac
