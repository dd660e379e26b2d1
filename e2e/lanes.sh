#!/usr/bin/env bash
# Runs the e2e tests in lanes at once, each against a local cluster of its
# own: every file in one of two lanes on the default Kubernetes minor, and
# the files that differ by minor in a third on the other. A test's operator
# manages every node of its cluster, so test files never share one (cargo
# runs a lane's files one after another); the tests mostly wait on their
# API server, so lanes on two cores take little more than the longest of
# them. With GPUHEALTH_E2E_KUBECONFIG set (a cluster of yours), everything
# runs in one lane on it.
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${GPUHEALTH_E2E_KUBECONFIG:-}" ]]; then
  exec cargo test -p gpuhealth-e2e
fi

# The first lane: about half of the whole, by the seconds each file took on
# two cores (remediation 232, install 138, diagnosis 50, agent 44,
# newcomers 44, nvml_node 28, contract 22, access 21, gpu_cluster 12; the
# second lane took 609 s with nvml_node in it, the first 564). Every other
# file, new ones included, and the library's and binaries' own tests run in
# the second.
first=(remediation install diagnosis newcomers agent access gpu_cluster contract nvml_node)
first_args=() second_args=(--lib --bins) second=()
for file in e2e/tests/*.rs; do
  name=$(basename "$file" .rs)
  # The real node is one per machine, on a cluster of its own: make e2e-node.
  [[ $name == real_node ]] && continue
  if [[ " ${first[*]} " == *" $name "* ]]; then
    first_args+=(--test "$name")
  else
    second_args+=(--test "$name")
    second+=("$name")
  fi
done

# The files whose behaviour depends on the Kubernetes minor (DeviceTaintRule's
# version, the install, admission) run again, in a third lane, on the other
# minor the project supports (e2e/cluster/versions.env).
other_minor=1.37
on_other_minor=(quarantine install access helm)
other_args=()
for name in "${on_other_minor[@]}"; do other_args+=(--test "$name"); done

# The clusters start from the cached binaries: build them once. The second
# lane's cluster runs the JobSet and LeaderWorkerSet controllers too (the
# gangs file), built from their own modules.
e2e/cluster/build.sh >/dev/null || exit 1
K8S=$other_minor e2e/cluster/build.sh >/dev/null || exit 1
e2e/cluster/controllers.sh build >/dev/null || exit 1

# lane LABEL CLUSTER_DIR CARGO_TEST_ARGS...: prefixes each line with LABEL.
# K8S in the environment picks the cluster's minor.
lane() {
  local label=$1 dir=$2
  shift 2
  GPUHEALTH_CLUSTER_DIR=$dir e2e/cluster/with-cluster.sh \
    cargo test -p gpuhealth-e2e "$@" 2>&1 | sed -u "s/^/[$label] /"
}

# The lanes that run access.rs keep the API server's audit log: a test
# there reads each refusal of a forged trigger from it.
GPUHEALTH_CLUSTER_AUDIT=1 lane e2e-1 "$PWD/target/e2e-cluster" "${first_args[@]}" &
one=$!
GPUHEALTH_CLUSTER_JOBS=1 lane e2e-2 "$PWD/target/e2e-cluster-2" "${second_args[@]}" &
two=$!
K8S=$other_minor GPUHEALTH_CLUSTER_AUDIT=1 lane "e2e-$other_minor" "$PWD/target/e2e-cluster-$other_minor" "${other_args[@]}" &
three=$!
wait "$one"; status_one=$?
wait "$two"; status_two=$?
wait "$three"; status_three=$?
# Doc tests cannot be selected with the targets above; they need no cluster.
cargo test -p gpuhealth-e2e --doc; status_doc=$?
echo "[e2e] lane 1 (${first[*]}): exit $status_one"
echo "[e2e] lane 2 (library, binaries, ${second[*]}): exit $status_two"
echo "[e2e] lane 3, Kubernetes $other_minor (${on_other_minor[*]}): exit $status_three"
echo "[e2e] doc tests: exit $status_doc"
((status_one == 0 && status_two == 0 && status_three == 0 && status_doc == 0))
