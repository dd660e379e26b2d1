# The real e2e node's sandbox ("pause") image: e2e/node/pause.c, static,
# built by node.sh and packed with images/pack.py.
FROM rust:1.95-bookworm AS build
COPY e2e/node/pause.c /pause.c
RUN cc -static -O2 -o /pause /pause.c

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /pause /pause
USER 65532:65532
ENTRYPOINT ["/pause"]
