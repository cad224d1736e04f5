//! One HookChain reconcile: read (the pod cache and expectations) → validate (spec, hook code,
//! capabilities) → build (pure: pod, NetworkPolicy, template hash) → decide (pure: the pool plan) →
//! apply (NetworkPolicy by server-side apply, deletes, slow-start creates, Events) → status
//! (server-side apply on the status subresource).

use crate::build::{self, FIELD_MANAGER, LABEL_CHAIN, Settings};
use crate::expectations::{Expectations, Seen};
use crate::metrics::Metrics;
use crate::pool::{self, DeleteReason, Hold, Observed, Plan};
use crate::status::{self, CODE_VALID, POOL_READY, Verdict};
use crate::validate::{self, CapabilityState};
use futures::future::join_all;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
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
/// How often the NetworkPolicy is re-applied for a chain whose uid has not changed.
const NETPOL_REAPPLY: Duration = Duration::from_secs(300);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("HookChain {chain}: applying NetworkPolicy {policy}: {source}")]
    NetworkPolicy {
        chain: String,
        policy: String,
        source: kube::Error,
    },
    #[error("HookChain {chain}: creating a sandbox pod: {source}")]
    CreatePod { chain: String, source: kube::Error },
    #[error("HookChain {chain}: deleting pod {pod} ({reason}): {source}")]
    DeletePod {
        chain: String,
        pod: String,
        reason: &'static str,
        source: kube::Error,
    },
    #[error("HookChain {chain}: writing status: {source}")]
    Status { chain: String, source: kube::Error },
    #[error("HookChain {chain} has no namespace")]
    NoNamespace { chain: String },
    #[error("the {what} cache has not synced yet; not acting on a partial view")]
    CacheNotSynced { what: &'static str },
}

/// How long a new pod may take to become ready before it is replaced (`--start-deadline`).
pub const DEFAULT_START_DEADLINE: Duration = Duration::from_secs(120);

/// Pods of one chain's current template that failed to start in a row.
#[derive(Clone, Debug, Default)]
struct StartFailures {
    template: String,
    count: u32,
    /// `pod x: why`
    last: String,
}

