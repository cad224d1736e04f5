#!/usr/bin/env bash
# A two-node Kubernetes on this machine for the cluster suite: etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler and a kubelet per node built by build.sh; containerd, runc,
# the CNI plugins and runsc from Debian. Pods of RuntimeClass `gvisor` (handler runsc) run under runsc.
# Each node has its own kubelet, containerd, node address, pod bridge and subnet, and cgroup root: a
# node can be drained, stopped and started again on its own (node-stop, node-start).
#
#   cluster.sh deps     install the Debian packages it needs
#   cluster.sh up       start it; waits for the node to be Ready; prints the kubeconfig path
#   cluster.sh down     stop it and remove every process, mount, network namespace, interface and
#                       cgroup it made, then check that none is left
#   cluster.sh status   what runs
#   cluster.sh restart <component>   stop one component and start it again (tests)
#   cluster.sh node-stop <node>      stop a node's kubelet and containerd (its sandboxes keep running,
#                                    unreachable: a lost node as the control plane sees it)
#   cluster.sh node-start <node>     start them again
#   cluster.sh nodes                 the nodes' names
#   cluster.sh kubeconfig
#
# Everything lives under $SLUICE_CLUSTER_STATE (default /var/lib/sluice-cluster) and
# $SLUICE_CLUSTER_RUN (default /run/sluice-cluster); nothing in the checkout. Needs root.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
STATE=${SLUICE_CLUSTER_STATE:-/var/lib/sluice-cluster}
RUN=${SLUICE_CLUSTER_RUN:-/run/sluice-cluster}
# The nodes. Each node's address is the host end of a veth pair whose other end lives in a network
# namespace of our own (the kubelet refuses a loopback node IP); its pods get addresses on a bridge
# and subnet of its own, routed to the other node's through this machine. The first node keeps the
# names a single-node cluster had (its kubelet and containerd are `kubelet`, `containerd`).
NODES=(sluice-node sluice-node-b)
# node <name>: sets the NODE_* variables of that node.
node() {
	NODE_NAME=$1
	case "$1" in
	sluice-node)
		NODE_IP=172.31.255.1 PEER_IP=172.31.255.2 NETNS=sluice-cluster VETH=sluice-node
		POD_CIDR=172.31.254.0/24 BRIDGE=sluice-cni0 SUFFIX= NODE_CGROUP=/sluice-cluster
		;;
	sluice-node-b)
		NODE_IP=172.31.255.5 PEER_IP=172.31.255.6 NETNS=sluice-cluster-b VETH=sluice-node-b
		POD_CIDR=172.31.252.0/24 BRIDGE=sluice-cni1 SUFFIX=-b NODE_CGROUP=/sluice-cluster/node-b
		;;
	*) die "unknown node '$1' (${NODES[*]})" ;;
	esac
	CONTAINERD_SOCK=$RUN/containerd$SUFFIX/containerd.sock
}
SERVICE_CIDR=172.31.253.0/24
SERVICE_IP=172.31.253.1
APISERVER_PORT=6443
# The API server listens on the first node's address.
APISERVER_IP=172.31.255.1
ETCD_CLIENT=127.0.0.1:23790
ETCD_PEER=127.0.0.1:23800
# Each kubelet puts its pod cgroups under its node's NODE_CGROUP, all below this parent in each
# hierarchy: down removes it whole.
CGROUP_ROOT=/sluice-cluster
# What containerd 1.6 uses as the pod sandbox image (it cannot be pinned, so image GC stays off).
PAUSE_IMAGE=registry.k8s.io/pause:3.6
# A registry of our own (Debian's docker-registry, the CNCF distribution registry): install.sh pushes
# the images and the chart there and the node's containerd pulls them, as a user's cluster would.
REGISTRY_ADDR=${SLUICE_CLUSTER_REGISTRY:-127.0.0.1:5757}

PKI=$STATE/pki
LOGS=$STATE/logs
PIDS=$RUN/pids
KUBECONFIG_ADMIN=$STATE/admin.kubeconfig

log() { echo "cluster: $*" >&2; }
die() { echo "cluster: $*" >&2; exit 1; }

# The first node, until a command picks another.
node sluice-node

