# gpuhealth-agent: glibc, because NVML (libnvidia-ml.so, mounted from the
# host by the NVIDIA container toolkit) is loaded at run time and a static
# musl binary cannot load it. distroless/cc has glibc and nothing else.
# Runs as root: a GPU reset and /dev/kmsg need it (see config/agent).
# Build from the repository root:
#   docker build -f images/agent.Dockerfile -t gpuhealth-agent .
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY crates crates
# A workspace member: cargo reads its manifest even when not building it.
COPY e2e e2e
RUN cargo build --release --locked -p gpuhealth-agent

FROM gcr.io/distroless/cc-debian12
COPY --from=build /src/target/release/gpuhealth-agent /gpuhealth-agent
EXPOSE 8080
ENTRYPOINT ["/gpuhealth-agent"]
