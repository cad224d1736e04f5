#!/usr/bin/env bash
# Pushes the three images (OCI archives, as `make images` writes them) and the chart (an OCI
# artefact) to a registry, with standard clients and no container engine: skopeo for the images,
# `helm push` for the chart.
#
#   push.sh IMAGES_DIR REGISTRY TAG [--plain-http]
#
# Images go to REGISTRY/sluice-{supervisor,operator,gateway}:TAG, the chart to
# oci://REGISTRY/charts/sluice:<chart version>; install it with
#   helm install sluice oci://REGISTRY/charts/sluice --version <chart version> --set image.registry=REGISTRY
# Log in first where the registry wants it (skopeo login, helm registry login). --plain-http: a
# registry without TLS (the test cluster's, on 127.0.0.1).
set -euo pipefail

[ $# -ge 3 ] || { echo "usage: push.sh IMAGES_DIR REGISTRY TAG [--plain-http]" >&2; exit 2; }
images=$1 registry=$2 tag=$3 plain=${4:-}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
HELM=${HELM:-helm}
command -v skopeo >/dev/null || { echo "push: skopeo is missing (apt-get install skopeo)" >&2; exit 1; }

tls=()
helm_tls=()
if [ "$plain" = --plain-http ]; then
	tls=(--dest-tls-verify=false)
	helm_tls=(--plain-http)
fi
for image in sluice-supervisor sluice-operator sluice-gateway; do
	[ -f "$images/$image.tar" ] || { echo "push: no $images/$image.tar (make images)" >&2; exit 1; }
	skopeo copy -q "${tls[@]}" "oci-archive:$images/$image.tar" "docker://$registry/$image:$tag"
	echo "push: $registry/$image:$tag" >&2
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$HELM" package "$repo/charts/sluice" -d "$work" >/dev/null
chart=$(ls "$work"/sluice-*.tgz)
"$HELM" push "$chart" "oci://$registry/charts" "${helm_tls[@]}" >/dev/null 2>&1 ||
	"$HELM" push "$chart" "oci://$registry/charts" "${helm_tls[@]}"
echo "push: oci://$registry/charts/sluice ($(basename "$chart" .tgz))" >&2