need_root() { [ "$(id -u)" = 0 ] || die "needs root (it starts containerd and the kubelet)"; }

# The cluster's own kubectl once build.sh made it (the API server's version: .venv-tools' is newer
# than kubectl's skew policy allows), else whichever is on the PATH (before the first build).
if cluster_bin=$("$here/build.sh" --path 2>/dev/null); then
	PATH=$cluster_bin:$PATH
fi
kubectl_() { kubectl --kubeconfig "$KUBECONFIG_ADMIN" "$@"; }

# === deps ===

deps() {
	need_root
	local missing=()
	command -v containerd >/dev/null || missing+=(containerd)
	command -v runc >/dev/null || missing+=(runc)
	[ -x /usr/lib/cni/bridge ] || missing+=(containernetworking-plugins)
	command -v iptables >/dev/null || missing+=(iptables)
	command -v openssl >/dev/null || missing+=(openssl)
	command -v debootstrap >/dev/null || missing+=(debootstrap)
	command -v gcc >/dev/null || missing+=(gcc libc6-dev)
	command -v skopeo >/dev/null || missing+=(skopeo)
	command -v docker-registry >/dev/null || missing+=(docker-registry)
	if [ ${#missing[@]} -gt 0 ]; then
		log "installing ${missing[*]}"
		apt-get update -qq
		# Installed, not started: docker-registry's package would start a registry of the machine's
		# own on :5000; the cluster runs one of its own at up.
		local guard=
		if [ ! -e /usr/sbin/policy-rc.d ]; then
			printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 0755 /usr/sbin/policy-rc.d && guard=1
		fi
		local rc=0
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null || rc=$?
		[ -z "$guard" ] || rm -f /usr/sbin/policy-rc.d
		[ "$rc" = 0 ] || die "apt-get install ${missing[*]} failed"
	fi
	command -v runsc >/dev/null || die "runsc is missing: make deps installs it (bookworm-backports)"
}

# === certificates ===

# cert <name> <subject> [<subjectAltName>]: a key and a certificate signed by the cluster CA.
cert() {
	local name=$1 subject=$2 san=${3:-}
	local ext=$PKI/$name.ext
	{
		echo "basicConstraints=CA:FALSE"
		echo "keyUsage=critical,digitalSignature,keyEncipherment"
		echo "extendedKeyUsage=serverAuth,clientAuth"
		[ -z "$san" ] || echo "subjectAltName=$san"
	} >"$ext"
	openssl req -new -newkey rsa:2048 -nodes -keyout "$PKI/$name.key" -subj "$subject" \
		-out "$PKI/$name.csr" 2>/dev/null
	openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
		-days 30 -extfile "$ext" -out "$PKI/$name.crt" 2>/dev/null
	rm -f "$PKI/$name.csr" "$ext"
}

# kubeconfig <file> <cert name>: a kubeconfig that authenticates with that certificate.
kubeconfig() {
	cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: sluice
  cluster:
    certificate-authority: $PKI/ca.crt
    server: https://$APISERVER_IP:$APISERVER_PORT
users:
- name: $2
  user:
    client-certificate: $PKI/$2.crt
    client-key: $PKI/$2.key
contexts:
- name: sluice
  context: {cluster: sluice, user: $2}
current-context: sluice
EOF
}

make_pki() {
	mkdir -p "$PKI"
	openssl req -x509 -new -newkey rsa:2048 -nodes -keyout "$PKI/ca.key" -subj "/CN=sluice-cluster-ca" \
		-days 30 -out "$PKI/ca.crt" 2>/dev/null
	cert apiserver "/CN=kube-apiserver" \
		"IP:$APISERVER_IP,IP:$SERVICE_IP,IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost"
	cert admin "/O=system:masters/CN=sluice-admin"
	cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client"
	cert controller-manager "/CN=system:kube-controller-manager"
	cert scheduler "/CN=system:kube-scheduler"
	local n
	for n in "${NODES[@]}"; do
		node "$n"
		cert "kubelet$SUFFIX" "/O=system:nodes/CN=system:node:$NODE_NAME" "IP:$NODE_IP,DNS:$NODE_NAME"
		kubeconfig "$STATE/kubelet$SUFFIX.kubeconfig" "kubelet$SUFFIX"
	done
	openssl genrsa -out "$PKI/sa.key" 2048 2>/dev/null
	openssl rsa -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
	kubeconfig "$KUBECONFIG_ADMIN" admin
	kubeconfig "$STATE/controller-manager.kubeconfig" controller-manager
	kubeconfig "$STATE/scheduler.kubeconfig" scheduler
}

# === processes ===

# start <name> <command...>: runs it in its own session, output to $LOGS/<name>.log.
start() {
	local name=$1
	shift
	setsid "$@" >>"$LOGS/$name.log" 2>&1 </dev/null &
	echo $! >"$PIDS/$name.pid"
}

running() { [ -f "$PIDS/$1.pid" ] && kill -0 "$(cat "$PIDS/$1.pid")" 2>/dev/null; }

# stop <name>: SIGTERM, up to 20 s, then SIGKILL.
stop() {
	local name=$1 pid i
	[ -f "$PIDS/$name.pid" ] || return 0
	pid=$(cat "$PIDS/$name.pid")
	if kill -0 "$pid" 2>/dev/null; then
		kill -TERM "$pid" 2>/dev/null || true
		for i in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
		kill -KILL "$pid" 2>/dev/null || true
	fi
	rm -f "$PIDS/$name.pid"
}

# wait_for <what> <seconds> <command...>: polls until the command succeeds; shows the log on failure.
wait_for() {
	local what=$1 seconds=$2 i
	shift 2
	for i in $(seq 1 "$seconds"); do
		if "$@" >/dev/null 2>&1; then return 0; fi
		sleep 1
	done
	die "timed out after ${seconds}s waiting for $what (logs: $LOGS)"
}

# === node network ===

node_network() { # (node sets which)
	ip netns add "$NETNS"
	ip link add "$VETH" type veth peer name sluice-peer netns "$NETNS"
	ip addr add "$NODE_IP/30" dev "$VETH"
	ip link set "$VETH" up
	ip -n "$NETNS" addr add "$PEER_IP/30" dev sluice-peer
	ip -n "$NETNS" link set sluice-peer up
	ip -n "$NETNS" link set lo up
	# The bridge plugin turns on IPv4 forwarding for its gateway; down puts it back.
	[ -f "$STATE/ip_forward.before" ] || cat /proc/sys/net/ipv4/ip_forward >"$STATE/ip_forward.before"
	mkdir -p "$STATE/cni$SUFFIX/net.d"
	cat >"$STATE/cni$SUFFIX/net.d/10-sluice.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "sluice",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$BRIDGE",
      "isGateway": true,
      "ipMasq": false,
      "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]], "routes": [{"dst": "0.0.0.0/0"}], "dataDir": "$STATE/cni$SUFFIX/ipam"}
    },
    {"type": "loopback"}
  ]
}
EOF
}

