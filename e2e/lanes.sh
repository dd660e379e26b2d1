#!/usr/bin/env bash
# Runs the e2e tests in two lanes at once, each against a local cluster of
# its own. A test's operator manages every node of its cluster, so test
# files never share one (cargo runs a lane's files one after another); the
# tests mostly wait on their API server, so two lanes on two cores take
# little more than half the time of one. With GPUHEALTH_E2E_KUBECONFIG set
# (a cluster of yours), everything runs in one lane on it.
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

# Both clusters start from the same cached binaries: build them once.
e2e/cluster/build.sh >/dev/null || exit 1

# lane LABEL CLUSTER_DIR CARGO_TEST_ARGS...: prefixes each line with LABEL.
lane() {
  local label=$1 dir=$2
  shift 2
  GPUHEALTH_CLUSTER_DIR=$dir e2e/cluster/with-cluster.sh \
    cargo test -p gpuhealth-e2e "$@" 2>&1 | sed -u "s/^/[$label] /"
}

lane e2e-1 "$PWD/target/e2e-cluster" "${first_args[@]}" &
one=$!
lane e2e-2 "$PWD/target/e2e-cluster-2" "${second_args[@]}" &
two=$!
wait "$one"; status_one=$?
wait "$two"; status_two=$?
# Doc tests cannot be selected with the targets above; they need no cluster.
cargo test -p gpuhealth-e2e --doc; status_doc=$?
echo "[e2e] lane 1 (${first[*]}): exit $status_one"
echo "[e2e] lane 2 (library, binaries, ${second[*]}): exit $status_two"
echo "[e2e] doc tests: exit $status_doc"
((status_one == 0 && status_two == 0 && status_doc == 0))
