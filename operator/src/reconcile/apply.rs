//! Stage 5, apply: make the cluster match the plan. The NetworkPolicy by server-side apply (re-applied
//! at most every few minutes per chain), deletes preconditioned on the pod's resourceVersion (a pod a
//! gateway claimed in the meantime survives), creates in slow-start batches, and Events for what a
//! platform engineer should hear about (a verdict that changed, claims that expired, pods that
//! would not start, a pool held back).

use super::build::Desired;
use super::build::{self, FIELD_MANAGER};
use super::context::{Context, StartFailures, lock};
use super::decide::pool::{self, DeleteReason, Hold, Plan};
use super::read::Snapshot;
use super::status::{CODE_VALID, POOL_READY, Verdict};
use futures::future::join_all;
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use sluice_crds::HookChain;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often the NetworkPolicy is re-applied for a chain whose uid has not changed.
const NETPOL_REAPPLY: Duration = Duration::from_secs(300);

#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error("HookChain {chain}: applying NetworkPolicy {policy}: {source}")]
    NetworkPolicy {
        chain: String,
        policy: String,
        source: kube::Error,
    },
    #[error("HookChain {chain}: creating a sandbox pod: {source}")]
    CreatePod { chain: String, source: kube::Error },
    #[error("HookChain {chain}: cleaning up its {what}: {source}")]
    Cleanup {
        chain: String,
        what: &'static str,
        source: kube::Error,
    },
    #[error("HookChain {chain}: deleting pod {pod} ({reason}): {source}")]
    DeletePod {
        chain: String,
        pod: String,
        reason: &'static str,
        source: kube::Error,
    },
}

/// Applies the plan; returns how many pods it created.
pub(crate) async fn apply(
    chain: &HookChain,
    read: &Snapshot,
    desired: &Desired,
    verdict: &Verdict,
    plan: Plan,
    ctx: &Context,
) -> Result<Applied, ApplyError> {
    if plan.template_proven {
        lock(&ctx.start_failures).remove(&read.key);
    }
    // A name that is not a valid label value makes the policy's selector invalid: the verdict says
    // so and nothing is applied.
    if super::validate::name_problem(&read.name).is_none() {
        apply_network_policy(chain, &desired.policy, ctx).await?;
    }
    let reference = chain.object_ref(&());
    let previous: &[Condition] = chain
        .status
        .as_ref()
        .map(|s| s.conditions.as_slice())
        .unwrap_or_default();
    announce_verdict(ctx, &reference, previous, verdict).await;
    delete_pods(chain, read, &plan, &desired.template, ctx).await?;
    mark_draining(chain, read, &plan, ctx).await;
    let created = create_pods(chain, read, &plan, desired, ctx).await?;
    announce_hold(ctx, &reference, previous, &plan).await;
    Ok(Applied::new(plan, created))
}

/// The pool as `apply` left it: the plan it carried out, its counts including the pods it created
/// (the status tells what exists now).
pub(crate) struct Applied {
    pub(crate) plan: Plan,
}

impl Applied {
    fn new(mut plan: Plan, created: u32) -> Self {
        plan.counts.starting += created;
        plan.counts.total += created;
        Self { plan }
    }
}

fn api_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    }
}

async fn apply_network_policy(
    chain: &HookChain,
    policy: &NetworkPolicy,
    ctx: &Context,
) -> Result<(), ApplyError> {
    let uid = chain.uid().unwrap_or_default();
    let fresh = lock(&ctx.netpol_applied)
        .get(&uid)
        .is_some_and(|at| at.elapsed() < NETPOL_REAPPLY);
    if fresh {
        return Ok(());
    }
    let name = policy.name_any();
    let ns = policy.namespace().unwrap_or_default();
    let api: Api<NetworkPolicy> = Api::namespaced(ctx.client.clone(), &ns);
    let mut body = serde_json::to_value(policy).unwrap_or_default();
    body["apiVersion"] = "networking.k8s.io/v1".into();
    body["kind"] = "NetworkPolicy".into();
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&body),
    )
    .await
    .map_err(|source| ApplyError::NetworkPolicy {
        chain: format!("{ns}/{}", chain.name_any()),
        policy: name.clone(),
        source,
    })?;
    lock(&ctx.netpol_applied).insert(uid, Instant::now());
    Ok(())
}

