//! Stage 6, status: the chain's status (counts, code hash, conditions; built by
//! `crate::status::status`) written by server-side apply on the status subresource, only when it
//! changed; and the pool gauges.

use super::context::Context;
use super::read::Snapshot;
use crate::build::FIELD_MANAGER;
use crate::pool::Plan;
use crate::status::{self, Verdict};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use sluice_crds::HookChain;

#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error("HookChain {chain}: writing status: {source}")]
    Write { chain: String, source: kube::Error },
}

pub(crate) async fn write(
    chain: &HookChain,
    read: &Snapshot,
    verdict: &Verdict,
    plan: &Plan,
    now: Timestamp,
    ctx: &Context,
) -> Result<(), StatusError> {
    let status = status::status(chain, verdict, plan, now);
    if chain.status.as_ref() != Some(&status) {
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
    }
    ctx.metrics.set_pool(
        &read.namespace,
        &read.name,
        plan.counts.warm,
        plan.counts.claimed,
    );
    Ok(())
}
