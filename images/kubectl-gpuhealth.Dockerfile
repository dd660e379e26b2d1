# kubectl-gpuhealth, for CI jobs and toolboxes: a static binary on
# distroless/static. On a workstation, `cargo install --path
# crates/kubectl-gpuhealth` puts it on PATH instead.
# Build from the repository root:
#   docker build -f images/kubectl-gpuhealth.Dockerfile -t kubectl-gpuhealth .
FROM rust:1.95-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends musl-tools \
    && rm -rf /var/lib/apt/lists/* \
    && rustup target add x86_64-unknown-linux-musl
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY crates crates
# A workspace member: cargo reads its manifest even when not building it.
COPY e2e e2e
RUN cargo build --release --locked --target x86_64-unknown-linux-musl -p kubectl-gpuhealth

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /src/target/x86_64-unknown-linux-musl/release/kubectl-gpuhealth /kubectl-gpuhealth
USER 65532:65532
ENTRYPOINT ["/kubectl-gpuhealth"]