# === containerd ===

containerd_config() { # (node sets which)
	mkdir -p "$STATE/containerd$SUFFIX" "$RUN/containerd$SUFFIX" "$RUN/runsc$SUFFIX"
	# runsc through containerd's runc shim (gVisor's own shim is not on the module proxy). The shim
	# starts one runtime per container; this wrapper makes each container a gVisor sandbox of its
	# own (see README.md, "gVisor without its shim").
	# SLUICE_RUNSC_DEBUG=1 at up: runsc's debug logs of every call in $LOGS/runsc.
	local debug=""
	if [ "${SLUICE_RUNSC_DEBUG:-}" = 1 ]; then
		debug="--log-dir $LOGS/runsc"
		mkdir -p "$LOGS/runsc"
	fi
	cat >"$RUN/runsc-runtime" <<EOF
#!/bin/sh
exec python3 -I -S $here/runsc-runtime.py --runsc $(command -v runsc) $debug -- "\$@"
EOF
	chmod 0755 "$RUN/runsc-runtime"
	cat >"$STATE/containerd$SUFFIX.toml" <<EOF
version = 2
root = "$STATE/containerd$SUFFIX"
state = "$RUN/containerd$SUFFIX"
[grpc]
  address = "$CONTAINERD_SOCK"
[ttrpc]
  address = "$CONTAINERD_SOCK.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  netns_mounts_under_state_dir = true
  # Without CAP_SYS_RESOURCE (some test machines' root lacks it) no oom_score_adj may go below
  # containerd's own: the pause container's -998 would fail every pod.
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "$RUN/runc$SUFFIX"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runsc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runsc.options]
        SystemdCgroup = false
        BinaryName = "$RUN/runsc-runtime"
        Root = "$RUN/runsc$SUFFIX"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$STATE/cni$SUFFIX/net.d"
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "$STATE/certs.d"
EOF
	# The cluster's registry speaks plain HTTP on the loopback address.
	mkdir -p "$STATE/certs.d/$REGISTRY_ADDR"
	cat >"$STATE/certs.d/$REGISTRY_ADDR/hosts.toml" <<EOF
