#!/usr/bin/env bash
# Installs Sluice into the running test cluster (cluster.sh up) with the Helm chart, as users do:
# operator, gateway and admission webhook in the cluster. Builds and imports the images first
# (images.sh). The gateway's and the webhook's certificates are the chart's default: the operator
# makes them (a CA of its own), so the suite trusts the bundle it publishes in the ConfigMap sluice-ca.
#
# Writes $SLUICE_CLUSTER_STATE/e2e.env: what `cargo test -p sluice-e2e --test cluster` needs
# (KUBECONFIG, the gateway's Service, the CA to trust and a caller token admitted everywhere).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
STATE=${SLUICE_CLUSTER_STATE:-/var/lib/sluice-cluster}
HELM=${HELM:-helm}
RELEASE_NS=sluice-system
SANDBOX_NS=sluice-sandboxes
PKI=$STATE/sluice-pki
export KUBECONFIG=$STATE/admin.kubeconfig
# Set by cluster.sh: the node address the API server listens on. There is no kube-proxy, so pods
# reach the API server there rather than through the `kubernetes` Service's ClusterIP.
NODE_IP=172.31.255.1

log() { echo "install: $*" >&2; }
die() { echo "install: $*" >&2; exit 1; }

[ -f "$KUBECONFIG" ] || die "no cluster is up ($KUBECONFIG): make cluster-up first"
command -v "$HELM" >/dev/null || die "helm not found ($HELM): make tools puts it in .venv-tools/bin"

"$here/images.sh" import

log "caller token"
mkdir -p "$PKI"
[ -f "$PKI/token" ] || head -c 32 /dev/urandom | base64 | tr -d '\n=' >"$PKI/token"
kubectl create namespace "$RELEASE_NS" --dry-run=client -o yaml | kubectl apply -f - >/dev/null

token_sha=$(tr -d '\n' <"$PKI/token" | sha256sum | cut -d' ' -f1)
cat >"$STATE/sluice-values.yaml" <<EOF
image:
  registry: ${REGISTRY:-sluice.test}
  tag: ${TAG:-e2e}
  pullPolicy: Never
sandboxNamespace:
  name: $SANDBOX_NS
# cluster.sh up declares RuntimeClass gvisor itself, as GKE does.
runtimeClass:
  create: false
operator:
  extraEnv: &apiserver
    - {name: KUBERNETES_SERVICE_HOST, value: "$NODE_IP"}
    - {name: KUBERNETES_SERVICE_PORT, value: "6443"}
  resources:
    requests: {cpu: 50m, memory: 64Mi}
  # The suite renews certificates and takes the webhook's caBundle away: looked at every 5 s here.
  certificates:
    checkInterval: 5s
gateway:
  # One node with two cores: one replica, small requests, so that sandbox pools fit beside it.
  replicas: 1
  extraEnv: *apiserver
  resources:
    requests: {cpu: 50m, memory: 64Mi}
  callers:
    callers:
      - name: e2e
        match: {tokenSha256: "$token_sha"}
        namespaces: ["*"]
# The API server, for the NetworkPolicies (this cluster enforces none, but they must render):
# helm install would look it up, helm template and helm lint with this file cannot.
networkPolicy:
  apiServer:
    cidrs: ["$NODE_IP/32"]
webhook:
  enabled: true
EOF

log "helm upgrade --install sluice charts/sluice"
"$HELM" upgrade --install sluice "$repo/charts/sluice" --namespace "$RELEASE_NS" \
	-f "$STATE/sluice-values.yaml" --wait --timeout 5m

# The CA bundle the operator made and published for clients.
kubectl -n "$RELEASE_NS" get configmap sluice-ca -o jsonpath='{.data.ca\.crt}' >"$PKI/ca.crt"
grep -q 'BEGIN CERTIFICATE' "$PKI/ca.crt" || die "the operator published no CA bundle (ConfigMap sluice-ca)"

cat >"$STATE/e2e.env" <<EOF
export KUBECONFIG=$KUBECONFIG
export SLUICE_GATEWAY_SERVICE=$RELEASE_NS/sluice-gateway
export SLUICE_CA=$PKI/ca.crt
export SLUICE_TOKEN=$(cat "$PKI/token")
export SLUICE_SANDBOX_NAMESPACE=$SANDBOX_NS
export SLUICE_RELEASE_NAMESPACE=$RELEASE_NS
export SLUICE_CLUSTER_CTL=$here/cluster.sh
EOF
log "installed; the suite's environment: $STATE/e2e.env"
