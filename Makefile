# Sluice: `make run` serves examples/ in local mode; `make test` runs every test.
CARGO ?= cargo
LISTEN ?= 127.0.0.1:50051
METRICS ?= 127.0.0.1:9464
STATE_DIR ?= /run/sluice/gateway

.PHONY: deps build run test test-rust test-python crds bench fmt lint clean

# What a fresh Debian machine needs: gVisor, protoc for the gRPC API, Python for the supervisor.
deps:
	@if ! command -v runsc >/dev/null || ! command -v protoc >/dev/null || ! [ -x /usr/bin/python3 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq runsc protobuf-compiler python3 >/dev/null; \
	fi

build: deps
	$(CARGO) build --release --workspace --bins

# The example services (fake LLM on :7001, credit ledger on :7002) run beside the gateway and stop with it.
run: build
	./target/release/sluice-example-services & services=$$!; \
	trap "kill $$services 2>/dev/null" EXIT INT TERM; \
	./target/release/sluice-gateway --local examples --listen $(LISTEN) --metrics $(METRICS) --state-dir $(STATE_DIR)

test: deps test-python test-rust

test-python:
	python3 -m unittest discover -s supervisor

test-rust:
	@if $(CARGO) nextest --version >/dev/null 2>&1; then \
		$(CARGO) nextest run --workspace --no-fail-fast; \
	else \
		$(CARGO) test --workspace --no-fail-fast; \
	fi

crds:
	$(CARGO) run -q -p sluice-crds --bin sluice-crdgen -- crds

bench: deps
	$(CARGO) run --release -q -p sluice-bench

fmt:
	$(CARGO) fmt --all

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

clean:
	$(CARGO) clean