/// Marks claimed pods on cordoned or lost nodes `sluice.dev/draining`: the gateway that holds each
/// gives it back when its trigger point ends, and the drain (waiting on the claimed pods'
/// PodDisruptionBudget) goes on. A failed mark is tried again at the next reconcile.
async fn mark_draining(chain: &HookChain, read: &Snapshot, plan: &Plan, ctx: &Context) {
    if plan.drain.is_empty() {
        return;
    }
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &read.pod_namespace);
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..Default::default()
    };
    let mut marked = Vec::new();
    for (pod, why) in &plan.drain {
        let patch = serde_json::json!({
            "metadata": {"annotations": {build::ANNOTATION_DRAINING: why}}
        });
        match api.patch(pod, &params, &Patch::Merge(&patch)).await {
            Ok(_) => marked.push(format!("{pod} ({why})")),
            Err(e) if api_code(&e) == Some(404) => {}
            Err(e) => {
                tracing::warn!(chain = %read.key, %pod, error = %e, "cannot mark a claimed pod draining")
            }
        }
    }
    if !marked.is_empty() {
        ctx.publish(
            &chain.object_ref(&()),
            EventType::Normal,
            "Draining",
            format!(
                "claimed sandbox pod(s) {} marked draining: their gateways give them back when their trigger points end",
                marked.join(", ")
            ),
        )
        .await;
    }
}

/// Deletes every pod and the NetworkPolicy of the chain `namespace/name`, wherever they live (the
/// cleanup of a deleted chain). Pods are listed from the API, not the cache: a pod created just
/// before the deletion must not be missed.
pub(crate) async fn delete_chain_objects(
    namespace: &str,
    name: &str,
    ctx: &Context,
) -> Result<(), ApplyError> {
    let pod_namespace = ctx.settings.pod_namespace(namespace);
    let chain = format!("{namespace}/{name}");
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), pod_namespace);
    let cleanup = |what| {
        let chain = chain.clone();
        move |source| ApplyError::Cleanup {
            chain,
            what,
            source,
        }
    };
    let listed = pods
        .list(&ListParams::default().labels(&build::chain_selector(namespace, name)))
        .await
        .map_err(cleanup("pods"))?;
    for pod in listed.items {
        let pod_name = pod.name_any();
        match pods.delete(&pod_name, &DeleteParams::default()).await {
            Ok(_) => ctx
                .metrics
                .pods_deleted
                .with_label_values(&["chain_deleted"])
                .inc(),
            Err(e) if api_code(&e) == Some(404) => {}
            Err(e) => return Err(cleanup("pods")(e)),
        }
    }
    let policies: Api<NetworkPolicy> = Api::namespaced(ctx.client.clone(), pod_namespace);
    let policy = build::network_policy_name(namespace, name, &ctx.settings);
    match policies.delete(&policy, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(e) if api_code(&e) == Some(404) => {}
        Err(e) => return Err(cleanup("NetworkPolicy")(e)),
    }
    Ok(())
}

async fn delete_pods(
    chain: &HookChain,
    read: &Snapshot,
    plan: &Plan,
    template: &str,
    ctx: &Context,
) -> Result<(), ApplyError> {
    let (key, pods): (&str, &[Arc<Pod>]) = (&read.key, &read.pods);
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &read.pod_namespace);
    let reference = chain.object_ref(&());
    let mut outdated = 0;
    for d in &plan.delete {
        let dp = DeleteParams {
            preconditions: d.resource_version.as_ref().map(|rv| Preconditions {
                resource_version: Some(rv.clone()),
                uid: None,
            }),
            ..Default::default()
        };
        match api.delete(&d.name, &dp).await {
            Ok(_) => {
                ctx.expectations.deleted(key, &d.name, Instant::now());
                ctx.metrics
                    .pods_deleted
                    .with_label_values(&[d.reason.as_str()])
                    .inc();
            }
            // Gone already, or changed (a gateway claimed it): the next reconcile sees which.
            Err(e) if matches!(api_code(&e), Some(404 | 409)) => {
                tracing::debug!(pod = %d.name, error = %e, "pod not deleted");
                continue;
            }
            Err(source) => {
                return Err(ApplyError::DeletePod {
                    chain: key.to_string(),
                    pod: d.name.clone(),
                    reason: d.reason.as_str(),
                    source,
                });
            }
        }
        match d.reason {
            DeleteReason::ClaimExpired => {
                let pod = pods.iter().find(|p| p.name_any() == d.name);
                let annotations = pod.map(|p| p.annotations().clone()).unwrap_or_default();
                let by = annotations
                    .get(build::ANNOTATION_CLAIMED_BY)
                    .map(String::as_str)
                    .unwrap_or("an unknown gateway");
                let at = annotations
                    .get(build::ANNOTATION_CLAIMED_AT)
                    .map(|t| format!(" at {t}"))
                    .unwrap_or_default();
                ctx.publish(
                    &reference,
                    EventType::Warning,
                    "ClaimExpired",
                    format!(
                        "deleted sandbox pod {}: claimed by {by}{at} and still held after the {}s claim deadline (did its gateway crash?)",
                        d.name,
                        ctx.claim_deadline.as_secs()
                    ),
                )
                .await;
            }
            DeleteReason::Finished => {
                ctx.publish(
                    &reference,
                    EventType::Warning,
                    "SandboxExited",
                    format!("deleted sandbox pod {}: its supervisor exited", d.name),
                )
                .await;
            }
            DeleteReason::StartTimeout => {
                let why = plan
                    .start_failed
                    .iter()
                    .find(|(pod, _)| *pod == d.name)
                    .map(|(_, why)| why.as_str())
                    .unwrap_or("not ready");
                {
                    let mut failures = lock(&ctx.start_failures);
                    let f = failures.entry(key.to_string()).or_default();
                    if f.template != template {
                        *f = StartFailures {
                            template: template.to_string(),
                            ..Default::default()
                        };
                    }
                    f.count = f.count.saturating_add(1);
                    f.last = format!("pod {}: {why}", d.name);
                }
                ctx.publish(
                    &reference,
                    EventType::Warning,
                    "StartFailed",
                    format!(
                        "pod {}: {why}; deleted after {}s without becoming ready and replaced (one at a time until a pod of this template starts)",
                        d.name,
                        ctx.start_deadline.as_secs()
                    ),
                )
                .await;
            }
            DeleteReason::Outdated => outdated += 1,
            DeleteReason::ScaleDown | DeleteReason::NodeLost => {}
        }
    }
    if outdated > 0 {
        ctx.publish(
            &reference,
            EventType::Normal,
            "RollingTemplate",
            format!("deleted {outdated} warm sandbox pod(s) of an old pod template"),
        )
        .await;
    }
    Ok(())
}

