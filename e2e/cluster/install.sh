#!/usr/bin/env bash
# Installs Sluice into the running test cluster (cluster.sh up) with the Helm chart, as users do:
# operator, gateway and admission webhook in the cluster.
#
#   install.sh            this checkout's chart and images (helm upgrade --install). The gateway's
#                         and the webhook's certificates are the chart's default: the operator makes
#                         them, and the suite trusts the bundle it publishes (ConfigMap sluice-ca).
#   install.sh previous   the previous release (previous.sh: its chart, its images tagged :previous),
#                         with certificates from Secrets this script makes, signed by a CA of its own
#                         (that chart has no operator-made ones).
#   install.sh upgrade    from the previous release to this checkout, keeping the values it was
#                         installed with, as users upgrade; the upgrade test runs it under traffic.
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
SIGNED_NS=e2e-signed
REGISTRY_ADDR=${SLUICE_CLUSTER_REGISTRY:-127.0.0.1:5757}
PKI=$STATE/sluice-pki
export KUBECONFIG=$STATE/admin.kubeconfig
# Set by cluster.sh: the node address the API server listens on. There is no kube-proxy, so pods
# reach the API server there rather than through the `kubernetes` Service's ClusterIP.
NODE_IP=172.31.255.1

# The cluster's own kubectl (its API server's version), as cluster.sh uses.
cluster_bin=$("$here/build.sh" --path) || exit 1
export PATH=$cluster_bin:$PATH

log() { echo "install: $*" >&2; }
die() { echo "install: $*" >&2; exit 1; }

mode=${1:-current}
case "$mode" in current | previous | upgrade) ;; *) die "usage: install.sh [previous|upgrade]" ;; esac

[ -f "$KUBECONFIG" ] || die "no cluster is up ($KUBECONFIG): make cluster-up first"
command -v "$HELM" >/dev/null || die "helm not found ($HELM): make tools puts it in .venv-tools/bin"

mkdir -p "$PKI"
[ -f "$PKI/token" ] || head -c 32 /dev/urandom | base64 | tr -d '\n=' >"$PKI/token"
token_sha=$(tr -d '\n' <"$PKI/token" | sha256sum | cut -d' ' -f1)
kubectl create namespace "$RELEASE_NS" --dry-run=client -o yaml | kubectl apply -f - >/dev/null

# The values of every install here, whichever release's chart: both schemas accept them. The
# production shape (two gateways, two operators electing a leader) on two nodes that share two
# cores: small requests, so that sandbox pools fit beside them.
# cluster.sh up declares RuntimeClass gvisor itself, as GKE does. The API server's address is given
# for the NetworkPolicies (this cluster enforces none, but they must render).
common_values() { # <image tag>
	cat <<EOF
image:
  registry: ${REGISTRY:-sluice.test}
  tag: $1
  pullPolicy: Never
sandboxNamespace:
  name: $SANDBOX_NS
runtimeClass:
  create: false
operator:
  extraEnv: &apiserver
    - {name: KUBERNETES_SERVICE_HOST, value: "$NODE_IP"}
    - {name: KUBERNETES_SERVICE_PORT, value: "6443"}
  replicas: 2
  resources:
    requests: {cpu: 50m, memory: 64Mi}
gateway:
  replicas: 2
  extraEnv: *apiserver
  resources:
    requests: {cpu: 50m, memory: 64Mi}
  callers:
    callers:
      - name: e2e
        match: {tokenSha256: "$token_sha"}
        namespaces: ["*"]
networkPolicy:
  apiServer:
    cidrs: ["$NODE_IP/32"]
webhook:
  enabled: true
EOF
}

