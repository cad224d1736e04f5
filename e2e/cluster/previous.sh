#!/usr/bin/env bash
# The previous release, for the upgrade test of make test-cluster: its chart and its images, made
# from its commit (e2e/cluster/previous-release: commit and version) into the cache once, keyed by
# the commit, then kept as OCI archives only.
#
#   previous.sh build     make them if missing; print the directory (chart/, images/*.tar)
#   previous.sh import    build, then import the images into the cluster's containerd
#
# The images are tagged :previous, so the current ones (:e2e) replace them on upgrade.
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
read -r sha version <"$here/previous-release"
# "-2": the release's cell runtime compiled inside gVisor (below); earlier caches hold one made for
# the build host's CPU.
dir=$CACHE/previous-$version-$sha-2

CARGO=${CARGO:-cargo}

log() { echo "previous: $*" >&2; }
die() { echo "previous: $*" >&2; exit 1; }

# The images are the previous release's code whichever profile built them, so the cache key has none.
# shellcheck source=profile.sh
. "$here/profile.sh"

build() {
	if [ -f "$dir/done" ]; then
		echo "$dir"
		return
	fi
	git -C "$repo" cat-file -e "$sha^{commit}" 2>/dev/null ||
		die "release $version ($sha) is not in this clone's history (a shallow clone?): git fetch --unshallow"
	log "release $version ($sha): chart and images ($PROFILE profile), built once into $dir"
	rm -rf "$dir"
	mkdir -p "$dir/src"
	git -C "$repo" archive "$sha" | tar -x -C "$dir/src"
	# Built in this checkout's build directory, named by the very path this checkout's builds use
	# (Cargo compares the build-script output directories its dependencies were compiled with, by
	# path), in the profile images.sh builds (SLUICE_IMAGE_PROFILE): the release shares nearly every
	# dependency with this checkout, so only its own crates and the few whose features differ are
	# compiled, not all of them (16 min on 2 cores). Its binaries land in target/<profile> over this
	# checkout's, which are put back right after: a build of what is fresh only links them again.
	ln -s "$repo/target" "$dir/src/target"
	(cd "$dir/src" && CARGO_TARGET_DIR="$repo/target" nice -n 5 "$CARGO" build -q "${cargo_flags[@]}" --locked \
		-p sluice-operator -p sluice-gateway --bins)
	(cd "$dir/src" && CARGO_TARGET_DIR="$repo/target" nice -n 5 supervisor/build-cell.sh "$cell_profile" >/dev/null)
	# The release compiled its cell runtime for the build host's CPU features (this checkout pins a
	# fixed set, supervisor/src/runtime.rs): gVisor hides some of a host's from its sandboxes (AVX-VNNI
	# on this machine kind), and then that runtime loads in no sandbox. Compiled again by the release's
	# own supervisor inside a gVisor sandbox, it uses only what sandboxes see.
	local componentize key component compiled="$repo/target/$cell_profile/sluice-cell.cwasm"
	componentize=$(sed -n 's/^COMPONENTIZE_PY_VERSION=//p' "$dir/src/supervisor/build-cell.sh")
	key=$( (cd "$dir/src" && echo "componentize-py $componentize" && cat supervisor/wit/cell.wit supervisor/guest/*.py) | sha256sum | cut -c1-16)
	component=${SLUICE_CELL_CACHE:-/var/cache/sluice/cell}/cell-$key.wasm
	[ -f "$component" ] || die "the release's cell component $component is missing after its build-cell.sh"
	rm -f "$compiled.gvisor" "$compiled.gvisor.sha256"
	(cd /tmp && runsc --network=none do -force-overlay=false \
		"$repo/target/$cell_profile/sluice-supervisor" compile "$component" "$compiled.gvisor") ||
		die "compiling the release's cell runtime inside gVisor failed"
	mv "$compiled.gvisor" "$compiled"
	mv "$compiled.gvisor.sha256" "$compiled.sha256"
	mkdir -p "$dir/bin"
	cp "$repo/target/$cell_profile"/{sluice-operator,sluice-gateway,sluice-supervisor,sluice-cell.cwasm,sluice-cell.cwasm.sha256} \
		"$dir/bin/"
	"$here/images.sh" binaries
	# Put together by this checkout's images.sh from the release's binaries: the release's own
	# images.sh (at d1aa27e) lays the three images out the same way (files, modes, user, command) but
	# builds `--release` only. When previous-release moves on, check that this still holds.
	OUT="$dir/images" TAG=previous SLUICE_IMAGE_BINARIES="$dir/bin" "$here/images.sh" build
	rm -rf "$dir/bin"
	cp -r "$dir/src/charts/sluice" "$dir/chart"
	cp "$dir/src/e2e/cluster/install.sh" "$dir/install.sh"
	rm -rf "$dir/src"
	touch "$dir/done"
	echo "$dir"
}

import() {
	# Every node's containerd (cluster.sh: containerd/, containerd-b/).
	local socks=("${SLUICE_CLUSTER_RUN:-/run/sluice-cluster}"/containerd*/containerd.sock) sock image
	[ -S "${socks[0]}" ] || die "no cluster containerd at ${socks[0]}: make cluster-up first"
	build >/dev/null
	for image in sluice-supervisor sluice-operator sluice-gateway; do
		for sock in "${socks[@]}"; do
			ctr --address "$sock" -n k8s.io images import "$dir/images/$image.tar" >/dev/null
		done
	done
	log "imported release $version's images (:previous)"
	echo "$dir"
}

case "${1:-}" in
build) build ;;
import) import ;;
*) die "usage: previous.sh build|import" ;;
esac
