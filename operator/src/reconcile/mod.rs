//! One HookChain reconcile, in stages, each a module with its own error type (where it can fail)
//! and a typed hand-off to the next:
//!
//! `read` (the pod cache and expectations → `Snapshot`) → `validate` (spec, hook code,
//! capabilities → `Verdict`) → `build` (pure: pod, NetworkPolicy, template hash → `Desired`) →
//! `decide` (pure: the pool `Plan`) → `apply` (NetworkPolicy by server-side apply, deletes,
//! slow-start creates, Events → pods created) → `status` (server-side apply on the status
//! subresource).
//!
//! This module holds what every reconcile shares (`Context`), the entry points the controller
//! calls, and the order of the stages.

mod apply;
mod build;
mod decide;
mod read;
mod status;
mod validate;

pub use apply::ApplyError;
pub use read::ReadError;
pub use status::StatusError;

use crate::build::{FIELD_MANAGER, Settings};
use crate::expectations::Expectations;
use crate::metrics::Metrics;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::core::DeserializeGuard;
use kube::core::error_boundary::InvalidObject;
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::Store;
use kube::{Client, Resource, ResourceExt};
use sluice_crds::{Capability, HookChain};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often a settled chain is looked at again without any change.
const RESYNC: Duration = Duration::from_secs(300);
/// Why a reconcile failed, by the stage that failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error(transparent)]
    Apply(#[from] ApplyError),
    #[error(transparent)]
    Status(#[from] StatusError),
}

/// How long a new pod may take to become ready before it is replaced (`--start-deadline`).
pub const DEFAULT_START_DEADLINE: Duration = Duration::from_secs(120);

/// Pods of one chain's current template that failed to start in a row.
#[derive(Clone, Debug, Default)]
pub(crate) struct StartFailures {
    template: String,
    count: u32,
    /// `pod x: why`
    last: String,
}

/// What every reconcile shares.
pub struct Context {
    pub client: Client,
    pub settings: Settings,
    pub claim_deadline: Duration,
    /// A pod not ready this long after its creation is replaced (see `pool::plan`).
    pub start_deadline: Duration,
    pub pods: Store<Pod>,
    pub capabilities: Store<DeserializeGuard<Capability>>,
    pub expectations: Expectations,
    pub recorder: Recorder,
    pub metrics: Metrics,
    /// Code analysis results by code hash: python3 runs once per version of a chain's hooks.
    code_checks: Mutex<HashMap<String, crate::validate::CodeProblems>>,
    /// When each chain's (by uid) NetworkPolicy was last applied.
    netpol_applied: Mutex<HashMap<String, Instant>>,
    /// Start failures by chain (`ns/name`).
    start_failures: Mutex<HashMap<String, StartFailures>>,
}

impl Context {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        client: Client,
        settings: Settings,
        claim_deadline: Duration,
        pods: Store<Pod>,
        capabilities: Store<DeserializeGuard<Capability>>,
        expectations: Expectations,
        recorder: Recorder,
        metrics: Metrics,
    ) -> Self {
        Self {
            client,
            settings,
            claim_deadline,
            start_deadline: DEFAULT_START_DEADLINE,
            pods,
            capabilities,
            expectations,
            recorder,
            metrics,
            code_checks: Mutex::default(),
            netpol_applied: Mutex::default(),
            start_failures: Mutex::default(),
        }
    }

    /// Sets how long a new pod may take to become ready before it is replaced.
    pub fn with_start_deadline(mut self, deadline: Duration) -> Self {
        self.start_deadline = deadline;
        self
    }

    async fn publish(
        &self,
        regarding: &k8s_openapi::api::core::v1::ObjectReference,
        type_: EventType,
        reason: &str,
        note: String,
    ) {
        let ev = Event {
            type_,
            reason: reason.into(),
            note: Some(bounded_note(note)),
            action: "Reconcile".into(),
            secondary: None,
        };
        // Events help people; a failure to record one must not stop the pool.
        if let Err(e) = self.recorder.publish(&ev, regarding).await {
            tracing::warn!(error = %e, reason, "cannot publish event");
        }
    }
}

