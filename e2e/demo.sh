#!/usr/bin/env bash
# `make demo`: gpuhealth on a simulated GPU cluster.
#
# With KUBECONFIG unset, it starts the local cluster (real control plane,
# KWOK GPU nodes) and leaves it running for you to explore. With KUBECONFIG
# set, it installs into that cluster instead and creates no simulated nodes
# unless GPUHEALTH_DEMO_SIM_NODES=1 (they need KWOK running there).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
cd "$repo"
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

sim_nodes=${GPUHEALTH_DEMO_SIM_NODES:-}
if [[ -z "${KUBECONFIG:-}" ]]; then
  say "Starting the local GPU cluster (the first run builds it: 15-25 minutes)"
  KUBECONFIG=$(e2e/cluster/cluster.sh up | tail -n 1)
  export KUBECONFIG
  sim_nodes=1
  kubectl_bin="$(cat "$(dirname "$KUBECONFIG")/bin")/kubectl"
else
  kubectl_bin=$(command -v kubectl)
fi
export GPUHEALTH_E2E_KUBECONFIG=$KUBECONFIG
k() { "$kubectl_bin" "$@"; }

say "Building gpuhealth"
cargo build -q -p gpuhealth-e2e --bin gpuhealth-sim

say "Installing the CRDs: kubectl apply -k config/default"
k apply --server-side -k config/default
k wait --for condition=Established --timeout 60s crd/gpuhealthpolicies.gpuhealth.io crd/gpunodehealths.gpuhealth.io

if [[ -n "$sim_nodes" ]]; then
  say "Ten simulated GPU nodes (KWOK; 8 x RTX 5090 D each, as in the incident)"
  target/debug/gpuhealth-sim nodes --group gpu-node --count 10
  k get nodes -l gpuhealth.io/sim-group=gpu-node \
    -L nvidia.com/gpu.product -L nvidia.com/gpu.count

  say "A vLLM Deployment holding one GPU per pod"
  target/debug/gpuhealth-sim deploy --namespace ml-serving --name vllm --group gpu-node --replicas 8 --gpus-per-pod 1
  k get pods -n ml-serving -o wide
fi

say "Sample policies: kubectl apply -k config/samples"
k apply --server-side -k config/samples
k get ghp gpu-nodes -o yaml | sed -n '/^spec:/,/^status:/p'

say "An invalid policy is refused, naming the field"
k apply --dry-run=server -f - <<'YAML' || true
apiVersion: gpuhealth.io/v1alpha1
kind: GpuHealthPolicy
metadata:
  name: broken
spec:
  nodeSelector: {}
  escalation: [{action: NodeReboot}, {action: GpuReset}]
  maxConcurrent: 150%
YAML

say "kubectl get gpuhealth"
k get gpuhealth

cat <<MSG

The operator that fills in the NODES/HEALTHY columns and creates one
GpuNodeHealth per node is the next piece of work (see README.md).

Explore:  export KUBECONFIG=$KUBECONFIG
Stop:     make cluster-down
MSG
