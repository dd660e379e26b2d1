# The real-node e2e's stand-in for NVIDIA's device plugin
# (e2e/node/standins/cmd/gpuhealth-device-plugin), a static Go binary that
# e2e/node/build.sh builds; packed by the e2e harness with images/pack.py.
# Root, as NVIDIA's runs: it writes the kubelet's device-plugin socket.
FROM golang:1.26-bookworm AS build
COPY e2e/node/standins /src
RUN cd /src && CGO_ENABLED=0 go build -o /gpuhealth-device-plugin ./cmd/gpuhealth-device-plugin

FROM gcr.io/distroless/cc-debian12
COPY --from=build /gpuhealth-device-plugin /gpuhealth-device-plugin
ENTRYPOINT ["/gpuhealth-device-plugin"]
