#!/usr/bin/env bash
# Builds the test cluster's own binaries from the Go module proxy, once per pinned version set:
# kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and kubectl (go/kube: a kubectl of
# the API server's own version, within kubectl's skew policy) and etcd (go/etcd).
# They land in $SLUICE_CLUSTER_CACHE/<key>/bin, outside the checkout, where <key> names the pinned
# versions; a key that is there is not built again. A build goes to a temporary directory that is
# renamed into place only when every binary is there, so an interrupted build leaves nothing half-made.
#
#   e2e/cluster/build.sh          build if missing, then print the bin directory
#   e2e/cluster/build.sh --path   print the bin directory only (fails if it is not built)
#
# containerd, runc, the CNI plugins and runsc come from Debian (see cluster.sh deps). gVisor's own
# containerd-shim-runsc-v1 is not built: the module proxy does not serve gvisor.dev/gvisor (403), so
# pods run through containerd's runc shim with BinaryName=runsc (README.md, "gVisor without its shim").
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache_root=${SLUICE_CLUSTER_CACHE:-/var/cache/sluice-cluster}

module_version() { # <go.mod> <module>: the version a go.mod requires
	awk -v m="$2" '($1 == m && $2 ~ /^v/) { print $2 } ($1 == "require" && $2 == m) { print $3 }' "$1" | head -n 1
}

kube_version=$(module_version "$here/go/kube/go.mod" k8s.io/kubernetes)
etcd_version=$(module_version "$here/go/etcd/go.mod" go.etcd.io/etcd/server/v3)
if [ -z "$kube_version" ] || [ -z "$etcd_version" ]; then
	echo "build.sh: cannot read the pinned versions from $here/go/*/go.mod" >&2
	exit 1
fi
# The go.sum files pin everything else; a change there is a new key too.
sums=$(cat "$here"/go/kube/go.mod "$here"/go/kube/go.sum "$here"/go/etcd/go.mod "$here"/go/etcd/go.sum | sha256sum | cut -c1-12)
key="kube-$kube_version-etcd-$etcd_version-$sums"
bin="$cache_root/$key/bin"
binaries=(kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl etcd)

built() {
	local b
	for b in "${binaries[@]}"; do [ -x "$bin/$b" ] || return 1; done
}

if [ "${1:-}" = --path ]; then
	built || { echo "build.sh: $bin is not built; run make cluster-build" >&2; exit 1; }
	echo "$bin"
	exit 0
fi

if built; then
	echo "$bin"
	exit 0
fi

if ! command -v go >/dev/null; then
	echo "build.sh: go is not installed (Go 1.24 or newer, with access to the Go module proxy)" >&2
	exit 1
fi

mkdir -p "$cache_root"
tmp=$(mktemp -d "$cache_root/.build-$key.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
started=$(date +%s)

# Version stamps as upstream's hack/lib/version.sh sets them: components compare versions with each
# other (kubelet and API server skew), so they must not report v0.0.0.
minor=$(echo "$kube_version" | cut -d. -f2)
stamp=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
	stamp+=" -X $pkg.gitVersion=$kube_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
	stamp+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

echo "build.sh: building Kubernetes $kube_version into $tmp (cold: 25-40 min on 2 cores)" >&2
(cd "$here/go/kube" && CGO_ENABLED=0 nice -n "${BUILD_NICE:-5}" go build -trimpath -ldflags "-s -w$stamp" -o "$tmp/" \
	k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
	k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kubectl)
echo "build.sh: building etcd $etcd_version" >&2
(cd "$here/go/etcd" && CGO_ENABLED=0 nice -n "${BUILD_NICE:-5}" go build -trimpath -ldflags "-s -w" -o "$tmp/etcd" go.etcd.io/etcd/server/v3)

mkdir -p "$cache_root/$key"
mv "$tmp" "$bin"
trap - EXIT
echo "build.sh: built in $(($(date +%s) - started)) s" >&2
echo "$bin"
