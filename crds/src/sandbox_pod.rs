//! The names the operator and the gateway agree on for warm sandbox pods: the labels the operator
//! sets and the gateway selects and flips to claim a pod, the annotations of a claim, and where the
//! supervisor lives in the pod. One place, so the two sides cannot drift apart.

pub const LABEL_NAME: &str = "app.kubernetes.io/name";
pub const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
/// The value of `LABEL_MANAGED_BY` on every sandbox pod (and the operator's field manager).
pub const OPERATOR: &str = "sluice-operator";
pub const LABEL_CHAIN: &str = "sluice.dev/chain";
/// The namespace of the pod's HookChain. Pods may live in a dedicated sandbox namespace, away from
/// their chain, where owner references cannot point (they do not cross namespaces): these labels
/// say whose pod it is, and the operator's finalizer on the chain deletes its pods by them.
pub const LABEL_CHAIN_NAMESPACE: &str = "sluice.dev/chain-namespace";
/// The uid of the pod's HookChain (a chain deleted and created again under its name is another).
pub const LABEL_CHAIN_UID: &str = "sluice.dev/chain-uid";
/// The operator's finalizer on every HookChain: its pods and NetworkPolicy go before the chain does.
pub const FINALIZER: &str = "sluice.dev/sandboxes";
pub const LABEL_TEMPLATE: &str = "sluice.dev/template";
/// `warm` when created; the gateway flips it to `claimed` in the claim PATCH.
pub const LABEL_POOL: &str = "sluice.dev/pool";
pub const POOL_WARM: &str = "warm";
pub const POOL_CLAIMED: &str = "claimed";
pub const ANNOTATION_CLAIMED_BY: &str = "sluice.dev/claimed-by";
pub const ANNOTATION_CLAIMED_AT: &str = "sluice.dev/claimed-at";
/// The cluster autoscaler's annotation: `"true"` on warm pods (a node holding only warm sandboxes
/// may be scaled down: the operator makes new ones elsewhere), `"false"` from the claim on (a
/// claimed pod holds a gateway's session). Without it, autoscaled sandbox node pools never shrink.
pub const ANNOTATION_SAFE_TO_EVICT: &str = "cluster-autoscaler.kubernetes.io/safe-to-evict";
/// Set by the operator on a claimed pod whose node is cordoned (drained) or lost, saying which and
/// why: the gateway that holds it gives it back (deletes it) when its trigger point ends, and no
/// gateway claims a pod that carries it. A drain waits for that (the chart's PodDisruptionBudget
/// keeps claimed pods from eviction), so no trigger point is cut off.
pub const ANNOTATION_DRAINING: &str = "sluice.dev/draining";
pub const SANDBOX_NAME: &str = "sluice-sandbox";
/// The container the gateway execs into.
pub const CONTAINER: &str = "supervisor";
/// The supervisor's path in the supervisor image. A warm pod's main process is
/// `SUPERVISOR --listen --runtime RUNTIME --memory-bytes M --pids P`: ready (runtime loaded, a hook
/// run through a real instance) before the pod turns Ready.
pub const SUPERVISOR: &str = "/opt/sluice/sluice-supervisor";
/// Memory a sandbox needs beyond its hooks': gVisor's sentry and the supervisor with its WebAssembly
/// runtime. The chain's `resources.memory` bounds each hook's instance; a pod's (and a local
/// sandbox's) memory limit is that plus this.
pub const RUNTIME_MEMORY_BYTES: u64 = 256 << 20;

/// The cell runtime in the supervisor image (the pre-initialised CPython component, precompiled);
/// its SHA-256 is in `RUNTIME.sha256` beside it, which the supervisor checks before loading it.
pub const RUNTIME: &str = "/opt/sluice/sluice-cell.cwasm";

/// The command the gateway execs into a claimed pod for one trigger point: the relay that hands the
/// exec's stdin, stdout and stderr to the waiting supervisor.
pub fn attach_command() -> Vec<String> {
    vec![SUPERVISOR.to_string(), "attach".into()]
}

/// The pod's startup probe: the supervisor answers, still waiting for its attach.
pub fn probe_command() -> Vec<String> {
    vec![SUPERVISOR.to_string(), "attach".into(), "--probe".into()]
}

/// A warm pod's main process: the supervisor, listening, with the chain's limits. Nothing in it
/// depends on the chain's hooks: every trigger point's cell gets them from the gateway.
pub fn supervisor_command(memory_bytes: u64, pids: u32) -> Vec<String> {
    [
        SUPERVISOR.to_string(),
        "--listen".into(),
        "--runtime".into(),
        RUNTIME.into(),
        "--memory-bytes".into(),
        memory_bytes.to_string(),
        "--pids".into(),
        pids.to_string(),
    ]
    .into()
}
