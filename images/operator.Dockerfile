# gpuhealth-operator: a static binary (musl) on distroless/static, non-root.
# Build from the repository root:
#   docker build -f images/operator.Dockerfile -t gpuhealth-operator .
FROM rust:1.95-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends musl-tools \
    && rm -rf /var/lib/apt/lists/* \
    && rustup target add x86_64-unknown-linux-musl
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY crates crates
# A workspace member: cargo reads its manifest even when not building it.
COPY e2e e2e
RUN cargo build --release --locked --target x86_64-unknown-linux-musl -p gpuhealth-operator

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /src/target/x86_64-unknown-linux-musl/release/gpuhealth-operator /gpuhealth-operator
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/gpuhealth-operator"]
