#!/usr/bin/env bash
# make test-cluster: a fresh cluster (cluster.sh up); the previous release installed and upgraded to
# this checkout under traffic (install.sh previous, the upgrade test); this checkout installed with
# its defaults (install.sh); the cluster suite against it; and the cluster taken down again whatever
# happened (down fails if it leaves anything behind). The suites' exit status is the script's.
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
STATE=${SLUICE_CLUSTER_STATE:-/var/lib/sluice-cluster}
CARGO=${CARGO:-cargo}
# The images (this checkout's and the previous release's) from the dev profile: `make test` has
# linked those binaries already, and a release build of both would be 26 of a cold CI run's minutes.
# What is tested is the same code; users' installs and make bench-cluster stay on release.
export SLUICE_IMAGE_PROFILE=${SLUICE_IMAGE_PROFILE:-dev}

"$here/cluster.sh" down >/dev/null 2>&1 || true
# Whatever happened, the cluster goes; a `down` that leaves something behind fails the run. (An EXIT
# trap cannot change a status by setting a variable: `exit $status` has already chosen it. Its own
# `exit` does.)
leave_nothing() {
	local rc=$?
	if ! "$here/cluster.sh" down; then
		echo "test-cluster: cluster.sh down left something behind (above): the run fails" >&2
		[ "$rc" != 0 ] || rc=1
	fi
	exit "$rc"
}
trap leave_nothing EXIT
status=0
"$here/cluster.sh" up || { status=$?; echo "test-cluster: cluster.sh up failed" >&2; exit $status; }
UPGRADE=upgrade_from_the_previous_release_with_traffic_running
suite() { # cargo test arguments
	(cd "$repo" && SLUICE_CLUSTER_REQUIRED=1 "$CARGO" test --workspace --test cluster -- --test-threads=1 "$@")
}
# This checkout's images first: the upgrade under traffic must not wait on a build.
"$here/images.sh" build || { status=$?; echo "test-cluster: images.sh build failed" >&2; exit $status; }
if [ -z "${SLUICE_SKIP_UPGRADE:-}" ]; then
	"$here/install.sh" previous || { status=$?; echo "test-cluster: install.sh previous failed" >&2; exit $status; }
	# shellcheck source=/dev/null
	. "$STATE/e2e.env"
	suite --exact "$UPGRADE" --nocapture || status=$?
fi
"$here/install.sh" || { status=$?; echo "test-cluster: install.sh failed" >&2; exit $status; }
# shellcheck source=/dev/null
. "$STATE/e2e.env"
# Smoke rows (printed, not asserted: the figures are make bench-cluster's) a test appends here.
export SLUICE_SMOKE_FILE=$STATE/smoke.txt
rm -f "$SLUICE_SMOKE_FILE"
suite --skip "$UPGRADE" "$@" || status=$?
cat "$SLUICE_SMOKE_FILE" 2>/dev/null || true
if [ "$status" != 0 ]; then
	logs=/tmp/sluice-cluster-logs
	echo "test-cluster: the suite failed; the cluster's logs, Sluice's pods' logs and the events are in $logs" >&2
	rm -rf "$logs" && cp -r "$STATE/logs" "$logs" 2>/dev/null || mkdir -p "$logs"
	export KUBECONFIG=$STATE/admin.kubeconfig
	# The operator's and gateway's own logs go with the pods at `cluster.sh down`: keep them.
	for pod in $(kubectl -n sluice-system get pods -o name 2>/dev/null); do
		kubectl -n sluice-system logs "$pod" --all-containers >"$logs/${pod#pod/}.log" 2>&1
		kubectl -n sluice-system logs "$pod" --all-containers --previous >"$logs/${pod#pod/}.previous.log" 2>/dev/null ||
			rm -f "$logs/${pod#pod/}.previous.log"
	done
	kubectl get events -A --sort-by=.lastTimestamp >"$logs/events.txt" 2>&1 || true
	kubectl get pods -A -o wide >&2 || true
fi
exit $status
