#!/usr/bin/env bash
# The project's images for the test cluster, without a registry or a container engine: OCI archives
# of the operator, the gateway and the supervisor, made from this checkout's binaries and a Debian
# root filesystem, then imported into the cluster's containerd. The operator and the gateway carry the
# supervisor and its cell runtime too: they check hook code with the CPython hooks run on. (The root
# filesystem still has python3, for `--python` and for the previous release the upgrade test
# installs, which checks code with it.)
#
#   images.sh build      write $OUT/sluice-{operator,gateway,supervisor}.tar
#   images.sh import     build, then `ctr -n k8s.io images import` each (the cluster must be up)
#   images.sh binaries   only the binaries and the cell runtime, in target/<profile>
#
# SLUICE_IMAGE_PROFILE picks the Cargo profile: `release` (the default: what `make cluster-install`
# gives a user, and what `make bench-cluster` measures) or `dev`, the build `make test` has already
# linked (test.sh's choice: the same code, with the supervisor's WebAssembly runtime optimised in
# that profile too, and no second build of everything). SLUICE_IMAGE_BINARIES names a directory
# that already holds the five files instead (sluice-{operator,gateway,supervisor},
# sluice-cell.cwasm and its .sha256): nothing is built (previous.sh, for the previous release).
#
# Image names: $REGISTRY/sluice-<component>:$TAG (defaults sluice.test/sluice-*:e2e), as the chart's
# image.registry and image.tag expect. The root filesystem (debootstrap, from Debian's packages) is
# cached in $SLUICE_CLUSTER_CACHE, keyed by the suite and the package list.
set -euo pipefail

# Build as from a shell, whoever runs this: a test binary (the upgrade test runs install.sh upgrade)
# passes on Cargo's variables for its package (CARGO_PKG_NAME, CARGO_MANIFEST_DIR, ...), ring's build
# script runs again when they change, and everything above ring would be compiled again (5-9 min
# here, and as long again for the next build from a shell).
for var in $(compgen -e); do
	case $var in
	CARGO_PKG_* | CARGO_MANIFEST_* | CARGO_CRATE_NAME | CARGO_BIN_NAME | CARGO_BIN_EXE_* | CARGO_PRIMARY_PACKAGE | CARGO_TARGET_TMPDIR | OUT_DIR) unset "$var" ;;
	esac
done

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
CACHE=${SLUICE_CLUSTER_CACHE:-/var/cache/sluice-cluster}
REGISTRY=${REGISTRY:-sluice.test}
TAG=${TAG:-e2e}
OUT=${OUT:-${SLUICE_CLUSTER_STATE:-/var/lib/sluice-cluster}/images}
SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PACKAGES=python3
CARGO=${CARGO:-cargo}

log() { echo "images: $*" >&2; }
die() { echo "images: $*" >&2; exit 1; }

# shellcheck source=profile.sh
. "$here/profile.sh"
BINARIES=${SLUICE_IMAGE_BINARIES:-$repo/target/$cell_profile}