server = "http://$REGISTRY_ADDR"
[host."http://$REGISTRY_ADDR"]
  capabilities = ["pull", "resolve"]
EOF
}

# === registry ===

run_registry() {
	mkdir -p "$STATE/registry"
	cat >"$STATE/registry.yml" <<EOF
version: 0.1
log: {level: warn}
storage:
  filesystem: {rootdirectory: $STATE/registry}
  delete: {enabled: true}
http:
  addr: $REGISTRY_ADDR
EOF
	start registry docker-registry serve "$STATE/registry.yml"
	wait_for "the registry at $REGISTRY_ADDR" 30 python3 -c "import urllib.request; urllib.request.urlopen('http://$REGISTRY_ADDR/v2/')"
}

# === kubelet ===

kubelet_config() { # (node sets which)
	mkdir -p "$STATE/kubelet$SUFFIX"
	cat >"$STATE/kubelet$SUFFIX.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
healthzBindAddress: $NODE_IP
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI/ca.crt}
authorization: {mode: Webhook}
cgroupDriver: cgroupfs
cgroupRoot: $NODE_CGROUP
failCgroupV1: false
containerRuntimeEndpoint: unix://$CONTAINERD_SOCK
tlsCertFile: $PKI/kubelet$SUFFIX.crt
tlsPrivateKeyFile: $PKI/kubelet$SUFFIX.key
clusterDomain: cluster.local
resolvConf: /etc/resolv.conf
# Each node's own: a kubelet deletes the log directories of pods it does not run (in a shared
# /var/log/pods, the other node's pods' logs went, and kubectl logs with them).
podLogsDir: $STATE/pod-logs$SUFFIX
# Test machines have small, busy disks: never evict, never collect images (the pause image is
# imported, not pulled, so it must not be collected either).
evictionHard: {memory.available: "1Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
imageMinimumGCAge: 87600h
failSwapOn: false
maxPods: 110
serializeImagePulls: false
podPidsLimit: -1
EOF
}

# === images ===

pause_image() { # (node sets which)
	local work=$STATE/pause
	mkdir -p "$work"
	if [ ! -f "$work/pause.tar" ]; then
		gcc -static -Os -o "$work/pause" "$here/pause.c"
		strip "$work/pause"
		python3 "$here/oci.py" --name "$PAUSE_IMAGE" --file "$work/pause:/pause:0755" \
			--entrypoint /pause --user 65535:65535 --out "$work/pause.tar" >/dev/null
	fi
	ctr_ images import "$work/pause.tar" >/dev/null
}

ctr_() { ctr --address "$CONTAINERD_SOCK" -n k8s.io "$@"; }

# === components: run_<name> starts one and waits until it answers ===

run_etcd() {
	start etcd "$BIN/etcd" --name sluice --data-dir "$STATE/etcd" \
		--listen-client-urls "http://$ETCD_CLIENT" --advertise-client-urls "http://$ETCD_CLIENT" \
		--listen-peer-urls "http://$ETCD_PEER" --initial-advertise-peer-urls "http://$ETCD_PEER" \
		--initial-cluster "sluice=http://$ETCD_PEER" \
		--quota-backend-bytes 2147483648 --log-level warn
	wait_for etcd 60 curl -sf "http://$ETCD_CLIENT/health"
}

# The API server's audit log: every write of Sluice's service accounts (whatever the release
# namespace), one JSON line each, and nothing else: `make bench-cluster` counts the writes per
# trigger point in it exactly (the request counters mix every client of the cluster).
audit_policy() {
	cat >"$STATE/audit-policy.yaml" <<EOF
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived, ResponseStarted]
rules:
  - level: Metadata
    verbs: [create, update, patch, delete, deletecollection]
    userGroups: [system:serviceaccounts]
  - level: None
