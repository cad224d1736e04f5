//! One HookChain reconcile, in stages, each a module with its own error type (where it can fail)
//! and a typed hand-off to the next:
//!
//! `read` (the pod cache and expectations → `Snapshot`) → `validate` (spec, hook code,
//! capabilities → `Verdict`) → `build` (pure: pod, NetworkPolicy, template hash → `Desired`) →
//! `decide` (pure: the pool `Plan`) → `apply` (NetworkPolicy by server-side apply, deletes,
//! slow-start creates, Events → `Applied`: the pool as it now is) → `status` (server-side apply on
//! the status subresource). A failed reconcile is counted by its stage (`Error::stage`).
//!
//! All of it runs under the chain's finalizer (`sluice.dev/sandboxes`, through
//! `kube::runtime::finalizer`): added first, and on deletion `cleanup` deletes the chain's pods and
//! NetworkPolicy wherever they live (the sandbox namespace is beyond owner references) before the
//! chain may go. `capability` writes the Capabilities' own status.
//!
//! A stage with pure rules of its own is a folder: the stage in its `mod.rs`, the rules beside it
//! (`build/objects.rs`, the pod and NetworkPolicy `sluice-operator render` prints too;
//! `validate/rules.rs`; `decide/pool.rs`, the pool plan; `status/conditions.rs`), each unit-tested
//! with plain asserts.
//!
//! `context` holds what every reconcile shares; this module holds the entry points the controller
//! calls and the order of the stages.

mod apply;
pub mod build;
mod capability;
mod context;
pub mod decide;
mod read;
mod rollout;
pub mod status;
mod text;
pub mod validate;

pub use apply::ApplyError;
pub use capability::{SCHEMA_VALID, check_namespace as check_capabilities};
pub use context::{Context, DEFAULT_START_DEADLINE};
pub use read::ReadError;
pub use status::StatusError;

use self::build::{FIELD_MANAGER, FINALIZER};
use context::lock;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::core::error_boundary::InvalidObject;
use kube::core::{DeserializeGuard, PartialObjectMeta, TypeMeta};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::finalizer::{self, finalizer};
use kube::{Resource, ResourceExt};
use sluice_crds::HookChain;
use sluice_crds::log_text::Escaped;
use std::sync::Arc;
use std::time::Duration;

/// How often a settled chain is looked at again without any change.
const RESYNC: Duration = Duration::from_secs(300);
/// Why a reconcile failed, by the stage that failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error("HookChain {chain}: {action} the finalizer {FINALIZER}: {source}")]
    Finalizer {
        chain: String,
        action: &'static str,
        source: kube::Error,
    },
    #[error("a HookChain without a name or with a malformed finalizer list")]
    Unnamed,
    #[error(transparent)]
    Apply(#[from] ApplyError),
    #[error(transparent)]
    Status(#[from] StatusError),
}

impl Error {
    /// The stage that failed, as `sluice_operator_reconcile_errors_total` counts it.
    pub fn stage(&self) -> &'static str {
        match self {
            Self::Read(_) => "read",
            Self::Finalizer { .. } | Self::Unnamed => "finalizer",
            Self::Apply(_) => "apply",
            Self::Status(_) => "status",
        }
    }
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
    let Some(namespace) = obj.namespace() else {
        return Err(ReadError::NoNamespace {
            chain: obj.name_any(),
        }
        .into());
    };
    // The finalizer needs only the chain's metadata, which even a chain the operator cannot read
    // has: its pods go when it goes, readable or not.
    let meta = Arc::new(PartialObjectMeta::<HookChain> {
        types: Some(TypeMeta {
            api_version: "sluice.dev/v1alpha1".into(),
            kind: "HookChain".into(),
        }),
        metadata: obj.meta().clone(),
        _phantom: std::marker::PhantomData,
    });
    let api: Api<PartialObjectMeta<HookChain>> = Api::namespaced(ctx.client.clone(), &namespace);
    let chain_key = format!("{namespace}/{}", obj.name_any());
    let (guard, context, ns) = (&*obj, &*ctx, namespace.as_str());
    let outcome = finalizer(&api, FINALIZER, meta, |event| async move {
        match event {
            finalizer::Event::Apply(_) => match &guard.0 {
                Ok(chain) => reconcile_chain(chain, context).await,
                Err(invalid) => reconcile_unreadable(guard, invalid, context).await,
            },
            finalizer::Event::Cleanup(_) => cleanup(ns, &guard.name_any(), context).await,
        }
    })
    .instrument(span)
    .await;
    outcome.map_err(|e| match e {
        finalizer::Error::ApplyFailed(e) | finalizer::Error::CleanupFailed(e) => e,
        finalizer::Error::AddFinalizer(source) => Error::Finalizer {
            chain: chain_key,
            action: "adding",
            source,
        },
        finalizer::Error::RemoveFinalizer(source) => Error::Finalizer {
            chain: chain_key,
            action: "removing",
            source,
        },
        finalizer::Error::UnnamedObject | finalizer::Error::InvalidFinalizer => Error::Unnamed,
    })
}