write_env() { # <the CA bundle the suite trusts>
	cat >"$STATE/e2e.env" <<EOF
export KUBECONFIG=$KUBECONFIG
export SLUICE_GATEWAY_SERVICE=$RELEASE_NS/sluice-gateway
export SLUICE_CA=$1
export SLUICE_TOKEN=$(cat "$PKI/token")
export SLUICE_SANDBOX_NAMESPACE=$SANDBOX_NS
export SLUICE_SIGNED_NAMESPACE=$SIGNED_NS
export SLUICE_CLUSTER_REGISTRY=$REGISTRY_ADDR
export SLUICE_SIGNING_KEY=$here/signing/e2e-signer
export SLUICE_RELEASE_NAMESPACE=$RELEASE_NS
export SLUICE_CLUSTER_CTL=$here/cluster.sh
export SLUICE_APISERVER_AUDIT_LOG=$STATE/logs/audit.log
export SLUICE_UPGRADE_CTL=$([ "$mode" = previous ] && echo "$here/install.sh")
export PATH=$cluster_bin:\$PATH
EOF
	log "installed ($mode); the suite's environment: $STATE/e2e.env"
}

# cert <name> <subjectAltName>: a serving certificate signed by this script's CA.
cert() {
	openssl req -new -newkey rsa:2048 -nodes -keyout "$PKI/$1.key" -subj "/CN=$1" -out "$PKI/$1.csr" 2>/dev/null
	printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=%s\n' "$2" >"$PKI/$1.ext"
	openssl x509 -req -in "$PKI/$1.csr" -CA "$PKI/script-ca.crt" -CAkey "$PKI/script-ca.key" -CAcreateserial -days 30 \
		-extfile "$PKI/$1.ext" -out "$PKI/$1.crt" 2>/dev/null
	rm -f "$PKI/$1.csr" "$PKI/$1.ext"
}

tls_secret() { # <Secret> <cert>
	kubectl -n "$RELEASE_NS" create secret generic "$1" --type kubernetes.io/tls \
		--from-file=tls.crt="$PKI/$2.crt" --from-file=tls.key="$PKI/$2.key" --from-file=ca.crt="$PKI/script-ca.crt" \
		--dry-run=client -o yaml | kubectl apply -f - >/dev/null
}

# The CA bundle the operator publishes for clients (ConfigMap sluice-ca) into $PKI/ca.crt.
read_operator_bundle() {
	kubectl -n "$RELEASE_NS" get configmap sluice-ca -o jsonpath='{.data.ca\.crt}' >"$PKI/ca.crt" 2>/dev/null &&
		grep -q 'BEGIN CERTIFICATE' "$PKI/ca.crt"
}

# The addresses of the gateway pods that serve: Running, Ready, not being deleted.
serving_gateway_ips() {
	kubectl -n "$RELEASE_NS" get pods -l app.kubernetes.io/component=gateway -o json | python3 -c '
import json, sys
for p in json.load(sys.stdin)["items"]:
    st = p.get("status", {})
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions", []))
    if st.get("phase") == "Running" and ready and not p["metadata"].get("deletionTimestamp") and st.get("podIP"):
        print(st["podIP"])'
}

gateway_serves_operator_cert() {
	read_operator_bundle || return 1
	local ips ip
	ips=$(serving_gateway_ips) || return 1
	[ -n "$ips" ] || return 1
	for ip in $ips; do
		openssl s_client -connect "$ip:50051" -servername "sluice-gateway.$RELEASE_NS.svc" \
			-CAfile "$PKI/ca.crt" -verify_return_error </dev/null >/dev/null 2>&1 || return 1
	done
}

gateway_tls_diagnostics() {
	{
		echo "--- gateway pods"
		kubectl -n "$RELEASE_NS" get pods -o wide || true
		echo "--- the bundle published (ConfigMap sluice-ca)"
		openssl crl2pkcs7 -nocrl -certfile "$PKI/ca.crt" 2>/dev/null | openssl pkcs7 -print_certs -noout || true
		echo "--- the Secret sluice-gateway-tls"
		kubectl -n "$RELEASE_NS" get secret sluice-gateway-tls -o jsonpath='{.data.tls\.crt}' | base64 -d |
			openssl x509 -noout -subject -issuer -dates || true
		local ip
		for ip in $(serving_gateway_ips); do
			echo "--- served at $ip"
			openssl s_client -connect "$ip:50051" -servername "sluice-gateway.$RELEASE_NS.svc" \
				-CAfile "$PKI/ca.crt" </dev/null 2>&1 | grep -E 'subject=|issuer=|Verify return code' || true
		done
		echo "--- the operator's log"
		kubectl -n "$RELEASE_NS" logs -l app.kubernetes.io/component=operator --tail=40 || true
		echo "--- the gateway's log"
		kubectl -n "$RELEASE_NS" logs -l app.kubernetes.io/component=gateway --tail=40 | grep -i -E 'tls|certif' || true
	} >&2
}