# A Debian root filesystem with Python as one uncompressed layer, built once per key.
base_layer() {
	local key layer rootfs
	key="rootfs-$SUITE-$(echo "$MIRROR $PACKAGES" | sha256sum | cut -c1-12)"
	layer="$CACHE/$key.tar"
	if [ ! -f "$layer" ]; then
		command -v debootstrap >/dev/null || die "debootstrap is missing (make cluster-deps)"
		mkdir -p "$CACHE"
		rootfs=$(mktemp -d "$CACHE/.$key.XXXXXX")
		log "debootstrap $SUITE with $PACKAGES (once per machine)"
		nice -n 5 debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs" "$MIRROR" >"$rootfs.log" 2>&1 ||
			die "debootstrap failed: $(tail -n 5 "$rootfs.log")"
		# Nothing an image needs: package caches, documentation, the package manager's lists.
		rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/doc \
			"$rootfs"/usr/share/man "$rootfs"/usr/share/info "$rootfs"/usr/share/locale "$rootfs"/var/log/*
		tar --sort=name --numeric-owner --mtime=@0 --xattrs -C "$rootfs" -cf "$layer.partial" .
		mv "$layer.partial" "$layer"
		rm -rf "$rootfs" "$rootfs.log"
	fi
	echo "$layer"
}

binaries() {
	if [ -n "${SLUICE_IMAGE_BINARIES:-}" ]; then
		local file
		for file in sluice-operator sluice-gateway sluice-supervisor sluice-cell.cwasm sluice-cell.cwasm.sha256; do
			[ -f "$BINARIES/$file" ] || die "SLUICE_IMAGE_BINARIES=$BINARIES has no $file"
		done
		return
	fi
	log "cargo build, $PROFILE profile (operator, gateway, supervisor and its cell runtime)"
	(cd "$repo" && nice -n 5 "$CARGO" build -q "${cargo_flags[@]}" --locked "${cargo_select[@]}")
	(cd "$repo" && nice -n 5 supervisor/build-cell.sh "$cell_profile" >/dev/null)
}

oci() { python3 "$here/oci.py" "$@" >/dev/null; }

# The sandbox image: what every warm pod runs under gVisor (supervisor/Dockerfile's contents). The
# one place to change when the supervisor changes form.
supervisor_image() {
	local base=$1
	oci --name "$REGISTRY/sluice-supervisor:$TAG" --out "$OUT/sluice-supervisor.tar" --layer "$base" \
		--file "$BINARIES/sluice-supervisor:/opt/sluice/sluice-supervisor:0555" \
		--file "$BINARIES/sluice-cell.cwasm:/opt/sluice/sluice-cell.cwasm:0444" \
		--file "$BINARIES/sluice-cell.cwasm.sha256:/opt/sluice/sluice-cell.cwasm.sha256:0444" \
		--user 65534:65534 --workdir /tmp \
		--cmd=/opt/sluice/sluice-supervisor --cmd=--listen --cmd=--runtime --cmd=/opt/sluice/sluice-cell.cwasm
}

# The operator and the gateway: their binary on the same root filesystem (deploy/docker/), with the
# supervisor and its cell runtime beside it: both judge hook code with the CPython the sandboxes run
# (`sluice-supervisor python`), not the root filesystem's python3.
component_image() {
	local base=$1 component=$2
	oci --name "$REGISTRY/sluice-$component:$TAG" --out "$OUT/sluice-$component.tar" --layer "$base" \
		--file "$BINARIES/sluice-$component:/usr/local/bin/sluice-$component:0755" \
		--file "$BINARIES/sluice-supervisor:/usr/local/bin/sluice-supervisor:0555" \
		--file "$BINARIES/sluice-cell.cwasm:/usr/local/bin/sluice-cell.cwasm:0444" \
		--file "$BINARIES/sluice-cell.cwasm.sha256:/usr/local/bin/sluice-cell.cwasm.sha256:0444" \
		--env PYTHONDONTWRITEBYTECODE=1 --user 65534:65534 --entrypoint "/usr/local/bin/sluice-$component"
}

build() {
	local base
	base=$(base_layer)
	binaries
	mkdir -p "$OUT"
	supervisor_image "$base"
	component_image "$base" operator
	component_image "$base" gateway
	log "built $REGISTRY/sluice-{supervisor,operator,gateway}:$TAG in $OUT (from $BINARIES)"
}

import() {
	# Every node's containerd (cluster.sh: containerd/, containerd-b/).
	local socks=("${SLUICE_CLUSTER_RUN:-/run/sluice-cluster}"/containerd*/containerd.sock) sock image
	[ -S "${socks[0]}" ] || die "no cluster containerd at ${socks[0]}: make cluster-up first"
	build
	for image in sluice-supervisor sluice-operator sluice-gateway; do
		for sock in "${socks[@]}"; do
			ctr --address "$sock" -n k8s.io images import "$OUT/$image.tar" >/dev/null
		done
	done
	log "imported into the cluster's containerd"
}

case "${1:-}" in
build) build ;;
import) import ;;
binaries) binaries ;;
*) die "usage: images.sh build|import|binaries" ;;
esac
