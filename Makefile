# gpuhealth: `make demo` shows it, `make test` proves it. See README.md.
SHELL := /usr/bin/env bash
# Two cores: one heavy build at a time.
export CARGO_BUILD_JOBS ?= 2
CLUSTER := e2e/cluster/cluster.sh
# The test cluster's Kubernetes minor (e2e/cluster/versions.env): 1.36
# unless given, as in `make cluster-up K8S=1.37` (its own cluster state:
# `GPUHEALTH_CLUSTER_DIR` for two at once).
ifdef K8S
export K8S
endif
TARGET_DIR := $(or $(CARGO_TARGET_DIR),$(CURDIR)/target)

.PHONY: build images crds docs chart-docs release release-smoke set-version lint unit e2e e2e-node chaos chaos-bounded previous-release previous-build fuzz fuzz-smoke bench bench-smoke bench-gangs peer-nhc test cluster-up cluster-down demo clean

build:
	cargo build --workspace --all-targets

# The operator, agent and plugin images, as the Dockerfiles in images/
# describe them, without a container engine: a release build, a base from
# Debian's packages, OCI archives in target/images (images/pack.py).
images:
	cargo build --release -p gpuhealth-operator -p gpuhealth-agent -p kubectl-gpuhealth
	python3 images/pack.py --bin-dir $(TARGET_DIR)/release --out target/images images/*.Dockerfile

# Regenerate crds/ and the chart's crds/ from the Rust types; commit the result.
crds:
	cargo run -q -p gpuhealth-api --bin crdgen -- --kustomize crds --chart charts/gpuhealth/crds

# Regenerate docs/reference.md from the CRD schemas; commit the result.
docs:
	cargo run -q -p gpuhealth-api --bin docgen -- docs/reference.md

# A release (scripts/release.sh): images, chart, CRDs, the plugin for each
# platform this machine can build it for with its krew manifest, release
# notes, under target/release-artifacts/; VERSION must be the workspace's
# (`set-version` changes it). `release-smoke`, in `make test`: the same from
# the dev profile, this machine's plugin alone.
release:
	VERSION=$(VERSION) scripts/release.sh

release-smoke:
	scripts/release.sh --smoke

set-version:
	python3 scripts/set-version.py $(VERSION)

# Regenerate the chart's README from its values.yaml; commit the result.
chart-docs:
	python3 scripts/chart-readme.py

# The docs check (scripts/check-docs.py): no package registry's address in
# the repository, every relative link resolves, README.md and docs/ link
# nowhere outside it, and every path and test they name exists. The chart:
# `helm lint`, its README up to date with its values, and the chart
# rendered by `helm template` the same objects as config/ by kustomize
# (scripts/check-chart.py; the CRDs' drift is a unit test).
lint:
	python3 scripts/check-docs.py
	python3 scripts/check-structure.py
	scripts/helm.sh lint --strict charts/gpuhealth
	python3 scripts/chart-readme.py --check
	python3 scripts/check-chart.py
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings

# Unit, property and CRD-drift tests: no cluster needed.
unit:
	cargo test

# Everything against a real kube-apiserver with KWOK GPU nodes, in two
# lanes with a cluster each (e2e/lanes.sh). Builds the control plane on
# first use (cached in ~/.cache/gpuhealth).
e2e:
	cargo build -p gpuhealth-operator -p gpuhealth-agent -p kubectl-gpuhealth -p gpuhealth-e2e --bins --tests
	e2e/lanes.sh

# The shipped install on a real kubelet node (e2e/node/: kubelet,
# containerd, the NVIDIA runtime and device plugin stand-ins) joined to a
# cluster of its own: the images built, config/default applied, the
# incident end to end (e2e/tests/real_node.rs). Needs root; the node and
# the cluster are stopped after, leaving nothing behind.
e2e-node: images
	cargo build -p gpuhealth-e2e --tests
	e2e/node/build.sh >/dev/null
	GPUHEALTH_CLUSTER_NODE=1 GPUHEALTH_CLUSTER_DIR=$(CURDIR)/target/node-cluster \
	  e2e/cluster/with-cluster.sh cargo test -p gpuhealth-e2e --test real_node

# Fleet-scale figures on a fresh local cluster of its own: release builds,
# BENCH_NODES (1000) nodes; results, summary and plots in bench/results/.
# Not part of `make test`; `bench-smoke` is.
BENCH_NODES ?= 1000
BENCH_ARGS ?=
bench: peer-nhc
	cargo build --release -p gpuhealth-operator -p gpuhealth-agent -p gpuhealth-bench
	GPUHEALTH_BIN_DIR=$(TARGET_DIR)/release GPUHEALTH_CLUSTER_DIR=$(CURDIR)/target/bench-cluster \
	  $(PEER_ENV) e2e/cluster/with-cluster.sh $(TARGET_DIR)/release/gpuhealth-bench --nodes $(BENCH_NODES) $(BENCH_ARGS)
	# The newest results: a run that crosses midnight is named by its start.
	bench/plot.sh $$(ls -t bench/results/20*.json | head -1)

# The training gang's comparison alone (bench/src/gangs.rs): GPU-hours a
# 32-node gang loses to one bad GPU, Whole against Member, on a cluster of
# its own; bench/results/<date>-gangs.{json,md}. Not part of `make test`.
bench-gangs:
	cargo build -p gpuhealth-operator -p gpuhealth-bench
	GPUHEALTH_CLUSTER_DIR=$(CURDIR)/target/bench-gangs-cluster e2e/cluster/with-cluster.sh \
	  $(TARGET_DIR)/debug/gpuhealth-bench --only-gangs $(BENCH_ARGS)

# The peer the benchmark runs beside gpuhealth, Medik8s Node Healthcheck:
# built from its checkout (NHC_DIR: its source/ and recipe/) with Go modules
# from the module proxy, in a copy (the checkout may be read-only).
NHC_DIR ?= $(abspath $(CURDIR)/../shared/peers/medik8s-node-healthcheck)
NHC_BIN := $(CURDIR)/target/peers/nhc-manager
# Given to the benchmark where it was built.
PEER_ENV = env $$([ -x $(NHC_BIN) ] && echo GPUHEALTH_NHC_DIR=$(NHC_DIR) GPUHEALTH_NHC_BIN=$(NHC_BIN))
peer-nhc:
	@if [ ! -d "$(NHC_DIR)/source" ]; then \
	  echo "[peer-nhc] no peer checkout at $(NHC_DIR): the benchmark runs without it"; \
	elif [ -x $(NHC_BIN) ] && [ -z "$$(find $(NHC_DIR)/source -newer $(NHC_BIN) -type f | head -1)" ]; then \
	  echo "[peer-nhc] $(NHC_BIN) is up to date"; \
	else \
	  set -e; rm -rf target/peers/nhc-src && mkdir -p target/peers; \
	  cp -r $(NHC_DIR)/source target/peers/nhc-src && chmod -R u+w target/peers/nhc-src; \
	  cd target/peers/nhc-src && CGO_ENABLED=0 GOFLAGS=-mod=mod \
	    go build -trimpath -ldflags '-s -w' -o $(NHC_BIN) ./cmd/; \
	fi

# The whole benchmark at 10 nodes, the peer beside it, so that it cannot rot.
bench-smoke: peer-nhc
	cargo test -p gpuhealth-bench
	cargo build -p gpuhealth-operator -p gpuhealth-agent -p gpuhealth-bench
	GPUHEALTH_CLUSTER_DIR=$(CURDIR)/target/bench-smoke-cluster $(PEER_ENV) e2e/cluster/with-cluster.sh \
	  $(TARGET_DIR)/debug/gpuhealth-bench --nodes 10 --small 4 --faults 2 --fault-interval-ms 100 \
	  --storm 3 --max-concurrent 2 --quiet-secs 10 --agents 1 --extra-pods 1 \
	  --drain-pods 20 --drain-repeats 1 --gang-nodes 2 --gang-notice-secs 5 --peer-at 10 --peer-nodes 3 --peer-faults 4 \
	  --peer-storm 2 --peer-rest-secs 5 --detect-nodes 2 --detect-faults 2 \
	  --large 26 --large-step 8 --large-measure-at 18 --large-peer-at 18 --large-faults 2 --large-peer-faults 2 --pass-faults 2 \
	  --out target/bench-smoke --label smoke
	bench/plot.sh target/bench-smoke/smoke.json

# Reliability (docs/reliability.md): operator kills, API server and etcd
# restarts, conflicting writers, storms, each judged by an independent
# watcher; prints a table and writes it to target/chaos.md. `chaos-bounded`
# is the shorter run `make test` includes. It runs on a cluster of its own
# (target/chaos-cluster), started with the audit log its checker reads and
# stopped after: never on the cluster `make demo` leaves running.
CHAOS_ARGS ?=
chaos: previous-release
	cargo build -p gpuhealth-operator -p gpuhealth-agent -p gpuhealth-e2e --bins
	GPUHEALTH_CLUSTER_AUDIT=1 GPUHEALTH_CLUSTER_DIR=$(CURDIR)/target/chaos-cluster \
	  e2e/cluster/with-cluster.sh $(TARGET_DIR)/debug/gpuhealth-chaos --out target/chaos.md $(CHAOS_ARGS)

chaos-bounded:
	$(MAKE) chaos CHAOS_ARGS="--kill-trials 4 --fence-kill-trials 1 --restart-trials 2 --fencing-trials 1 --late-partition-trials 1 --lag-trials 1 --conflict-trials 2 --hostile-trials 1 --newcomer-trials 2 --storm-trials 1 --upgrade-trials 4"

# The release before this one, for the chaos run's upgrade scenario: the
# operator and agent of commit PREVIOUS (the one before HEAD), built from git into
# target/previous (its own target directory, so that neither build undoes
# the other's).
PREVIOUS ?= HEAD~1
previous-release:
	@if ! git rev-parse --verify -q '$(PREVIOUS)^{commit}' >/dev/null; then \
	  echo "[previous-release] this clone has no commit $(PREVIOUS) (a shallow clone?): the upgrade scenario will say it did not run"; \
	  rm -rf target/previous; exit 0; \
	fi; \
	$(MAKE) previous-build

previous-build:
	rm -rf target/previous-src && git worktree prune
	git worktree add --detach target/previous-src $(PREVIOUS)
	cd target/previous-src && env -u CARGO_TARGET_DIR cargo build -p gpuhealth-operator -p gpuhealth-agent --target-dir $(CURDIR)/target/previous; \
	  status=$$?; cd $(CURDIR) && git worktree remove --force target/previous-src; exit $$status

# Fuzzing what gpuhealth reads from others (fuzz/: the GPU report, the
# request and result annotations, the maintenance notice, the kernel log),
# FUZZ_SECS each, from the committed corpus: one minimised archive a target,
# fuzz/corpus/<target>.tar.gz, unpacked into fuzz/target/corpus/<target>;
# with FUZZ_KEEP=yes what the run added is packed back, minimised
# (scripts/fuzz-corpus.sh). Needs nightly Rust and cargo-fuzz, installed
# here when missing; builds in fuzz/target, whatever CARGO_TARGET_DIR says
# (libFuzzer's flags). `fuzz-smoke` is the brief run `make test` includes.
FUZZ_SECS ?= 600
FUZZ_KEEP ?= yes
FUZZ_TARGETS := gpu_report requests maintenance kernel_log
fuzz:
	rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
	command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
	cd fuzz && for t in $(FUZZ_TARGETS); do \
	  ../scripts/fuzz-corpus.sh unpack $$t target/corpus/$$t || exit 1; \
	  if [ "$(FUZZ_KEEP)" = no ]; then dirs="$$(mktemp -d) target/corpus/$$t"; else dirs=target/corpus/$$t; fi; \
	  env -u CARGO_TARGET_DIR cargo +nightly fuzz run -s none -O $$t $$dirs -- -max_total_time=$(FUZZ_SECS) -rss_limit_mb=1024 || exit 1; \
	  if [ "$(FUZZ_KEEP)" = yes ]; then ../scripts/fuzz-corpus.sh pack $$t target/corpus/$$t || exit 1; fi; \
	done

# New inputs go to a scratch directory, so that a test run leaves the
# committed corpus as it was.
fuzz-smoke:
	$(MAKE) fuzz FUZZ_SECS=15 FUZZ_KEEP=no

# Everything, in this order, each stage timed (target/test-times.md).
TEST_STAGES := lint unit release-smoke e2e e2e-node chaos-bounded fuzz-smoke bench-smoke
test:
	@MAKE='$(MAKE)' scripts/timed-stages.sh $(TEST_STAGES)

cluster-up:
	@$(CLUSTER) up

cluster-down:
	@$(CLUSTER) down

demo:
	e2e/demo.sh

clean: cluster-down
	cargo clean