# Helm installs a chart's crds/ with the first release and never upgrades them: an upgrade applies
# this checkout's CRDs first, as docs/kubernetes.md tells a platform team to (server-side, so the
# field manager is the same on every apply).
apply_crds() {
	log "kubectl apply --server-side charts/sluice/crds (Helm does not upgrade CRDs)"
	kubectl apply --server-side --force-conflicts --field-manager=sluice-install -f "$repo/charts/sluice/crds/" >/dev/null
}

# helm <args>: helm, and when it fails (a --wait that timed out says only "not ready"), what the
# node and the release's pods were doing.
helm_() {
	"$HELM" "$@" && return 0
	{
		echo "--- the node (conditions, taints, disk)"
		kubectl get nodes -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{range .status.conditions[*]}  {.type}={.status} {.message}{"\n"}{end}  taints: {.spec.taints}{"\n"}{end}' || true
		df -h "$STATE/" || true
		echo "--- pods in $RELEASE_NS"
		kubectl -n "$RELEASE_NS" get pods -o wide || true
		kubectl -n "$RELEASE_NS" describe pods | grep -E -A12 '^(Name:|Events:)|State:|Last State:|Reason:' | head -150 || true
		echo "--- recent events"
		kubectl -n "$RELEASE_NS" get events --sort-by=.lastTimestamp | tail -30 || true
		echo "--- logs"
		kubectl -n "$RELEASE_NS" logs -l app.kubernetes.io/instance=sluice --all-containers --tail=30 --prefix || true
	} >&2
	return 1
}

case "$mode" in
previous)
	previous=$("$here/previous.sh" import)
	log "certificates in Secrets made here"
	if [ ! -f "$PKI/script-ca.crt" ]; then
		openssl req -x509 -new -newkey rsa:2048 -nodes -keyout "$PKI/script-ca.key" -subj "/CN=sluice-e2e-ca" \
			-days 30 -out "$PKI/script-ca.crt" 2>/dev/null
	fi
	cert gateway "DNS:sluice-gateway.$RELEASE_NS.svc,DNS:sluice-gateway.$RELEASE_NS.svc.cluster.local"
	cert webhook "DNS:sluice-operator-webhook.$RELEASE_NS.svc,DNS:sluice-operator-webhook.$RELEASE_NS.svc.cluster.local"
	tls_secret sluice-gateway-tls gateway
	tls_secret sluice-operator-webhook-tls webhook
	common_values previous >"$STATE/sluice-values-previous.yaml"
	cat >"$STATE/sluice-tls-previous.yaml" <<EOF
gateway:
  tls:
    mode: secret
    secretName: sluice-gateway-tls
webhook:
  certificate:
    source: secret
    secretName: sluice-operator-webhook-tls
    caBundle: $(base64 -w0 <"$PKI/script-ca.crt")
EOF
	log "helm install sluice: the previous release's chart ($previous/chart)"
	helm_ upgrade --install sluice "$previous/chart" --namespace "$RELEASE_NS" \
		-f "$STATE/sluice-values-previous.yaml" -f "$STATE/sluice-tls-previous.yaml" --wait --timeout 5m
	write_env "$PKI/script-ca.crt"
	;;
upgrade)
	[ -f "$STATE/sluice-values-previous.yaml" ] || die "no previous release installed here (install.sh previous)"
	"$here/images.sh" import
	apply_crds
	log "helm upgrade sluice: this chart and its images, the previous release's values"
	helm_ upgrade sluice "$repo/charts/sluice" --namespace "$RELEASE_NS" \
		-f "$STATE/sluice-values-previous.yaml" -f "$STATE/sluice-tls-previous.yaml" --set image.tag="${TAG:-e2e}" \
		--wait --timeout 5m
	;;
