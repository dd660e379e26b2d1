# The real-node e2e's GPU workload (e2e/workload/gpu-workload.c): holds the
# GPUs its container was given, non-root. Built by the e2e harness with
# images/pack.py from the static binary e2e/build.rs makes.
FROM rust:1.95-bookworm AS build
COPY e2e/workload/gpu-workload.c /gpu-workload.c
RUN cc -static -O2 -o /gpu-workload /gpu-workload.c

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /gpu-workload /gpu-workload
USER 65532:65532
ENTRYPOINT ["/gpu-workload"]
