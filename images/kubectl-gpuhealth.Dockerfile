# kubectl-gpuhealth, for CI jobs and toolboxes, on distroless/cc, non-root.
# On a workstation, `cargo install --path crates/kubectl-gpuhealth` puts it
# on PATH instead.
# Build from the repository root:
#   docker build -f images/kubectl-gpuhealth.Dockerfile -t kubectl-gpuhealth .
# Without Docker, `make images` builds the same image from this file's
# last stage (images/pack.py).
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
# Every workspace member: cargo reads each manifest even when it builds one
# package (e2e/tests/images.rs checks this list against cargo metadata).
COPY crates crates
COPY e2e e2e
COPY bench bench
RUN cargo build --release --locked -p kubectl-gpuhealth

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/kubectl-gpuhealth /kubectl-gpuhealth
USER 65532:65532
ENTRYPOINT ["/kubectl-gpuhealth"]