/// A chain is being deleted: its pods and its NetworkPolicy go first (the finalizer holds the chain
/// until they have). Owner references would do this for objects beside the chain, but not across
/// namespaces, so the operator does it in both layouts. Idempotent: a retry deletes what is left.
async fn cleanup(namespace: &str, name: &str, ctx: &Context) -> Result<Action, Error> {
    apply::delete_chain_objects(namespace, name, ctx).await?;
    forget(ctx, namespace, name);
    Ok(Action::await_change())
}

pub fn error_policy(
    _obj: Arc<DeserializeGuard<HookChain>>,
    error: &Error,
    ctx: Arc<Context>,
) -> Action {
    ctx.metrics
        .reconcile_errors
        .with_label_values(&[error.stage()])
        .inc();
    tracing::warn!(error = %Escaped(&error.to_string()), "reconcile failed; retrying");
    Action::requeue(Duration::from_secs(5))
}

/// A chain the operator cannot read: say so on the object and wait for someone to change it.
async fn reconcile_unreadable(
    obj: &DeserializeGuard<HookChain>,
    invalid: &InvalidObject,
    ctx: &Context,
) -> Result<Action, Error> {
    let name = obj.name_any();
    // The reader's error quotes what the tenant wrote.
    tracing::warn!(chain = %name, error = %Escaped(&invalid.error), "HookChain does not match the schema");
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
            self::status::unreadable(&[], &invalid.error, obj.meta().generation, Timestamp::now());
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
            tracing::warn!(chain = %name, error = %Escaped(&e.to_string()), "cannot write status of an unreadable HookChain");
        }
    }
    Ok(Action::await_change())
}

async fn reconcile_chain(chain: &HookChain, ctx: &Context) -> Result<Action, Error> {
    let (namespace, name) = read::identity(chain)?;
    let read = read::read(namespace, name, ctx).await?;
    let verdict = validate::validate(chain, &read.namespace, &read.name, ctx).await;
    let desired = build::build(chain, &ctx.settings);
    let now = Timestamp::now();
    let plan = decide::decide(chain, &read, &desired, &verdict, now, ctx);
    let applied = apply::apply(chain, &read, &desired, &verdict, plan, ctx).await?;
    let rolled = rollout::rollout(chain, &read, &verdict, now, ctx).await;
    let status_due =
        status::write(chain, &read, &verdict, &applied, rolled.state, now, ctx).await?;
    let shadows_due = status::shadows::prune(chain, &read.namespace, &read.name, now, ctx).await;
    let plan = &applied.plan;

    // Pod events requeue the chain; the timers cover what no event announces.
    let mut next = RESYNC;
    if let Some(step_ends) = rolled.next {
        next = next.min(step_ends);
    }
    for due in [status_due, shadows_due].into_iter().flatten() {
        next = next.min(due);
    }
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
    lock(&ctx.status_written).remove(&format!("{namespace}/{name}"));
    ctx.metrics.forget_pool(namespace, name);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_failure_is_counted_by_the_stage_that_failed() {
        let read = Error::Read(ReadError::NoNamespace { chain: "c".into() });
        assert_eq!(read.stage(), "read");
        assert_eq!(Error::Unnamed.stage(), "finalizer");
        let gone = kube::Error::Api(
            kube::core::Status::failure("gone", "NotFound")
                .with_code(404)
                .boxed(),
        );
        assert_eq!(
            Error::Finalizer {
                chain: "c".into(),
                action: "adding",
                source: gone
            }
            .stage(),
            "finalizer"
        );
    }
}
