//! Stage 5b, rollout: the chain's revisions and where its rollout stands. Every valid version of
//! the hooks is kept as a ControllerRevision (`<chain>-<revision>`, owned by the chain, labelled
//! `sluice.dev/hookchain`, `data.spec` the whole spec), the newest `revisionHistoryLimit` of them
//! and always the live one and the candidate; `status.rollout` moves on by
//! `sluice_crds::rollout::advance` (spec, annotations, time), with an Event for each step. The
//! gateways read both: the status says which revision is live, the ControllerRevision holds its
//! hooks. A spec that fails its checks never becomes a candidate: the rollout stays where it was.

use super::context::Context;
use super::read::Snapshot;
use super::status::Verdict;
use k8s_openapi::api::apps::v1::ControllerRevision;
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use sluice_crds::HookChain;
use sluice_crds::definition::RolloutOrders;
use sluice_crds::rollout::{
    REVISION_LABEL, RolloutState, Transition, advance, revision_object_name, revision_of,
};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
enum RolloutError {
    #[error("HookChain {chain}: keeping its revisions: {source}")]
    Revisions { chain: String, source: kube::Error },
}

/// How soon a rollout held by revisions that could not be kept is tried again.
const REVISIONS_RETRY: Duration = Duration::from_secs(10);

/// Where the rollout stands now, and when to look again (a canary's step ends).
pub(crate) struct Rolled {
    pub state: Option<RolloutState>,
    pub next: Option<Duration>,
}

pub(crate) async fn rollout(
    chain: &HookChain,
    read: &Snapshot,
    verdict: &Verdict,
    now: Timestamp,
    ctx: &Context,
) -> Rolled {
    let previous = chain.status.as_ref().and_then(|s| s.rollout.clone());
    if verdict.is_invalid() {
        return Rolled {
            state: previous,
            next: None,
        };
    }
    let orders = RolloutOrders::from_annotations(chain.metadata.annotations.as_ref());
    let (mut state, transition, next) = advance(
        previous.as_ref(),
        &chain.spec,
        &orders,
        now.as_second(),
        |secs| {
            Timestamp::from_second(secs)
                .map(|t| t.to_string())
                .unwrap_or_default()
        },
        |text| text.parse::<Timestamp>().ok().map(|t| t.as_second()),
    );
    // The gateways' entries are theirs (server-side apply keeps them while the operator's
    // applied status leaves them out).
    state.shadow.clear();
    // The revisions first: a gateway reads the live revision's hooks from its ControllerRevision.
    // If they cannot be kept (the API server failing, RBAC without them), the rollout stays where
    // it was and is tried again shortly; the pool and the rest of the status go on.
    if let Err(source) = keep_revisions(chain, read, &state, ctx).await {
        let e = RolloutError::Revisions {
            chain: read.key.clone(),
            source,
        };
        tracing::warn!(error = %e, "rollout held until the revisions can be kept");
        return Rolled {
            state: previous,
            next: Some(REVISIONS_RETRY),
        };
    }
    if let Some(t) = transition {
        let (kind, note) = match &t {
            Transition::Started(strategy) => (
                EventType::Normal,
                format!("{} rollout started: {}", strategy.as_str(), state.message),
            ),
            Transition::Step(_) => (EventType::Normal, state.message.clone()),
            Transition::Promoted(_) => (EventType::Normal, state.message.clone()),
            Transition::RolledBack(_) => (EventType::Warning, state.message.clone()),
        };
        tracing::info!(chain = %read.key, reason = t.reason(), "{note}");
        ctx.publish(&chain.object_ref(&()), kind, t.reason(), note)
            .await;
    }
    Rolled {
        state: Some(state),
        next,
    }
}

/// Records the spec's revision (once) and drops the oldest beyond the limit.
async fn keep_revisions(
    chain: &HookChain,
    read: &Snapshot,
    state: &RolloutState,
    ctx: &Context,
) -> Result<(), kube::Error> {
    let revision = revision_of(&chain.spec);
    let remembered = format!("{}/{}", chain.uid().unwrap_or_default(), revision);
    if super::context::lock(&ctx.revisions_kept).contains(&remembered) {
        return Ok(());
    }
    let api: Api<ControllerRevision> = Api::namespaced(ctx.client.clone(), &read.namespace);
    let mine = api
        .list(&ListParams::default().labels(&format!("{REVISION_LABEL}={}", read.name)))
        .await?;
    let name = revision_object_name(&read.name, &revision);
    let mut all: Vec<(i64, String)> = mine
        .items
        .iter()
        .map(|r| (r.revision, r.name_any()))
        .collect();
    if !all.iter().any(|(_, n)| *n == name) {
        let number = all.iter().map(|(n, _)| *n).max().unwrap_or(0) + 1;
        let mut object = ControllerRevision {
            data: Some(RawExtension(serde_json::json!({ "spec": chain.spec }))),
            revision: number,
            ..Default::default()
        };
        object.metadata.name = Some(name.clone());
        object.metadata.namespace = Some(read.namespace.clone());
        object.metadata.labels = Some([(REVISION_LABEL.to_string(), read.name.clone())].into());
        object.metadata.owner_references = chain.controller_owner_ref(&()).map(|o| vec![o]);
        match api.create(&PostParams::default(), &object).await {
            Ok(_) => all.push((number, name.clone())),
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(e),
        }
    }
    let keep: Vec<String> = [
        Some(state.live_revision.as_str()),
        state.candidate_revision.as_deref(),
        Some(revision.as_str()),
    ]
    .into_iter()
    .flatten()
    .map(|r| revision_object_name(&read.name, r))
    .collect();
    all.sort();
    let limit = chain.spec.revision_history_limit.max(1) as usize;
    let mut excess = all.len().saturating_sub(limit);
    for (_, old) in &all {
        if excess == 0 {
            break;
        }
        if keep.contains(old) {
            continue;
        }
        // Pruning is housekeeping: a failure is logged and tried again with the next revision.
        match api.delete(old, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => {
                tracing::warn!(chain = %read.key, revision = %old, error = %e, "cannot delete an old revision");
            }
        }
        excess -= 1;
    }
    super::context::lock(&ctx.revisions_kept).insert(remembered);
    Ok(())
}
