# syntax=docker/dockerfile:1
# The gateway image (ghcr.io/sluice-dev/sluice-gateway). Build from the repository root: `make images`.
# The gateway links rustls (no OpenSSL), so the runtime image needs only glibc and libgcc.
FROM rust:1.89-bookworm AS build
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends protobuf-compiler \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p sluice-gateway --bin sluice-gateway \
 && cp target/release/sluice-gateway /usr/local/bin/sluice-gateway

# The sandbox image's Python (python:3.11-slim-bookworm), so that the gateway checks each HookChain
# generation's code with the interpreter the hooks will run on (sluice-gateway --python).
FROM python:3.11-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1
COPY --from=build /usr/local/bin/sluice-gateway /usr/local/bin/sluice-gateway
USER 65534:65534
EXPOSE 50051 9464
ENTRYPOINT ["/usr/local/bin/sluice-gateway"]
