# gpuhealth-operator on distroless/cc (glibc, CA certificates), non-root.
# Built like the agent, for one base and one toolchain across the images.
# Build from the repository root:
#   docker build -f images/operator.Dockerfile -t gpuhealth-operator .
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
RUN cargo build --release --locked -p gpuhealth-operator

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/gpuhealth-operator /gpuhealth-operator
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/gpuhealth-operator"]