async fn create_pods(
    chain: &HookChain,
    read: &Snapshot,
    plan: &Plan,
    desired: &Desired,
    ctx: &Context,
) -> Result<u32, ApplyError> {
    if plan.create == 0 {
        return Ok(0);
    }
    let (key, pod, template) = (&read.key, &desired.pod, &desired.template);
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &read.pod_namespace);
    let pp = PostParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..Default::default()
    };
    let reference = chain.object_ref(&());
    let mut created = 0u32;
    let mut failure = None;
    for batch in pool::slow_start(plan.create) {
        let results = join_all((0..batch).map(|_| api.create(&pp, pod))).await;
        for r in results {
            match r {
                Ok(p) => {
                    created += 1;
                    ctx.expectations.created(key, &p.name_any(), Instant::now());
                    ctx.metrics.pods_created.inc();
                }
                Err(e) => failure = Some(e),
            }
        }
        if failure.is_some() {
            break;
        }
    }
    if created > 0 {
        ctx.publish(
            &reference,
            EventType::Normal,
            "CreatedSandboxes",
            format!("created {created} warm sandbox pod(s) (template {template})"),
        )
        .await;
    }
    if let Some(source) = failure {
        ctx.publish(
            &reference,
            EventType::Warning,
            "CreateFailed",
            format!("cannot create a sandbox pod: {source}"),
        )
        .await;
        return Err(ApplyError::CreatePod {
            chain: key.to_string(),
            source,
        });
    }
    Ok(created)
}

fn previous_condition<'a>(previous: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    previous.iter().find(|c| c.type_ == type_)
}

/// An Event when the code verdict changes: Warning with the problems, Normal once fixed.
async fn announce_verdict(
    ctx: &Context,
    reference: &ObjectReference,
    previous: &[Condition],
    verdict: &Verdict,
) {
    let before = previous_condition(previous, CODE_VALID);
    let same = before.is_some_and(|c| c.status == verdict.status && c.message == verdict.message);
    if same {
        return;
    }
    match verdict.status {
        "False" => {
            ctx.publish(
                reference,
                EventType::Warning,
                verdict.reason,
                verdict.message.clone(),
            )
            .await
        }
        "Unknown" => {
            ctx.publish(
                reference,
                EventType::Warning,
                verdict.reason,
                verdict.message.clone(),
            )
            .await
        }
        _ if before.is_some_and(|c| c.status == "False") => {
            ctx.publish(
                reference,
                EventType::Normal,
                "CodeValid",
                verdict.message.clone(),
            )
            .await
        }
        _ => {}
    }
}

/// A Warning Event when the pool starts being held (unschedulable pods, at max).
async fn announce_hold(
    ctx: &Context,
    reference: &ObjectReference,
    previous: &[Condition],
    plan: &Plan,
) {
    let before = previous_condition(previous, POOL_READY).map(|c| c.reason.as_str());
    match &plan.hold {
        Some(Hold::Unschedulable { pod, message }) if before != Some("Unschedulable") => {
            ctx.publish(
                reference,
                EventType::Warning,
                "Unschedulable",
                format!("sandbox pod {pod} cannot be scheduled: {message}; holding it instead of recreating it, and creating no more"),
            )
            .await
        }
        Some(Hold::AtMax) if before != Some("AtMax") => {
            ctx.publish(
                reference,
                EventType::Warning,
                "PoolAtMax",
                format!(
                    "the pool is at spec.pool.max: {} claimed, {} warm, {} starting, {} terminating",
                    plan.counts.claimed, plan.counts.warm, plan.counts.starting, plan.counts.terminating
                ),
            )
            .await
        }
        _ => {}
    }
}
