#!/usr/bin/env bash
# `make demo`: the incident gpuhealth was built for, replayed on a simulated
# GPU cluster. An 8-GPU node serves eight vLLM pods; GPU 7 logs Xid 119 and
# Xid 154 (GPU Reset Required) while the node stays Ready. gpuhealth cordons
# it, evicts only the pod on GPU 7, resets that GPU, verifies, uncordons.
#
# With KUBECONFIG unset, it starts the local cluster (real control plane,
# KWOK GPU nodes) and leaves it running for you to explore. With KUBECONFIG
# set, it installs the CRDs and sample policies there and stops: the replay
# needs simulated nodes (KWOK) and the agent's fake backend, which a real cluster lacks.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
cd "$repo"
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

local_cluster=
if [[ -z "${KUBECONFIG:-}" ]]; then
  say "Starting the local GPU cluster (the first run builds it: 15-25 minutes)"
  KUBECONFIG=$(e2e/cluster/cluster.sh up | tail -n 1)
  export KUBECONFIG
  local_cluster=1
  kubectl_bin="$(cat "$(dirname "$KUBECONFIG")/bin")/kubectl"
else
  kubectl_bin=$(command -v kubectl)
fi
export GPUHEALTH_E2E_KUBECONFIG=$KUBECONFIG
k() { "$kubectl_bin" "$@"; }

say "Installing the CRDs and the sample policies: kubectl apply -k"
# The CRDs only: the operator and agent run here as local processes (a real
# cluster takes all of config/default). --force-conflicts: the e2e suite
# installs the same CRDs with its own field manager, and a number it wrote
# as 0 reads as a change from 0.0 here.
k apply --server-side --force-conflicts -k crds
k wait --for condition=Established --timeout 60s crd/gpuhealthpolicies.gpuhealth.io crd/gpunodehealths.gpuhealth.io
k apply --server-side -k config/samples

if [[ -z "$local_cluster" ]]; then
  k get gpuhealth
  echo "Installed. The incident replay needs the local simulated cluster: unset KUBECONFIG and run make demo."
  exit 0
fi

say "Building gpuhealth"
cargo build -q -p gpuhealth-operator -p gpuhealth-agent -p kubectl-gpuhealth -p gpuhealth-e2e --bins
# Where cargo put them: the rule of e2e/src/process.rs `built`.
bin=${CARGO_TARGET_DIR:-$repo/target}/debug
sim=$bin/gpuhealth-sim
# kubectl finds its plugins on PATH: `kubectl gpuhealth` is $bin/kubectl-gpuhealth.
export PATH="$bin:$PATH"
logs=target/demo
mkdir -p "$logs"
node=192.168.1.1

# A replay cut short leaves its node cordoned: start each replay afresh.
if k get node "$node" >/dev/null 2>&1 || k get namespace ml-serving >/dev/null 2>&1; then
  say "Clearing the previous replay"
  k delete namespace ml-serving --ignore-not-found --wait --timeout 120s
  k delete node "$node" --ignore-not-found --wait --timeout 60s
fi

say "A GPU fleet: nine nodes, and node $node (8 x RTX 5090 D), all KWOK"
$sim nodes --group fleet --count 9
$sim nodes --group incident --name "$node"
k get nodes -L nvidia.com/gpu.product -L nvidia.com/gpu.count

say "vLLM on $node: eight pods, one GPU each, one disruption at a time"
$sim deploy --namespace ml-serving --name vllm --group incident --replicas 8 --gpus-per-pod 1
k apply --server-side -f - <<'YAML'
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata: {name: vllm, namespace: ml-serving}
spec:
  maxUnavailable: 1
  selector: {matchLabels: {app: vllm}}
YAML
k get pods -n ml-serving -o wide
$sim hardware --node "$node" --namespace ml-serving

say "A policy for this fleet (defaults, but verification shortened to 10s for the demo)"
k apply --server-side -f - <<'YAML'
apiVersion: gpuhealth.io/v1alpha1
kind: GpuHealthPolicy
metadata: {name: demo-fleet}
spec:
  nodeSelector:
    matchExpressions: [{key: gpuhealth.io/sim-group, operator: In, values: [fleet, incident]}]
  priority: 100
  verification: {stableFor: 10s}
YAML

say "Starting the operator, and gpuhealth-agent on the node with its fake backend (logs in $logs/)"
# As cluster-admin, without the admission policies (this cluster is
# yours alone): the operator is told not to wait for them.
"$bin/gpuhealth-operator" --metrics-addr 127.0.0.1:0 --lease-name gpuhealth-demo \
  --skip-admission-check >"$logs/operator.log" 2>&1 &
operator=$!
rm -rf "$logs/agent-state"
"$bin/gpuhealth-agent" --backend fake --node-name "$node" --state-dir "$logs/agent-state" \
  --metrics-addr 127.0.0.1:0 >"$logs/agent.log" 2>&1 &
agent=$!
# The node's kubelet, as far as GPUs go: a pod that leaves frees its GPU.
$sim kubelet --node "$node" --namespace ml-serving >"$logs/kubelet.log" 2>&1 &
kubelet=$!
trap 'kill $operator $agent $kubelet 2>/dev/null || true' EXIT
# kubectl wait needs the object to exist: the operator creates it.
for _ in $(seq 1 120); do k get "gnh/$node" >/dev/null 2>&1 && break; sleep 0.5; done
k wait --for=jsonpath='{.status.phase}'=Healthy "gnh/$node" --timeout 60s >/dev/null
k get gpuhealth

say "GPU 7 of $node fails; the node stays Ready"
$sim xid --node "$node" --namespace ml-serving --gpu 7
k get node "$node"

say "gpuhealth takes it from here: kubectl get gnh $node, each time it changes"
columns=PHASE:.status.phase,BAD-GPUS:.status.badGpus,ACTION:.status.action.type,ATTEMPT:.status.action.attempt,REASON:.status.reason,MESSAGE:.status.message
printf '%-9s ' TIME; k get gnh "$node" -o custom-columns="$columns" | sed -n 1p
last="" left_healthy="" deadline=$((SECONDS + 180))
while ((SECONDS < deadline)); do
  row=$(k get gnh "$node" -o custom-columns="$columns" --no-headers 2>/dev/null || true)
  if [[ "$row" != "$last" ]]; then
    printf '%-9s %s\n' "$(date +%T)" "$row"
    last=$row
  fi
  phase=$(awk '{print $1}' <<<"$row")
  [[ "$phase" != Healthy ]] && left_healthy=1
  [[ -n "$left_healthy" && "$phase" == Healthy ]] && break
  sleep 0.5
done

say "The pods: only the one on GPU 7 was moved; its replacement runs once the node is back"
k rollout status deployment/vllm -n ml-serving --timeout 120s >/dev/null
k get pods -n ml-serving -o wide

say "The incident, as gpuhealth tells it: kubectl gpuhealth explain $node"
k gpuhealth explain "$node"

say "Which pod holds GPU 7 now (the runbook's crictl loop, in one command)"
k gpuhealth pods-on-gpu "$node" 7

say "The fleet at a glance: kubectl gpuhealth status"
k gpuhealth status

say "kubectl get gpuhealth"
k get gpuhealth

cat <<MSG

Explore:  export KUBECONFIG=$KUBECONFIG
Stop:     make cluster-down
MSG
