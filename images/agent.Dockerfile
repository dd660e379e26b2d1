# gpuhealth-agent: glibc, because NVML (libnvidia-ml.so.1, from the NVIDIA
# runtime or a driver root) is loaded at run time and a static binary
# cannot load it. distroless/cc has glibc, CA certificates and nothing else.
# Runs as root: a GPU reset needs it (see config/agent). nvidia-smi finds
# nvidia-persistenced's socket under /var/run, which must link to /run, where
# the NVIDIA runtime mounts it (make images adds the link).
# Build from the repository root:
#   docker build -f images/agent.Dockerfile -t gpuhealth-agent .
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
RUN cargo build --release --locked -p gpuhealth-agent

FROM gcr.io/distroless/cc-debian12
COPY --from=build /src/target/release/gpuhealth-agent /gpuhealth-agent
EXPOSE 8080
ENTRYPOINT ["/gpuhealth-agent"]
