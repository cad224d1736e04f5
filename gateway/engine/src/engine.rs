//! The engine: what every trigger point shares (registry, sandbox pools, capabilities, audit,
//! metrics, limits), and the bookkeeping that opens and closes a run (refusal, audit, metrics). The
//! runs themselves are `run.rs` (one payload) and `stream.rs` (an agent reply on two paths). Plain
//! Rust: no gRPC, no cluster.

use crate::audit::{Audit, AuditEvent, AuditHook};
use crate::chains::Chains;
use crate::coverage::{Coverage, HookCoverage};
use crate::host_calls::Capabilities;
use crate::limits::Limits;
use crate::log_text::Escaped;
use crate::metrics::{ChainLabels, Metrics};
use crate::outcome::Walk;
use crate::pipeline::Pipeline;
use crate::pool::Pools;
use crate::registry::Registry;
use crate::request::{EngineError, Target};
use crate::rollout::{RolloutStatus, Rollouts, Selection};
use arc_swap::ArcSwap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
use tracing::Instrument;

/// At most one audit event of a NOT_FOUND request is written per this interval; it says how many
/// were left out before it (a caller probing made-up targets cannot flood the audit).
const NOT_FOUND_AUDIT_EVERY: Duration = Duration::from_secs(10);

pub struct Engine {
    registry: ArcSwap<Registry>,
    pools: Pools,
    audit: Audit,
    metrics: Metrics,
    limits: Limits,
    capabilities: Arc<dyn Capabilities>,
    /// Flips to true when the gateway starts shutting down: open streams end with UNAVAILABLE.
    stopping: tokio::sync::watch::Sender<bool>,
    not_found: Mutex<NotFoundSample>,
    rollouts: Rollouts,
    /// The engine itself, for the work a run leaves behind it (shadow runs).
    me: Weak<Engine>,
    /// The lines each hook ran, once an authoring tool asks for them (`record_coverage`).
    coverage: std::sync::OnceLock<Coverage>,
}

/// When the last NOT_FOUND audit event was written, and how many were left out since.
#[derive(Default)]
struct NotFoundSample {
    last_written: Option<Instant>,
    unwritten: u64,
}

impl Engine {
    /// An engine with an empty registry; `set_registry` gives it chains.
    pub fn new(
        pools: Pools,
        audit: Audit,
        metrics: Metrics,
        limits: Limits,
        capabilities: Arc<dyn Capabilities>,
    ) -> Arc<Self> {
        Arc::new_cyclic(|me| Self {
            registry: ArcSwap::from_pointee(Registry::default()),
            pools,
            audit,
            rollouts: Rollouts::new(metrics.clone()),
            metrics,
            limits,
            capabilities,
            stopping: tokio::sync::watch::channel(false).0,
            not_found: Mutex::default(),
            coverage: std::sync::OnceLock::new(),
            me: me.clone(),
        })
    }

