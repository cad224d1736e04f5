# syntax=docker/dockerfile:1
# The operator image (ghcr.io/sluice-dev/sluice-operator). Build from the repository root: `make images`.
# The operator checks hook code with python3 (syntax, execute, imports), so the runtime image is a
# slim Python one; it runs as uid 65534 on a read-only root.
FROM rust:1.89-bookworm AS build
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends protobuf-compiler \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p sluice-operator --bin sluice-operator \
 && cp target/release/sluice-operator /usr/local/bin/sluice-operator

FROM python:3.11-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1
COPY --from=build /usr/local/bin/sluice-operator /usr/local/bin/sluice-operator
USER 65534:65534
# 9465: metrics and /healthz; 9443: the admission webhook (HTTPS), with --webhook-listen.
EXPOSE 9465 9443
ENTRYPOINT ["/usr/local/bin/sluice-operator"]