EOF
}

run_kube_apiserver() {
	[ -f "$STATE/audit-policy.yaml" ] || audit_policy
	start kube-apiserver "$BIN/kube-apiserver" \
		--audit-policy-file "$STATE/audit-policy.yaml" --audit-log-path "$LOGS/audit.log" \
		--audit-log-maxsize 100 --audit-log-maxbackup 1 \
		--etcd-servers "http://$ETCD_CLIENT" \
		--advertise-address "$APISERVER_IP" --bind-address 0.0.0.0 --secure-port "$APISERVER_PORT" \
		--service-cluster-ip-range "$SERVICE_CIDR" \
		--tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" \
		--client-ca-file "$PKI/ca.crt" \
		--kubelet-client-certificate "$PKI/apiserver-kubelet-client.crt" \
		--kubelet-client-key "$PKI/apiserver-kubelet-client.key" \
		--kubelet-preferred-address-types InternalIP \
		--service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
		--service-account-issuer https://kubernetes.default.svc.cluster.local \
		--authorization-mode Node,RBAC \
		--enable-admission-plugins NodeRestriction \
		--enable-aggregator-routing=true \
		--allow-privileged=false \
		--profiling=false
	wait_for kube-apiserver 120 kubectl_ get --raw /readyz
}

run_kube_controller_manager() {
	start kube-controller-manager "$BIN/kube-controller-manager" \
		--kubeconfig "$STATE/controller-manager.kubeconfig" \
		--authentication-kubeconfig "$STATE/controller-manager.kubeconfig" \
		--authorization-kubeconfig "$STATE/controller-manager.kubeconfig" \
		--bind-address 127.0.0.1 --leader-elect=false \
		--service-account-private-key-file "$PKI/sa.key" --root-ca-file "$PKI/ca.crt" \
		--use-service-account-credentials=true \
		--cluster-signing-cert-file "$PKI/ca.crt" --cluster-signing-key-file "$PKI/ca.key" \
		--service-cluster-ip-range "$SERVICE_CIDR"
}

run_kube_scheduler() {
	start kube-scheduler "$BIN/kube-scheduler" \
		--kubeconfig "$STATE/scheduler.kubeconfig" \
		--authentication-kubeconfig "$STATE/scheduler.kubeconfig" \
		--authorization-kubeconfig "$STATE/scheduler.kubeconfig" \
		--bind-address 127.0.0.1 --leader-elect=false
}

run_containerd() { # (node sets which)
	start "containerd$SUFFIX" containerd --config "$STATE/containerd$SUFFIX.toml"
	wait_for "containerd$SUFFIX" 60 ctr_ version
}

