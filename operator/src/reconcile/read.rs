//! Stage 1, read: what exists for one chain, from the pod cache and the expectations (what the
//! cache does not show yet). Never from a cache that has not listed everything once: an empty pod
//! cache at start-up would look like an empty pool and the operator would create a second one.

use super::build::{LABEL_CHAIN, LABEL_CHAIN_NAMESPACE};
use super::context::Context;
use super::decide::pool::Observed;
use crate::expectations::{Pending, Seen};
use k8s_openapi::api::core::v1::Pod;
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
    let observed: Vec<Observed> = pods.iter().map(|p| Observed::from_pod(p)).collect();
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
