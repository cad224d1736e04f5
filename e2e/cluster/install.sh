#!/usr/bin/env bash
# Installs Sluice into the running test cluster (cluster.sh up) with the Helm chart, as users do:
# operator, gateway and admission webhook in the cluster. Builds and imports the images first
# (images.sh). cert-manager cannot be had here, so the gateway's and the webhook's certificates come
# from Secrets this script makes, signed by a CA of its own.
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

# cert <name> <subjectAltName>: a serving certificate signed by the install's CA.
cert() {
	openssl req -new -newkey rsa:2048 -nodes -keyout "$PKI/$1.key" -subj "/CN=$1" -out "$PKI/$1.csr" 2>/dev/null
	printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=%s\n' "$2" >"$PKI/$1.ext"
	openssl x509 -req -in "$PKI/$1.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial -days 30 \
		-extfile "$PKI/$1.ext" -out "$PKI/$1.crt" 2>/dev/null
	rm -f "$PKI/$1.csr" "$PKI/$1.ext"
}

tls_secret() { # <name> <cert>
	kubectl -n "$RELEASE_NS" create secret generic "$1" --type kubernetes.io/tls \
		--from-file=tls.crt="$PKI/$2.crt" --from-file=tls.key="$PKI/$2.key" --from-file=ca.crt="$PKI/ca.crt" \
		--dry-run=client -o yaml | kubectl apply -f - >/dev/null
}

"$here/images.sh" import

log "certificates and Secrets"
mkdir -p "$PKI"
if [ ! -f "$PKI/ca.crt" ]; then
	openssl req -x509 -new -newkey rsa:2048 -nodes -keyout "$PKI/ca.key" -subj "/CN=sluice-e2e-ca" -days 30 \
		-out "$PKI/ca.crt" 2>/dev/null
	cert gateway "DNS:sluice-gateway.$RELEASE_NS.svc,DNS:sluice-gateway.$RELEASE_NS.svc.cluster.local,DNS:localhost,IP:127.0.0.1"
	cert webhook "DNS:sluice-operator-webhook.$RELEASE_NS.svc,DNS:sluice-operator-webhook.$RELEASE_NS.svc.cluster.local"
	head -c 32 /dev/urandom | base64 | tr -d '\n=' >"$PKI/token"
fi
kubectl create namespace "$RELEASE_NS" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
tls_secret sluice-gateway-tls gateway
tls_secret sluice-operator-webhook-tls webhook

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
gateway:
  # One node with two cores: one replica, small requests, so that sandbox pools fit beside it.
  replicas: 1
  extraEnv: *apiserver
  resources:
    requests: {cpu: 50m, memory: 64Mi}
  tls:
    mode: secret
    secretName: sluice-gateway-tls
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
  certificate:
    source: secret
    secretName: sluice-operator-webhook-tls
    caBundle: $(base64 -w0 <"$PKI/ca.crt")
EOF

log "helm upgrade --install sluice charts/sluice"
"$HELM" upgrade --install sluice "$repo/charts/sluice" --namespace "$RELEASE_NS" \
	-f "$STATE/sluice-values.yaml" --wait --timeout 5m

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
