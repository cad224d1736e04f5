//! Stage 1, read: what exists for one chain, from the pod cache and the expectations (what the
//! cache does not show yet). Never from a cache that has not listed everything once: an empty pod
//! cache at start-up would look like an empty pool and the operator would create a second one.

use super::build::{LABEL_CHAIN, LABEL_CHAIN_NAMESPACE};
use super::context::Context;
use super::decide::pool::{NodeState, Observed};
use crate::expectations::{Pending, Seen};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::ResourceExt;
use sluice_crds::HookChain;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest a reconcile waits for the first full list of pods and capabilities.
const SYNC_WAIT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("HookChain {chain} has no namespace")]
    NoNamespace { chain: String },
    #[error("the {what} cache has not synced yet; not acting on a partial view")]
    CacheNotSynced { what: &'static str },
}

/// The chain's identity and its pods as they are now.
pub(crate) struct Snapshot {
    pub namespace: String,
    pub name: String,
    /// Where the chain's pods live: its own namespace, or the sandbox namespace.
    pub pod_namespace: String,
    /// `namespace/name`, as expectations, metrics and errors name the chain.
    pub key: String,
    pub pods: Vec<Arc<Pod>>,
    pub observed: Vec<Observed>,
    /// Creates and deletes made but not yet seen in the cache.
    pub pending: Pending,
}

/// Who the chain is, before anything is read: a chain being deleted needs no more.
pub(crate) fn identity(chain: &HookChain) -> Result<(String, String), ReadError> {
    let name = chain.name_any();
    let namespace = chain.namespace().ok_or_else(|| ReadError::NoNamespace {
        chain: name.clone(),
    })?;
    Ok((namespace, name))
}

pub(crate) async fn read(
    namespace: String,
    name: String,
    ctx: &Context,
) -> Result<Snapshot, ReadError> {
    let key = format!("{namespace}/{name}");
    let synced = |r: Result<Result<(), _>, _>| matches!(r, Ok(Ok(())));
    if !synced(tokio::time::timeout(SYNC_WAIT, ctx.pods.wait_until_ready()).await) {
        return Err(ReadError::CacheNotSynced { what: "pod" });
    }
    if !synced(tokio::time::timeout(SYNC_WAIT, ctx.capabilities.wait_until_ready()).await) {
        return Err(ReadError::CacheNotSynced { what: "capability" });
    }
    let pod_namespace = ctx.settings.pod_namespace(&namespace).to_string();
    let pods: Vec<Arc<Pod>> = ctx
        .pods
        .state_filter(|p| is_of_chain(p, &namespace, &name, &pod_namespace));
    let observed: Vec<Observed> = pods
        .iter()
        .map(|p| Observed::from_pod(p).on_node(node_state(p, ctx)))
        .collect();
    let pending = ctx.expectations.observe(&key, Instant::now(), |pod| {
        match observed.iter().find(|o| o.name == pod) {
            None => Seen::Absent,
            Some(o) if o.terminating => Seen::Terminating,
            Some(_) => Seen::Present,
        }
    });
    Ok(Snapshot {
        namespace,
        name,
        pod_namespace,
        key,
        pods,
        observed,
        pending,
    })
}

/// Where `pod`'s node stands in the node cache (serving when it is not there).
fn node_state(pod: &Pod, ctx: &Context) -> NodeState {
    let Some(name) = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) else {
        return NodeState::Serving;
    };
    match ctx
        .nodes
        .get(&kube::runtime::reflector::ObjectRef::new(name))
    {
        Some(node) => of_node(&node),
        None => NodeState::Serving,
    }
}

/// Taints the node controller puts on a node whose kubelet stopped reporting, or reports NotReady.
const TAINTS_LOST: [&str; 2] = [
    "node.kubernetes.io/unreachable",
    "node.kubernetes.io/not-ready",
];

/// Where a node stands: lost (not Ready, or tainted so by the node controller), cordoned, serving.
pub(crate) fn of_node(node: &Node) -> NodeState {
    let name = node.name_any();
    let spec = node.spec.as_ref();
    // `False`: the kubelet says so. `Unknown` (its reports stopped) is lost once the node
    // controller taints the node, after its grace period: one late report is not a lost node.
    let not_ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
        .is_some_and(|c| c.status == "False");
    let tainted_lost = spec
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|ts| ts.iter().any(|t| TAINTS_LOST.contains(&t.key.as_str())));
    if not_ready || tainted_lost {
        NodeState::Lost(name)
    } else if spec.and_then(|s| s.unschedulable) == Some(true) {
        NodeState::Cordoned(name)
    } else {
        NodeState::Serving
    }
}

/// True if `pod` belongs to the chain `namespace/name` whose pods live in `pod_namespace`: by its
/// chain-namespace label, or, for a pod made before that label existed, by living beside the chain.
pub(crate) fn is_of_chain(pod: &Pod, namespace: &str, name: &str, pod_namespace: &str) -> bool {
    let labels = pod.labels();
    let of_namespace = match labels.get(LABEL_CHAIN_NAMESPACE) {
        Some(ns) => ns == namespace,
        None => pod_namespace == namespace,
    };
    pod.metadata.namespace.as_deref() == Some(pod_namespace)
        && labels.get(LABEL_CHAIN).map(String::as_str) == Some(name)
        && of_namespace
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(yaml: serde_json::Value) -> Node {
        serde_json::from_value(yaml).expect("a node")
    }

    #[test]
    fn a_node_is_lost_when_not_ready_or_tainted_so_and_cordoned_when_unschedulable() {
        let ready = serde_json::json!({"conditions": [{"type": "Ready", "status": "True"}]});
        let unknown = serde_json::json!({"conditions": [{"type": "Ready", "status": "Unknown"}]});
        let not_ready = serde_json::json!({"conditions": [{"type": "Ready", "status": "False"}]});
        let serving = node(serde_json::json!({"metadata": {"name": "n"}, "status": ready}));
        assert_eq!(of_node(&serving), NodeState::Serving);
        let cordoned = node(serde_json::json!({
            "metadata": {"name": "n"}, "spec": {"unschedulable": true}, "status": ready,
        }));
        assert_eq!(of_node(&cordoned), NodeState::Cordoned("n".into()));
        let down = node(serde_json::json!({
            "metadata": {"name": "n"}, "spec": {"unschedulable": true}, "status": not_ready,
        }));
        assert_eq!(
            of_node(&down),
            NodeState::Lost("n".into()),
            "lost beats cordoned"
        );
        // The node controller: Ready Unknown and the unreachable taint once the kubelet is silent.
        let silent = node(serde_json::json!({
            "metadata": {"name": "n"},
            "spec": {"taints": [{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}]},
            "status": unknown,
        }));
        assert_eq!(of_node(&silent), NodeState::Lost("n".into()));
        let unknown_only = node(serde_json::json!({"metadata": {"name": "n"}, "status": unknown}));
        assert_eq!(
            of_node(&unknown_only),
            NodeState::Serving,
            "Unknown alone is a kubelet late once, not a lost node: the taint follows if it is"
        );
        let no_status = node(serde_json::json!({"metadata": {"name": "n"}}));
        assert_eq!(of_node(&no_status), NodeState::Serving);
    }
}
