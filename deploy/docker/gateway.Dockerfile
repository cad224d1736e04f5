# syntax=docker/dockerfile:1
# The gateway image (ghcr.io/sluice-dev/sluice-gateway). Build from the repository root: `make images-docker` (`make images` builds the same without a daemon).
# The gateway links rustls (no OpenSSL), so the runtime image needs only glibc and libgcc.
FROM rust:1.95-bookworm AS build
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends protobuf-compiler python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --workspace --bins \
 && SLUICE_CELL_CACHE=/tmp/cell supervisor/build-cell.sh release \
 && mkdir -p /out \
 && cp target/release/sluice-gateway target/release/sluice-supervisor target/release/sluice-cell.cwasm \
       target/release/sluice-cell.cwasm.sha256 /out/

# The supervisor and its cell runtime beside the gateway: it checks each HookChain generation's code
# with the CPython the hooks run on, so the runtime image needs no Python of its own.
FROM debian:bookworm-slim
COPY --from=build --chown=0:0 --chmod=0555 /out/sluice-gateway /out/sluice-supervisor /usr/local/bin/
COPY --from=build --chown=0:0 --chmod=0444 /out/sluice-cell.cwasm /out/sluice-cell.cwasm.sha256 /usr/local/bin/
USER 65534:65534
EXPOSE 50051 9464
ENTRYPOINT ["/usr/local/bin/sluice-gateway"]