/// The API server refuses Event notes over 1 kB; a long list of problems is cut, not lost (the
/// condition message holds more).
fn bounded_note(mut note: String) -> String {
    const MAX: usize = 1000;
    if note.len() > MAX {
        let mut cut = MAX - '…'.len_utf8();
        while !note.is_char_boundary(cut) {
            cut -= 1;
        }
        note.truncate(cut);
        note.push('…');
    }
    note
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub async fn reconcile(
    obj: Arc<DeserializeGuard<HookChain>>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    use tracing::Instrument;
    ctx.metrics.reconciles.inc();
    let span = tracing::info_span!(
        "reconcile",
        chain = %format!("{}/{}", obj.namespace().unwrap_or_default(), obj.name_any())
    );
    match &obj.0 {
        Ok(chain) => reconcile_chain(chain, &ctx).instrument(span).await,
        Err(invalid) => {
            reconcile_unreadable(&obj, invalid, &ctx)
                .instrument(span)
                .await
        }
    }
}

pub fn error_policy(
    _obj: Arc<DeserializeGuard<HookChain>>,
    error: &Error,
    ctx: Arc<Context>,
) -> Action {
    ctx.metrics.reconcile_errors.inc();
    tracing::warn!(%error, "reconcile failed; retrying");
    Action::requeue(Duration::from_secs(5))
}

/// A chain the operator cannot read: say so on the object and wait for someone to change it.
async fn reconcile_unreadable(
    obj: &DeserializeGuard<HookChain>,
    invalid: &InvalidObject,
    ctx: &Context,
) -> Result<Action, Error> {
    let name = obj.name_any();
    tracing::warn!(chain = %name, error = %invalid.error, "HookChain does not match the schema");
    let reference = obj.object_ref(&());
    ctx.publish(
        &reference,
        EventType::Warning,
        "InvalidObject",
        format!("the operator cannot read this HookChain: {}", invalid.error),
    )
    .await;
    if let Some(ns) = obj.meta().namespace.as_deref() {
        let conditions =
            crate::status::unreadable(&[], &invalid.error, obj.meta().generation, Timestamp::now());
        let api: Api<HookChain> = Api::namespaced(ctx.client.clone(), ns);
        let patch = serde_json::json!({
            "apiVersion": "sluice.dev/v1alpha1",
            "kind": "HookChain",
            "status": {"conditions": conditions},
        });
        // Best effort: the object may be too broken for the status to be accepted either.
        if let Err(e) = api
            .patch_status(
                &name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await
        {
            tracing::warn!(chain = %name, error = %e, "cannot write status of an unreadable HookChain");
        }
    }
    Ok(Action::await_change())
}

async fn reconcile_chain(chain: &HookChain, ctx: &Context) -> Result<Action, Error> {
    let (namespace, name) = read::identity(chain)?;
    if chain.metadata.deletion_timestamp.is_some() {
        // The garbage collector removes the pods and the policy through their owner reference.
        forget(ctx, &namespace, &name);
        return Ok(Action::await_change());
    }
    let read = read::read(namespace, name, ctx).await?;
    let verdict = validate::validate(chain, &read.namespace, &read.name, ctx).await;
    let desired = build::build(chain, &ctx.settings);
    let now = Timestamp::now();
    let mut plan = decide::decide(chain, &read, &desired, &verdict, now, ctx);
    let created = apply::apply(chain, &read, &desired, &verdict, &plan, ctx).await?;
    // The status tells what exists now, the pods just created included.
    plan.counts.starting += created;
    plan.counts.total += created;
    status::write(chain, &read, &verdict, &plan, now, ctx).await?;

    // Pod events requeue the chain; the timers cover what no event announces.
    let mut next = RESYNC;
    if read.pending.creates > 0 || !read.pending.deletes.is_empty() {
        next = next.min(crate::expectations::DEFAULT_TIMEOUT);
    }
    for at in [plan.next_claim_expiry, plan.next_start_deadline]
        .into_iter()
        .flatten()
    {
        let wait = at.duration_since(now).unsigned_abs() + Duration::from_secs(1);
        next = next.min(wait);
    }
    Ok(Action::requeue(next))
}

/// Forgets a chain that is gone: its expectations and its pool gauges.
pub fn forget(ctx: &Context, namespace: &str, name: &str) {
    ctx.expectations.forget(&format!("{namespace}/{name}"));
    lock(&ctx.start_failures).remove(&format!("{namespace}/{name}"));
    ctx.metrics.forget_pool(namespace, name);
}

/// Validates a Capability as it arrives and records a Warning Event on it when it is unusable.
pub async fn check_capability(ctx: &Context, cap: &DeserializeGuard<Capability>) {
    let name = cap.name_any();
    let problems = match &cap.0 {
        Ok(c) => crate::validate::capability_problems(&name, &c.spec),
        Err(e) => vec![format!("does not match the Capability schema: {}", e.error)],
    };
    if problems.is_empty() {
        return;
    }
    let reference = cap.object_ref(&());
    ctx.publish(
        &reference,
        EventType::Warning,
        "InvalidCapability",
        format!("hooks cannot use this capability: {}", problems.join("; ")),
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::bounded_note;

    #[test]
    fn event_notes_fit_the_api_limit() {
        assert_eq!(bounded_note("short".into()), "short");
        let long = bounded_note("é".repeat(800));
        assert!(long.len() <= 1000 && long.ends_with('…'), "{}", long.len());
    }
}