current)
	"$here/images.sh" import
	apply_crds
	common_values "${TAG:-e2e}" >"$STATE/sluice-values.yaml"
	# The suite renews certificates and takes the webhook's caBundle away: looked at every 5 s. The
	# release keeps every chain but another release's (chainSelector), as beside a staging release.
	# The start-deadline test waits the deadline out: 45 s instead of the default 120 (a sandbox pod
	# here is Ready in a few seconds).
	printf 'operator:\n  startDeadline: 45s\n  certificates:\n    checkInterval: 5s\nchainSelector: "sluice.dev/release!=other"\n' \
		>"$STATE/sluice-certificates.yaml"
	# Signed hook code is required in one namespace, trusting the suite's own key (signing/).
	printf 'signing:\n  enabled: true\n  namespaces: [%s]\n  allowedSigners: "%s"\n' \
		"$SIGNED_NS" "e2e-signer@sluice.test $(cat "$here/signing/e2e-signer.pub")" >"$STATE/sluice-signing.yaml"
	# The images keep their tag from build to build: the operator's and the gateway's pods carry the
	# images' checksum, so that installing again after a rebuild rolls them out. (Sandbox pods keep
	# the supervisor they started with until they are replaced: kubectl delete pods -n $SANDBOX_NS --all.)
	images=$(cat "${OUT:-$STATE/images}"/sluice-{supervisor,operator,gateway}.tar | sha256sum | cut -c1-16)
	printf 'operator:\n  podAnnotations: {sluice.test/images: "%s"}\ngateway:\n  podAnnotations: {sluice.test/images: "%s"}\n' \
		"$images" "$images" >"$STATE/sluice-images.yaml"
	# Installed as a user installs: the images and the chart pushed to a registry (the cluster's own,
	# cluster.sh), the chart installed from there and the images pulled by the node's containerd, not
	# imported. The tag carries the images' checksum, so a rebuild is pulled anew.
	log "pushing the images and the chart to the cluster's registry ($REGISTRY_ADDR)"
	HELM=$HELM "$repo/deploy/tools/push.sh" "${OUT:-$STATE/images}" "$REGISTRY_ADDR" "e2e-$images" --plain-http
	printf 'image:\n  registry: %s\n  tag: e2e-%s\n  pullPolicy: IfNotPresent\n' "$REGISTRY_ADDR" "$images" \
		>"$STATE/sluice-registry.yaml"
	chart_version=$(sed -n 's/^version: //p' "$repo/charts/sluice/Chart.yaml")
	log "helm upgrade --install sluice oci://$REGISTRY_ADDR/charts/sluice --version $chart_version (images $images)"
	helm_ upgrade --install sluice "oci://$REGISTRY_ADDR/charts/sluice" --version "$chart_version" --plain-http \
		--namespace "$RELEASE_NS" \
		-f "$STATE/sluice-values.yaml" -f "$STATE/sluice-certificates.yaml" -f "$STATE/sluice-images.yaml" \
		-f "$STATE/sluice-signing.yaml" -f "$STATE/sluice-registry.yaml" \
		--wait --timeout 5m
	# After the upgrade test the gateway still serves the previous install's certificate until the
	# kubelet projects the Secret the operator made (up to a minute or two): wait until every Ready
	# gateway pod that is not being deleted serves one the published bundle trusts. The bundle is read
	# again each time (the operator publishes it on its first pass, which may follow the rollout), and
	# pods that ended (Failed, or Terminating with their address still set) are not asked.
	log "waiting for the gateway to serve a certificate of the operator's CA"
	served=
	for _ in $(seq 1 120); do
		if gateway_serves_operator_cert; then
			served=1
			break
		fi
		sleep 2
	done
	if [ -z "$served" ]; then
		gateway_tls_diagnostics
		die "the gateway does not serve a certificate of the operator's CA after 4 min (what was seen is above)"
	fi
	write_env "$PKI/ca.crt"
	;;
esac