# The kubelet's cgroupRoot must exist in every hierarchy; a new cpuset cgroup needs its parent's
# cpus and mems before anything can join it.
pod_cgroups() { # (node sets which)
	local c d
	for c in /sys/fs/cgroup/*/; do
		[ "$c" = /sys/fs/cgroup/unified/ ] && continue
		mkdir -p "$c${NODE_CGROUP#/}"
	done
	# Each level from the top down: a cpuset cgroup starts empty.
	for d in "$CGROUP_ROOT" "$NODE_CGROUP"; do
		if [ -d "/sys/fs/cgroup/cpuset$d" ]; then
			cat /sys/fs/cgroup/cpuset/cpuset.cpus >"/sys/fs/cgroup/cpuset$d/cpuset.cpus"
			cat /sys/fs/cgroup/cpuset/cpuset.mems >"/sys/fs/cgroup/cpuset$d/cpuset.mems"
		fi
	done
}

start_kubelet() { # (node sets which)
	start "kubelet$SUFFIX" "$BIN/kubelet" --config "$STATE/kubelet$SUFFIX.yaml" \
		--kubeconfig "$STATE/kubelet$SUFFIX.kubeconfig" --root-dir "$STATE/kubelet$SUFFIX" \
		--hostname-override "$NODE_NAME" --node-ip "$NODE_IP" --v 1
}

# kubelet_up <what> <seconds> <command...>: waits as wait_for does, starting the kubelet again when
# it has exited, as a node's service manager does (systemd's Restart=): a kubelet that finds the
# runtime's CRI not initialized yet (containerd recovering a stopped node's containers) exits.
kubelet_up() { # (node sets which)
	local what=$1 seconds=$2 i
	shift 2
	for i in $(seq 1 "$seconds"); do
		if "$@" >/dev/null 2>&1; then return 0; fi
		if ! running "kubelet$SUFFIX"; then
			log "the kubelet of $NODE_NAME exited ($(tail -n 1 "$LOGS/kubelet$SUFFIX.log" | cut -c1-200)); starting it again"
			start_kubelet
		fi
		sleep 1
	done
	die "timed out after ${seconds}s waiting for $what (logs: $LOGS)"
}

run_kubelet() { # (node sets which)
	pod_cgroups
	start_kubelet
	kubelet_up "node $NODE_NAME to register" 120 kubectl_ get node "$NODE_NAME"
	kubelet_up "the kubelet's health on $NODE_NAME" 60 curl -sf "http://$NODE_IP:10248/healthz"
}

# The component names of a node's processes: `kubelet`, `containerd` on the first, `kubelet-b`...
node_of() { # <component>: sets the node it runs on
	case "$1" in
	*-b) node sluice-node-b ;;
	*) node sluice-node ;;
	esac
}

# restart <component>: stop it and start it again as up did (the cluster suite's restart tests).
restart() {
	need_root
	local name=${1:-}
	case "$name" in
	etcd | kube-apiserver | kube-controller-manager | kube-scheduler | containerd | kubelet | containerd-b | kubelet-b) ;;
	*) die "restart: unknown component '$name' (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, containerd, kubelet, containerd-b, kubelet-b)" ;;
	esac
	running "$name" || die "restart: $name is not running (make cluster-up first)"
	BIN=$("$here/build.sh" --path)
	node_of "$name"
	stop "$name"
	local run=${name%-b}
	"run_${run//-/_}"
	log "restarted $name"
}

# node-stop <node>: its kubelet and containerd stop (SIGTERM); its containers keep running, as on a
# node that lost its network. The node controller marks it NotReady after its grace period.
node_stop() {
	need_root
	node "${1:-}"
	running "kubelet$SUFFIX" || die "node-stop: the kubelet of $NODE_NAME is not running"
	stop "kubelet$SUFFIX"
	stop "containerd$SUFFIX"
	log "node $NODE_NAME stopped (kubelet and containerd)"
}

# node-start <node>: its containerd and kubelet start again; waits for the node to be Ready.
node_start() {
	need_root
	node "${1:-}"
	running "kubelet$SUFFIX" && die "node-start: the kubelet of $NODE_NAME is running"
	BIN=$("$here/build.sh" --path)
	run_containerd
	run_kubelet
	wait_for "node $NODE_NAME Ready" 180 kubectl_ wait --for=condition=Ready "node/$NODE_NAME" --timeout=1s
	log "node $NODE_NAME started"
}

# === up ===

# The kubelet taints the node and evicts pods when the disk runs short (kubelet_config sets its
# thresholds to 1 %), and containerd cannot unpack images on a full disk: either way installs then
# time out waiting for pods that never start. Refuse to start on a disk that is already nearly full.
MIN_FREE_GIB=${SLUICE_CLUSTER_MIN_FREE_GIB:-8}
disk_room() {
	local free_gib
	mkdir -p "$STATE"
	free_gib=$(($(df --output=avail -B1 "$STATE/" | tail -1) / 1024 / 1024 / 1024))
	[ "$free_gib" -ge "$MIN_FREE_GIB" ] ||
		die "only ${free_gib} GiB free on $STATE's disk (at least $MIN_FREE_GIB needed): the kubelet would evict pods; free space (.ci/prune-target prunes Cargo's build directory)"
}

up() {
	need_root
	deps
	disk_room
	BIN=$("$here/build.sh")
	# The cluster's own kubectl (its version; .venv-tools' is newer than kubectl's skew policy allows).
	export PATH=$BIN:$PATH
	if running kube-apiserver || [ -e "$RUN/pids" ]; then
		die "a cluster is already up (or was not taken down): make cluster-down first"
	fi
	local n
	for n in "${NODES[@]}"; do
		node "$n"
		! ip netns list | grep -qw "$NETNS" || die "network namespace $NETNS exists: make cluster-down first"
	done
	mkdir -p "$STATE" "$RUN" "$PIDS" "$LOGS"

	log "certificates"
	make_pki
	for n in "${NODES[@]}"; do
		node "$n"
		log "node network of $n ($NODE_IP on $VETH, pods $POD_CIDR on $BRIDGE)"
		node_network
	done

	log "etcd"
	run_etcd
	log "kube-apiserver"
	run_kube_apiserver
	log "kube-controller-manager, kube-scheduler"
	run_kube_controller_manager
	run_kube_scheduler
	log "registry ($REGISTRY_ADDR)"
	run_registry
	for n in "${NODES[@]}"; do
		node "$n"
		log "$n: containerd, kubelet"
		containerd_config
		run_containerd
		pause_image
		kubelet_config
		run_kubelet
	done
	for n in "${NODES[@]}"; do
		wait_for "node $n Ready" 180 kubectl_ wait --for=condition=Ready "node/$n" --timeout=1s
	done

	kubectl_ apply -f - >/dev/null <<EOF
apiVersion: node.k8s.io/v1
kind: RuntimeClass
metadata: {name: gvisor}
handler: runsc
EOF
	wait_for "the default ServiceAccount" 60 kubectl_ -n default get serviceaccount default
	log "up: kube-apiserver https://$APISERVER_IP:$APISERVER_PORT, nodes ${NODES[*]} Ready, registry http://$REGISTRY_ADDR"
	echo "$KUBECONFIG_ADMIN"
}

# === down ===

# Our own processes by what their command line names: shims of our containerd, runsc sandboxes and
# gofers of our runsc root. Never anything else on the machine.
leftover_pids() {
	local pid cmd
	for pid in $(ls /proc | grep -E '^[0-9]+$'); do
		cmd=$( { tr '\0' ' ' <"/proc/$pid/cmdline"; } 2>/dev/null) || continue
		case "$cmd" in
		*"-address $RUN/"* | *"--root=$RUN/"* | *"--root $RUN/"* | *"$STATE/"*) echo "$pid" ;;
		esac
	done
}

our_mounts() {
	awk -v s="$STATE/" -v r="$RUN/" '{ m = $5; gsub(/\\040/, " ", m) } index(m, s) == 1 || index(m, r) == 1 || m == substr(s, 1, length(s) - 1) || m == substr(r, 1, length(r) - 1) { print m }' /proc/self/mountinfo | sort -r
}

our_cgroups() {
	local c
	for c in /sys/fs/cgroup/*/; do
		[ -d "$c${CGROUP_ROOT#/}" ] && echo "$c${CGROUP_ROOT#/}"
	done
	return 0
}

