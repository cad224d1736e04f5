# syntax=docker/dockerfile:1
# The operator image (ghcr.io/sluice-dev/sluice-operator). Build from the repository root: `make images-docker` (`make images` builds the same without a daemon).
# The operator checks hook code (syntax, execute, imports) with the CPython hooks run on: the
# supervisor and its cell runtime sit beside it (`sluice-supervisor python`), so the runtime image
# needs no Python of its own; it runs as uid 65534 on a read-only root.
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
 && cp target/release/sluice-operator target/release/sluice-supervisor target/release/sluice-cell.cwasm \
       target/release/sluice-cell.cwasm.sha256 /out/

FROM debian:bookworm-slim
COPY --from=build --chown=0:0 --chmod=0555 /out/sluice-operator /out/sluice-supervisor /usr/local/bin/
COPY --from=build --chown=0:0 --chmod=0444 /out/sluice-cell.cwasm /out/sluice-cell.cwasm.sha256 /usr/local/bin/
USER 65534:65534
# 9465: metrics and /healthz; 9443: the admission webhook (HTTPS), with --webhook-listen.
EXPOSE 9465 9443
ENTRYPOINT ["/usr/local/bin/sluice-operator"]
