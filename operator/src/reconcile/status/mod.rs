//! Stage 6, status: the chain's status (counts, code hash, conditions; built by
//! `conditions::status`) written by server-side apply on the status subresource, only when it
//! changed: at once when a condition, the code hash or the observed generation changed, but when
//! only the warm/claimed counts moved, at most every `COUNTS_EVERY` (each write sends the whole
//! object, hooks' code included, to every watcher). Live counts are in the pool gauges.

use super::apply::Applied;
use super::context::Context;
use super::read::Snapshot;
use crate::reconcile::build::FIELD_MANAGER;
pub mod conditions;
pub(crate) mod shadows;

pub use conditions::*;

use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use sluice_crds::{HookChain, HookChainStatus};
use std::time::{Duration, Instant};

/// Least time between two status writes that change nothing but the counts. Every write sends the
/// whole chain (up to 512 KiB of code) to every watcher, every gateway replica among them: under
/// steady traffic the counts move on nearly every trigger point, so this bounds that churn to one
/// write a minute per chain (it was 5 s). `kubectl get hc` counts may lag by that much; the pool
/// gauges are live.
pub(super) const COUNTS_EVERY: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error("HookChain {chain}: writing status: {source}")]
    Write { chain: String, source: kube::Error },
}

/// Writes the status when due; returns when a write of counts alone was put off until (a requeue).
pub(crate) async fn write(
    chain: &HookChain,
    read: &Snapshot,
    verdict: &Verdict,
    applied: &Applied,
    rollout: Option<sluice_crds::rollout::RolloutState>,
    now: Timestamp,
    ctx: &Context,
) -> Result<Option<Duration>, StatusError> {
    let status = conditions::status(
        chain,
        verdict,
        &applied.plan,
        rollout,
        ctx.settings.sandbox_cpu_limit,
        now,
    );
    let mut deferred = None;
    // The gateways' own entries (status.rollout.shadow) are theirs: not the operator's to compare
    // or to write.
    let theirs = chain.status.as_ref().map(without_gateway_entries);
    let due = match theirs.as_ref() {
        Some(current) if current == &status => false,
        Some(current) if only_counts_differ(current, &status) => {
            let last = super::context::lock(&ctx.status_written)
                .get(&read.key)
                .copied();
            match last.map(|t| t.elapsed()) {
                Some(since) if since < COUNTS_EVERY => {
                    deferred = Some(COUNTS_EVERY - since);
                    false
                }
                _ => true,
            }
        }
        _ => true,
    };
    if due {
        let api: Api<HookChain> = Api::namespaced(ctx.client.clone(), &read.namespace);
        let patch = serde_json::json!({
            "apiVersion": "sluice.dev/v1alpha1",
            "kind": "HookChain",
            "status": status,
        });
        api.patch_status(
            &read.name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map_err(|source| StatusError::Write {
            chain: read.key.clone(),
            source,
        })?;
        super::context::lock(&ctx.status_written).insert(read.key.clone(), Instant::now());
    }
    ctx.metrics.set_pool(
        &read.namespace,
        &read.name,
        applied.plan.counts.warm,
        applied.plan.counts.claimed,
    );
    Ok(deferred)
}

/// A status without what the gateways write into it.
fn without_gateway_entries(s: &HookChainStatus) -> HookChainStatus {
    let mut s = s.clone();
    if let Some(r) = s.rollout.as_mut() {
        r.shadow.clear();
    }
    s
}

/// Whether two statuses differ in their warm/claimed counts only.
fn only_counts_differ(a: &HookChainStatus, b: &HookChainStatus) -> bool {
    let mut b = b.clone();
    b.warm = a.warm;
    b.claimed = a.claimed;
    a == &b
}