down() {
	need_root
	local n
	if [ -f "$KUBECONFIG_ADMIN" ] && running kube-apiserver; then
		log "deleting every pod (the kubelets tear down their sandboxes)"
		stop kube-controller-manager
		stop kube-scheduler
		kubectl_ delete pods --all -A --grace-period=1 --wait=false >/dev/null 2>&1 || true
		local i left
		for i in $(seq 1 90); do
			left=
			for n in "${NODES[@]}"; do
				node "$n"
				running "kubelet$SUFFIX" || continue
				[ -z "$(kubectl_ get pods -A --field-selector "spec.nodeName=$NODE_NAME" -o name 2>/dev/null)" ] || left=1
			done
			[ -z "$left" ] && break
			sleep 1
		done
	fi
	log "stopping the kubelets and containerds"
	for n in "${NODES[@]}"; do
		node "$n"
		stop "kubelet$SUFFIX"
		# A stopped node's containerd (node-stop) starts again to kill what it left running.
		if ! running "containerd$SUFFIX" && [ -f "$STATE/containerd$SUFFIX.toml" ]; then
			start "containerd$SUFFIX" containerd --config "$STATE/containerd$SUFFIX.toml"
			local j
			for j in $(seq 1 30); do ctr_ version >/dev/null 2>&1 && break; sleep 1; done
		fi
		if running "containerd$SUFFIX"; then
			local c
			for c in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks kill -s KILL "$c" >/dev/null 2>&1 || true; done
			sleep 1
			for c in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks delete -f "$c" >/dev/null 2>&1 || true; done
		fi
		stop "containerd$SUFFIX"
	done
	stop registry
	log "stopping the control plane"
	stop kube-scheduler
	stop kube-controller-manager
	stop kube-apiserver
	stop etcd
	local pid
	for pid in $(leftover_pids); do kill -KILL "$pid" 2>/dev/null || true; done
	sleep 1

	local m
	for m in $(our_mounts); do umount -l "$m" 2>/dev/null || true; done
	local cg d
	for cg in $(our_cgroups); do
		# Deepest first; a cgroup with processes left cannot go (reported below).
		find "$cg" -depth -type d -exec rmdir {} \; 2>/dev/null || true
	done
	for n in "${NODES[@]}"; do
		node "$n"
		! ip netns list 2>/dev/null | grep -qw "$NETNS" || ip netns delete "$NETNS"
		! ip link show "$VETH" >/dev/null 2>&1 || ip link delete "$VETH"
		! ip link show "$BRIDGE" >/dev/null 2>&1 || ip link delete "$BRIDGE"
	done
	[ -f "$STATE/ip_forward.before" ] && cat "$STATE/ip_forward.before" >/proc/sys/net/ipv4/ip_forward
	# The kubelet's iptables canaries.
	local table chain
	for table in mangle nat filter; do
		for chain in KUBE-KUBELET-CANARY KUBE-IPTABLES-HINT KUBE-FIREWALL; do
			iptables -t "$table" -F "$chain" 2>/dev/null && iptables -t "$table" -X "$chain" 2>/dev/null || true
			ip6tables -t "$table" -F "$chain" 2>/dev/null && ip6tables -t "$table" -X "$chain" 2>/dev/null || true
		done
	done
	rm -rf "$RUN" "$STATE" 2>/dev/null || true
	check_clean
}

