# gpuhealth: `make demo` shows it, `make test` proves it. See README.md.
SHELL := /usr/bin/env bash
# Two cores: one heavy build at a time.
export CARGO_BUILD_JOBS ?= 2
CLUSTER := e2e/cluster/cluster.sh

.PHONY: build crds docs lint unit e2e test cluster-up cluster-down demo clean

build:
	cargo build --workspace --all-targets

# Regenerate crds/ from the Rust types; commit the result.
crds:
	cargo run -q -p gpuhealth-api --bin crdgen -- crds

# Regenerate docs/reference.md from the CRD schemas; commit the result.
docs:
	cargo run -q -p gpuhealth-api --bin docgen -- docs/reference.md

lint:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings

# Unit, property and CRD-drift tests: no cluster needed.
unit:
	cargo test

# Everything against a real kube-apiserver with KWOK GPU nodes. Builds the
# control plane on first use (cached in ~/.cache/gpuhealth).
e2e:
	cargo build -p gpuhealth-operator -p gpuhealth-agent -p kubectl-gpuhealth -p gpuhealth-e2e --bins --tests
	e2e/cluster/with-cluster.sh cargo test -p gpuhealth-e2e

test: lint unit e2e

cluster-up:
	@$(CLUSTER) up

cluster-down:
	@$(CLUSTER) down

demo:
	e2e/demo.sh

clean: cluster-down
	cargo clean