/// Longest a reconcile waits for the first full list of pods and capabilities.
const SYNC_WAIT: Duration = Duration::from_secs(30);

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
    code_checks: Mutex<HashMap<String, validate::CodeProblems>>,
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

    async fn code_check(&self, chain: &HookChain) -> validate::CodeCheck {
        let hash = chain.spec.code_hash();
        if let Some(hit) = lock(&self.code_checks).get(&hash) {
            return Ok(hit.clone());
        }
        let spec = chain.spec.clone();
        let result = tokio::task::spawn_blocking(move || validate::check_code(&spec))
            .await
            .unwrap_or_else(|e| Err(format!("the code checker task failed: {e}")));
        if let Ok(found) = &result {
            let mut cache = lock(&self.code_checks);
            // Bounded: hook versions come and go; losing the cache only costs a python3 run.
            if cache.len() > 1000 {
                cache.clear();
            }
            cache.insert(hash, found.clone());
        }
        result
    }

    fn capability_state(&self, namespace: &str, name: &str) -> CapabilityState {
        let found = self.capabilities.find(|c| {
            c.meta().namespace.as_deref() == Some(namespace)
                && c.meta().name.as_deref() == Some(name)
        });
        match found.as_deref() {
            None => CapabilityState::Missing,
            Some(DeserializeGuard(Err(e))) => CapabilityState::Invalid(format!(
                "does not match the Capability schema: {}",
                e.error
            )),
            Some(DeserializeGuard(Ok(cap))) => {
                let problems = validate::capability_problems(name, &cap.spec);
                if problems.is_empty() {
                    CapabilityState::Valid
                } else {
                    CapabilityState::Invalid(problems.join("; "))
                }
            }
        }
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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn api_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
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
            status::unreadable(&[], &invalid.error, obj.meta().generation, Timestamp::now());
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
    let name = chain.name_any();
    let ns = chain.namespace().ok_or_else(|| Error::NoNamespace {
        chain: name.clone(),
    })?;
    let key = format!("{ns}/{name}");
    if chain.metadata.deletion_timestamp.is_some() {
        // The garbage collector removes the pods and the policy through their owner reference.
        forget(ctx, &ns, &name);
        return Ok(Action::await_change());
    }
    // A name that is not a valid label value makes every pod (and the policy's selector) invalid:
    // the verdict says so and nothing is created.
    let name_valid = validate::name_problem(&name).is_none();

    // Read, but never from a cache that has not listed everything once: an empty pod cache at
    // start-up would look like an empty pool and the operator would create a second one.
    let synced = |r: Result<Result<(), _>, _>| matches!(r, Ok(Ok(())));
    if !synced(tokio::time::timeout(SYNC_WAIT, ctx.pods.wait_until_ready()).await) {
        return Err(Error::CacheNotSynced { what: "pod" });
    }
    if !synced(tokio::time::timeout(SYNC_WAIT, ctx.capabilities.wait_until_ready()).await) {
        return Err(Error::CacheNotSynced { what: "capability" });
    }
    let pods: Vec<Arc<Pod>> = ctx.pods.state_filter(|p| {
        p.metadata.namespace.as_deref() == Some(ns.as_str())
            && p.labels().get(LABEL_CHAIN) == Some(&name)
    });
    let observed: Vec<Observed> = pods.iter().map(|p| Observed::from_pod(p)).collect();
    let pending = ctx.expectations.observe(&key, Instant::now(), |pod| {
        match observed.iter().find(|o| o.name == pod) {
            None => Seen::Absent,
            Some(o) if o.terminating => Seen::Terminating,
            Some(_) => Seen::Present,
        }
    });

    // Validate.
    let code = ctx.code_check(chain).await;
    let verdict = validate::verdict(&name, &chain.spec, &ns, &code, |cap| {
        ctx.capability_state(&ns, cap)
    });

    // Build.
    let template = build::template_hash(chain, &ctx.settings);
    let pod = build::pod(chain, &ctx.settings);
    let policy = build::network_policy(chain);

    // Decide.
    let now = Timestamp::now();
    let failures = lock(&ctx.start_failures)
        .get(&key)
        .filter(|f| f.template == template)
        .cloned()
        .unwrap_or_default();
    let plan = pool::plan(&pool::Input {
        warm: chain.spec.pool.warm,
        max: chain.spec.pool.max,
        template: &template,
        pods: &observed,
        pending_creates: pending.creates,
        pending_deletes: &pending.deletes,
        now,
        claim_deadline: SignedDuration::try_from(ctx.claim_deadline)
            .unwrap_or(SignedDuration::from_secs(300)),
        start_deadline: SignedDuration::try_from(ctx.start_deadline)
            .unwrap_or(SignedDuration::from_secs(120)),
        start_failures: failures.count,
        last_start_failure: (!failures.last.is_empty()).then_some(failures.last.as_str()),
        may_grow: !verdict.is_invalid(),
    });
    tracing::debug!(chain = %key, ?plan, "pool plan");

    // Apply.
    if plan.template_proven {
        lock(&ctx.start_failures).remove(&key);
    }
    if name_valid {
        apply_network_policy(chain, &policy, ctx).await?;
    }
    let reference = chain.object_ref(&());
    let previous: &[Condition] = chain
        .status
        .as_ref()
        .map(|s| s.conditions.as_slice())
        .unwrap_or_default();
    announce_verdict(ctx, &reference, previous, &verdict).await;
    delete_pods(chain, &ns, &key, &plan, &pods, &template, ctx).await?;
    let created = create_pods(chain, &ns, &key, &plan, &pod, &template, ctx).await?;
    announce_hold(ctx, &reference, previous, &plan).await;
    // The status tells what exists now, the pods just created included.
    let mut plan = plan;
    plan.counts.starting += created;
    plan.counts.total += created;

    // Status.
    let status = status::status(chain, &verdict, &plan, now);
    if chain.status.as_ref() != Some(&status) {
        let api: Api<HookChain> = Api::namespaced(ctx.client.clone(), &ns);
        let patch = serde_json::json!({
            "apiVersion": "sluice.dev/v1alpha1",
            "kind": "HookChain",
            "status": status,
        });
        api.patch_status(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map_err(|source| Error::Status {
            chain: key.clone(),
            source,
        })?;
    }
    ctx.metrics
        .set_pool(&ns, &name, plan.counts.warm, plan.counts.claimed);

    // Pod events requeue the chain; the timers cover what no event announces.
    let mut next = RESYNC;
    if pending.creates > 0 || !pending.deletes.is_empty() {
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

async fn apply_network_policy(
    chain: &HookChain,
    policy: &NetworkPolicy,
    ctx: &Context,
) -> Result<(), Error> {
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
    .map_err(|source| Error::NetworkPolicy {
        chain: format!("{ns}/{}", chain.name_any()),
        policy: name.clone(),
        source,
    })?;
    lock(&ctx.netpol_applied).insert(uid, Instant::now());
    Ok(())
}

async fn delete_pods(
    chain: &HookChain,
    ns: &str,
    key: &str,
    plan: &Plan,
    pods: &[Arc<Pod>],
    template: &str,
    ctx: &Context,
) -> Result<(), Error> {
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
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
                return Err(Error::DeletePod {
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
            DeleteReason::ScaleDown => {}
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

#[allow(clippy::too_many_arguments)]
async fn create_pods(
    chain: &HookChain,
    ns: &str,
    key: &str,
    plan: &Plan,
    pod: &Pod,
    template: &str,
    ctx: &Context,
) -> Result<u32, Error> {
    if plan.create == 0 {
        return Ok(0);
    }
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
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
        return Err(Error::CreatePod {
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
    reference: &k8s_openapi::api::core::v1::ObjectReference,
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
    reference: &k8s_openapi::api::core::v1::ObjectReference,
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

/// Validates a Capability as it arrives and records a Warning Event on it when it is unusable.
pub async fn check_capability(ctx: &Context, cap: &DeserializeGuard<Capability>) {
    let name = cap.name_any();
    let problems = match &cap.0 {
        Ok(c) => validate::capability_problems(&name, &c.spec),
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