    pub fn pools(&self) -> &Pools {
        &self.pools
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    pub(crate) fn audit(&self) -> &Audit {
        &self.audit
    }

    /// Waits (at most `within`, blocking) until every audit line waiting is written; whether it
    /// was. For the gateway's exit: lines still queued then would be lost.
    pub fn drain_audit(&self, within: Duration) -> bool {
        self.audit.drain(within)
    }

    /// A new run is refused while its audit line could not be written soon (`Audit::backlog`):
    /// the client tries another replica, and no served run goes unaudited.
    pub(crate) fn audit_admits(&self) -> Result<(), EngineError> {
        match self.audit.backlog() {
            None => Ok(()),
            Some(waiting) => Err(EngineError::Unavailable(format!(
                "the audit log is not being written ({waiting} lines wait for the gateway's output to be read): runs are refused until it is"
            ))),
        }
    }

    pub(crate) fn capabilities(&self) -> &dyn Capabilities {
        self.capabilities.as_ref()
    }

    /// Tells open streams to end: called when the gateway begins a graceful shutdown.
    pub fn begin_shutdown(&self) {
        self.stopping.send_replace(true);
    }

    /// Resolves once a shutdown has begun.
    pub async fn stopping(&self) {
        let mut rx = self.stopping.subscribe();
        let _ = rx.wait_for(|s| *s).await;
    }

    pub fn registry(&self) -> Arc<Registry> {
        self.registry.load_full()
    }

    /// From now on, keeps which lines of each hook's code the runs ran, as sandboxes under
    /// `--trace-lines` report them (`sluice test --coverage`). A gateway that serves never does.
    pub fn record_coverage(&self) {
        let _ = self.coverage.set(Coverage::default());
    }

    /// Each hook written as code in the served chains, with the lines its runs ran so far; None
    /// unless `record_coverage` was called.
    pub fn coverage(&self) -> Option<Vec<HookCoverage>> {
        let coverage = self.coverage.get()?;
        let registry = self.registry();
        Some(coverage.report(registry.all_chains().map(|c| c.as_ref())))
    }

    /// Swaps in a new registry; pools follow. Runs in flight keep the chain they started with.
    pub async fn set_registry(&self, registry: Registry) {
        let registry = Arc::new(registry);
        self.metrics
            .definitions_invalid
            .set(registry.errors().len() as i64);
        self.metrics
            .chains_superseded
            .set(registry.superseded() as i64);
        self.registry.store(registry.clone());
        let live = self.rollouts.follow(registry.all_chains());
        let candidates = self.rollouts.candidates();
        self.pools.sync(&live, &candidates).await;
    }

    /// Keeps rollout state in `path` across restarts (local mode: the state directory), and picks up
    /// what an earlier gateway left there. Call before the first `set_registry`.
    pub fn keep_rollouts_in(&self, path: std::path::PathBuf) {
        self.rollouts.keep_in(path);
    }

    /// Where this gateway reports a canary it rolled back on its own (in a cluster: the chain's
    /// `sluice.dev/rollback` annotation, which the operator and every other gateway follow).
    pub fn report_rollbacks_to(&self, sink: Arc<dyn crate::rollout::RolloutSink>) {
        self.rollouts.report_to(sink);
    }

    /// Every chain's rollout: live revision, candidate, phase, comparisons, history.
    pub fn rollouts(&self) -> Vec<RolloutStatus> {
        self.rollouts.status()
    }

    /// The versions that serve one trigger point (`rollout/`); a candidate promoted on the way has
    /// its pool open cells for it from now on. A canary places a run by its session, or, for a run
    /// without one, by the run's own id (each such run on its own).
    pub(crate) fn select(&self, chains: &Chains, session: &str, run_id: &str) -> Selection {
        let placed_by = if session.is_empty() { run_id } else { session };
        let mut promoted = Vec::new();
        let selection = self.rollouts.select(chains, placed_by, &mut promoted);
        for chain in &promoted {
            self.pools.pool_for(chain);
        }
        selection
    }

    /// What a run of (namespace, target, trigger point) for `session` would be served by now: the
    /// revisions of the baseline and the tenant's chain (as a rollout places the session), in one
    /// string. Two equal answers mean the same hooks would walk a payload. `None` when no chain
    /// serves there, or when it cannot be known ahead of the run (a canary without a session).
    /// Judges and counts nothing: for callers that remember what a chain already decided.
    pub fn serving_revision(
        &self,
        namespace: &str,
        target: &str,
        trigger_point: sluice_crds::TriggerPoint,
        session: &str,
    ) -> Option<String> {
        let key = crate::chain::ChainKey {
            namespace: namespace.to_string(),
            target: target.to_string(),
            trigger_point,
        };
        let chains = Chains::resolve(&self.registry(), &key).ok()?;
        let mut revision = String::new();
        for (chain, baseline) in chains.ordered() {
            let serving = self.rollouts.serving_revision(chain, session)?;
            revision.push_str(if baseline { "baseline:" } else { "tenant:" });
            revision.push_str(&chain.qualified_name());
            revision.push('@');
            revision.push_str(&serving);
            revision.push_str(match chain.spec.failure_policy {
                sluice_crds::FailurePolicy::Open => "/open;",
                sluice_crds::FailurePolicy::Closed => "/closed;",
            });
        }
        Some(revision)
    }

    /// Counts a finished run against the canaries that served it (which may promote one).
    pub(crate) fn record_rollout(&self, selection: &Selection, walk: &Walk) {
        let mut promoted = Vec::new();
        self.rollouts.record(&selection.served, walk, &mut promoted);
        for chain in &promoted {
            self.pools.pool_for(chain);
        }
    }

    /// Starts the selection's shadow runs on `payload` (what the live run walked), each in the
    /// background with its own permit: the live answer is never held for them. Each is compared
    /// with `live` and audited as its own event (mode `shadow`, the live run's id).
    pub(crate) fn start_shadows(
        &self,
        selection: Selection,
        target: &Target,
        payload: &serde_json::Value,
        live: &Walk,
        run_id: crate::run_id::RunId,
    ) {
        let Some(engine) = self.me.upgrade() else {
            return;
        };
        for job in selection.shadows {
            let (engine, target, payload, live, run_id) = (
                engine.clone(),
                target.clone(),
                payload.clone(),
                live.clone(),
                run_id,
            );
            let span = tracing::info_span!("shadow", run_id = %run_id, chain = %Escaped(&job.candidate.qualified_name()));
            tokio::spawn(
                async move {
                    let began = Instant::now();
                    let mut audit = AuditEvent::new(&run_id.to_string(), "shadow");
                    audit.requested(
                        &target.key.namespace,
                        &target.key.target,
                        target.key.trigger_point.as_str(),
                        &target.session_id,
                    );
                    job.chains.describe(&mut audit);
                    let mut pipeline =
                        match Pipeline::open(&engine, &job.chains, &target, run_id, true).await {
                            Ok(p) => p,
                            Err(e) => {
                                tracing::debug!(error = %e, "shadow run dropped");
                                engine.rollouts.shadow_dropped(&job.candidate);
                                return;
                            }
                        };
                    pipeline.record_sandboxes(&mut audit);
                    let mut states = job.chains.fresh_states();
                    let walk = pipeline.walk(payload, &mut states).await;
                    let refused = pipeline.shadow_refused();
                    pipeline.record_host_calls(&mut audit, engine.limits().audit_host_calls);
                    drop(pipeline);
                    let verdict =
                        engine
                            .rollouts
                            .record_shadow(&job.candidate, &live, &walk, refused);
                    audit.hooks = audit_hooks(&job.chains, &walk);
                    audit.action = walk.action.as_str();
                    audit.terminal_index = walk.terminal_index;
                    audit.message = (!walk.message.is_empty()).then(|| walk.message.clone());
                    audit.latency_us = began.elapsed().as_micros() as u64;
                    audit.shadow_verdict = Some(verdict);
                    engine.audit.write(&audit);
                }
                .instrument(span),
            );
        }
    }

    /// Records a refused request (audit, metrics) and hands the error back. `chains`: the chains
    /// it was for, when it got that far (else it counts under `_unknown`).
    pub(crate) fn refuse(
        &self,
        audit: &mut AuditEvent,
        e: EngineError,
        began: Instant,
        chains: Option<&Chains>,
    ) -> EngineError {
        self.metrics.rejected.with_label_values(&[e.code()]).inc();
        let labels = chains.map_or_else(ChainLabels::unknown, |c| ChainLabels::of(c.main()));
        self.metrics
            .requests
            .with_label_values(&labels.with(&[e.code()]))
            .inc();
        tracing::Span::current().record("code", e.code());
        audit.error = Some(e.to_string());
        audit.action = "none";
        audit.latency_us = began.elapsed().as_micros() as u64;
        let written = if matches!(e, EngineError::NotFound(_)) {
            let mut sample = self.not_found.lock().unwrap_or_else(|p| p.into_inner());
            let now = Instant::now();
            if sample
                .last_written
                .is_some_and(|t| now.duration_since(t) < NOT_FOUND_AUDIT_EVERY)
            {
                sample.unwritten += 1;
                self.metrics.audit_sampled_out.inc();
                false
            } else {
                audit.not_found_unwritten = Some(std::mem::take(&mut sample.unwritten));
                sample.last_written = Some(now);
                true
            }
        } else {
            true
        };
        // Refusals quote what the caller sent. NOT_FOUND left out of the audit stays out of the info
        // log as well.
        if written {
            self.audit.write(audit);
            tracing::info!(error = %Escaped(&e.to_string()), "run refused");
        } else {
            tracing::debug!(error = %Escaped(&e.to_string()), "run refused (audit sampled)");
        }
        e
    }

    /// Fills the audit event from a finished walk, writes it, and counts it.
    pub(crate) fn finish(
        &self,
        audit: &mut AuditEvent,
        chains: &Chains,
        walk: &Walk,
        began: Instant,
        mode: &'static str,
    ) {
        audit.hooks = audit_hooks(chains, walk);
        self.count_hooks(chains, walk);
        if let Some(coverage) = self.coverage.get() {
            coverage.record(chains, walk);
        }
        audit.action = walk.action.as_str();
        audit.terminal_index = walk.terminal_index;
        audit.latency_us = began.elapsed().as_micros() as u64;
        audit.message = (!walk.message.is_empty()).then(|| walk.message.clone());
        let ended_by_failure = walk
            .terminal_index
            .is_some_and(|t| walk.hooks.iter().any(|h| h.index == t && h.error.is_some()));
        let first_error = walk.hooks.iter().find(|h| h.error.is_some());
        if ended_by_failure {
            // The walk's message is the failure, as the caller got it.
            audit.policy_outcome = Some("blocked");
            audit.failure_reason = Some(walk.message.clone());
        } else if let Some(h) = first_error {
            audit.policy_outcome = Some("passed_over");
            audit.failure_reason = Some(format!(
                "hook {:?} failed: {}",
                h.shown_name(),
                h.error.as_deref().unwrap_or_default()
            ));
        }
        self.audit.write(audit);
        let labels = ChainLabels::of(chains.main());
        self.metrics
            .runs
            .with_label_values(&labels.with(&[mode, walk.action.as_str()]))
            .inc();
        self.metrics
            .requests
            .with_label_values(&labels.with(&["ok"]))
            .inc();
        self.metrics
            .run_seconds
            .with_label_values(&labels.with(&[]))
            .observe(began.elapsed().as_secs_f64());
        let span = tracing::Span::current();
        span.record("action", walk.action.as_str());
        span.record("code", "ok");
    }

    /// Counts what each hook of a walk did (its action, or `error`), how long it took, and its
    /// errors, against the chain it belongs to, by the hook's own name.
    pub(crate) fn count_hooks(&self, chains: &Chains, walk: &Walk) {
        for h in &walk.hooks {
            let name = h.name.as_str();
            let baseline = h.layer.is_baseline();
            let Some((chain, _)) = chains.ordered().find(|(_, b)| *b == baseline) else {
                continue;
            };
            let labels = ChainLabels::of(chain);
            let qualified = chain.qualified_name();
            let hook = [
                qualified.as_str(),
                &labels.namespace,
                &labels.target,
                &labels.trigger_point,
                name,
            ];
            let action = if h.error.is_some() {
                "error"
            } else {
                h.action.as_str()
            };
            let mut with_action = hook.to_vec();
            with_action.push(action);
            self.metrics
                .hook_actions
                .with_label_values(&with_action)
                .inc();
            self.metrics
                .hook_seconds
                .with_label_values(&hook)
                .observe(h.latency_us as f64 / 1e6);
            if h.error.is_some() {
                self.metrics.hook_errors.with_label_values(&hook).inc();
            }
        }
    }
}

/// A walk's hooks as the audit lists them, each with who signed its code where that is required.
fn audit_hooks(chains: &Chains, walk: &Walk) -> Vec<AuditHook> {
    walk.hooks
        .iter()
        .map(|h| {
            let baseline = h.layer.is_baseline();
            let signed_by = chains
                .ordered()
                .find(|(_, b)| *b == baseline)
                .and_then(|(chain, _)| {
                    let index = chain.spec.hooks.iter().position(|s| s.name == h.name)?;
                    chain.signer(index)
                })
                .map(|by| by.to_string());
            AuditHook {
                name: h.shown_name(),
                action: h.action.as_str(),
                latency_us: h.latency_us,
                error: h.error.clone(),
                findings: h.findings.clone(),
                signed_by,
            }
        })
        .collect()
}