# Fails, naming it, if anything of the cluster is still there.
check_clean() {
	local left=()
	[ -z "$(leftover_pids)" ] || left+=("processes: $(leftover_pids | tr '\n' ' ')")
	[ -z "$(our_mounts)" ] || left+=("mounts: $(our_mounts | tr '\n' ' ')")
	[ -z "$(our_cgroups)" ] || left+=("cgroups: $(our_cgroups | tr '\n' ' ')")
	local n
	for n in "${NODES[@]}"; do
		node "$n"
		! ip netns list 2>/dev/null | grep -qw "$NETNS" || left+=("network namespace $NETNS")
		! ip link show "$VETH" >/dev/null 2>&1 || left+=("interface $VETH")
		! ip link show "$BRIDGE" >/dev/null 2>&1 || left+=("interface $BRIDGE")
	done
	[ ! -e "$STATE" ] || left+=("directory $STATE")
	[ ! -e "$RUN" ] || left+=("directory $RUN")
	if [ ${#left[@]} -gt 0 ]; then
		printf 'cluster: left behind: %s\n' "${left[@]}" >&2
		exit 1
	fi
	log "down: no process, mount, network namespace, interface or cgroup left"
}

status() {
	local name
	for name in etcd kube-apiserver kube-controller-manager kube-scheduler containerd kubelet containerd-b kubelet-b; do
		if running "$name"; then echo "$name: running (pid $(cat "$PIDS/$name.pid"))"; else echo "$name: stopped"; fi
	done
	[ -f "$KUBECONFIG_ADMIN" ] && echo "kubeconfig: $KUBECONFIG_ADMIN"
	return 0
}

case "${1:-}" in
deps) deps ;;
up) up ;;
down) down ;;
status) status ;;
restart) restart "${2:-}" ;;
node-stop) node_stop "${2:-}" ;;
node-start) node_start "${2:-}" ;;
nodes) echo "${NODES[*]}" ;;
kubeconfig) [ -f "$KUBECONFIG_ADMIN" ] || die "no cluster is up"; echo "$KUBECONFIG_ADMIN" ;;
*) die "usage: cluster.sh deps|up|down|status|restart <component>|node-stop <node>|node-start <node>|nodes|kubeconfig" ;;
esac
