//! The trusted engine: one trigger point end to end. Resolve the chain → claim a fresh sandbox → init →
//! walk (host_calls answered by the capability runner) → re-validate every result (`outcome.rs`) →
//! state vector → failure policy → audit → destroy the sandbox. Plain Rust: no gRPC, no cluster.

use crate::audit::{Audit, AuditEvent, AuditHook, AuditHostCall, now_rfc3339};
use crate::chain::{Chain, ChainKey};
use crate::limits::Limits;
use crate::metrics::Metrics;
use crate::outcome::{self, Walk};
use crate::pipeline::{BASELINE_PREFIX, Chains, Pipeline};
use crate::pool::{Claimed, Pools};
use crate::registry::Registry;
use crate::runner::{Caller, Runner};
use crate::state_vector::StateVector;
use crate::supervisor::{HostCalls, SandboxFailure};
use arc_swap::ArcSwap;
use serde_json::{Value, json};
use sluice_crds::TriggerPoint;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Instrument;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Unavailable(String),
}

/// One request to run a payload through a trigger point, as the transport hands it over.
#[derive(Clone, Debug, Default)]
pub struct RunInput {
    pub namespace: String,
    pub target: String,
    pub trigger_point: String,
    pub payload: Option<Value>,
    pub context: BTreeMap<String, String>,
    pub session_id: String,
}

/// Where a run goes: validated identity of the chain and the caller.
#[derive(Clone, Debug)]
pub struct Target {
    pub key: ChainKey,
    pub context: BTreeMap<String, String>,
    pub session_id: String,
}

#[derive(Debug)]
pub struct RunResult {
    pub run_id: String,
    pub walk: Walk,
}

pub struct Engine {
    registry: ArcSwap<Registry>,
    pub pools: Pools,
    pub audit: Audit,
    pub metrics: Metrics,
    pub limits: Limits,
    pub runner: Runner,
    /// Flips to true when the gateway starts shutting down: open streams end with UNAVAILABLE.
    stopping: tokio::sync::watch::Sender<bool>,
}

fn invalid(msg: impl Into<String>) -> EngineError {
    EngineError::InvalidArgument(msg.into())
}

impl Engine {
    pub fn new(pools: Pools, audit: Audit, metrics: Metrics, limits: Limits) -> Self {
        let runner = Runner::new(metrics.clone(), limits.clone());
        Self {
            registry: ArcSwap::from_pointee(Registry::default()),
            pools,
            audit,
            metrics,
            limits,
            runner,
            stopping: tokio::sync::watch::channel(false).0,
        }
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

    /// Swaps in a new registry; pools follow. Runs in flight keep the chain they started with.
    pub async fn set_registry(&self, registry: Registry) {
        let registry = Arc::new(registry);
        self.registry.store(registry.clone());
        self.pools.sync(registry.all_chains()).await;
    }

    /// Checks what a caller sent: names, trigger point, context size.
    pub fn target(
        &self,
        namespace: &str,
        target: &str,
        trigger_point: &str,
        context: BTreeMap<String, String>,
        session_id: String,
    ) -> Result<Target, EngineError> {
        if namespace.is_empty() || namespace.len() > 253 {
            return Err(invalid("namespace must be 1-253 characters"));
        }
        if target.is_empty() || target.len() > 253 {
            return Err(invalid("target must be 1-253 characters"));
        }
        let Some(tp) = TriggerPoint::parse(trigger_point) else {
            let all: Vec<&str> = TriggerPoint::ALL.iter().map(|t| t.as_str()).collect();
            return Err(invalid(format!(
                "trigger_point {trigger_point:?} is not one of {}",
                all.join(", ")
            )));
        };
        if context.len() > self.limits.context_entries {
            return Err(invalid(format!(
                "context has {} entries, over the limit of {}",
                context.len(),
                self.limits.context_entries
            )));
        }
        let context_bytes: usize = context.iter().map(|(k, v)| k.len() + v.len()).sum();
        if context_bytes > 64 * 1024 {
            return Err(invalid(format!(
                "context is {context_bytes} bytes, over the limit of 65536"
            )));
        }
        if session_id.len() > 256 {
            return Err(invalid("session_id is over 256 characters"));
        }
        Ok(Target {
            key: ChainKey {
                namespace: namespace.into(),
                target: target.into(),
                trigger_point: tp,
            },
            context,
            session_id,
        })
    }

    /// Checks a payload against its trigger point: text for input/output, an object otherwise.
    pub fn check_payload(
        &self,
        tp: TriggerPoint,
        payload: &Option<Value>,
    ) -> Result<Value, EngineError> {
        let Some(p) = payload else {
            return Err(invalid(format!(
                "{tp} needs a payload ({})",
                if tp.carries_text() { "text" } else { "value" }
            )));
        };
        if tp.carries_text() && !p.is_string() {
            return Err(invalid(format!(
                "{tp} carries text: send the payload as text"
            )));
        }
        if !tp.carries_text() && !p.is_object() {
            return Err(invalid(format!(
                "{tp} carries a structured payload: send an object as value"
            )));
        }
        let size = serde_json::to_vec(p).map(|b| b.len()).unwrap_or(usize::MAX);
        if size > self.limits.payload_bytes {
            return Err(invalid(format!(
                "payload is {size} bytes, over the limit of {}",
                self.limits.payload_bytes
            )));
        }
        Ok(p.clone())
    }

    /// Runs one payload through one trigger point.
    pub async fn run(&self, input: RunInput) -> Result<RunResult, EngineError> {
        let began = Instant::now();
        let run_id = ulid::Ulid::new().to_string();
        let span = tracing::info_span!("run", run_id = %run_id, namespace = %input.namespace, target = %input.target, trigger_point = %input.trigger_point);
        async {
            let mut audit = AuditEvent {
                ts: now_rfc3339(),
                run_id: run_id.clone(),
                mode: "run",
                namespace: input.namespace.clone(),
                target: input.target.clone(),
                trigger_point: input.trigger_point.clone(),
                chain: None,
                code_hash: None,
                session_id: (!input.session_id.is_empty()).then(|| input.session_id.clone()),
                sandbox: None,
                baseline: None,
                hooks: vec![],
                host_calls: vec![],
                action: "pass",
                terminal_index: None,
                latency_us: 0,
                error: None,
                stream: None,
            };
            let prepared = (|| {
                let target = self.target(
                    &input.namespace,
                    &input.target,
                    &input.trigger_point,
                    input.context.clone(),
                    input.session_id.clone(),
                )?;
                let payload = self.check_payload(target.key.trigger_point, &input.payload)?;
                let chains = self.resolve_chains(&target.key)?;
                Ok::<_, EngineError>((target, payload, chains))
            })();
            let (target, payload, chains) = match prepared {
                Ok(p) => p,
                Err(e) => return Err(self.refuse(&mut audit, e, began)),
            };
            chains.describe(&mut audit);
            let mut pipeline = match Pipeline::open(self, &chains, &target, &run_id).await {
                Ok(p) => p,
                Err(e) => return Err(self.refuse(&mut audit, e, began)),
            };
            pipeline.record_sandboxes(&mut audit);
            let mut states = chains.fresh_states();
            let walk = pipeline.walk(payload, &mut states).await;
            audit.host_calls = pipeline.host_calls();
            drop(pipeline);
            self.finish(&mut audit, &chains, &walk, began, "run");
            Ok(RunResult {
                run_id: run_id.clone(),
                walk,
            })
        }
        .instrument(span)
        .await
    }

    /// Records a refused request (audit, metrics) and hands the error back.
    pub fn refuse(&self, audit: &mut AuditEvent, e: EngineError, began: Instant) -> EngineError {
        let code = match &e {
            EngineError::InvalidArgument(_) => "invalid_argument",
            EngineError::NotFound(_) => "not_found",
            EngineError::Unavailable(_) => "unavailable",
        };
        self.metrics.rejected.with_label_values(&[code]).inc();
        audit.error = Some(e.to_string());
        audit.action = "none";
        audit.latency_us = began.elapsed().as_micros() as u64;
        self.audit.write(audit);
        tracing::info!(error = %e, "run refused");
        e
    }

    /// Fills the audit event from a finished walk, writes it, and counts it.
    pub fn finish(
        &self,
        audit: &mut AuditEvent,
        chains: &Chains,
        walk: &Walk,
        began: Instant,
        mode: &'static str,
    ) {
        audit.hooks = walk
            .hooks
            .iter()
            .map(|h| AuditHook {
                name: h.name.clone(),
                action: h.action.as_str(),
                latency_us: h.latency_us,
                error: h.error.clone(),
                findings: h.findings.clone(),
            })
            .collect();
        // Hook errors count against the chain the hook belongs to.
        for (chain, baseline) in chains.ordered() {
            let errors = walk
                .hooks
                .iter()
                .filter(|h| h.error.is_some() && h.name.starts_with(BASELINE_PREFIX) == baseline)
                .count();
            if errors > 0 {
                self.metrics
                    .hook_errors
                    .with_label_values(&[&chain.qualified_name()])
                    .inc_by(errors as u64);
            }
        }
        audit.action = walk.action.as_str();
        audit.terminal_index = walk.terminal_index;
        audit.latency_us = began.elapsed().as_micros() as u64;
        self.audit.write(audit);
        let tp = chains.main().spec.trigger_point.as_str();
        self.metrics
            .runs
            .with_label_values(&[tp, mode, walk.action.as_str()])
            .inc();
        self.metrics
            .run_seconds
            .with_label_values(&[tp])
            .observe(began.elapsed().as_secs_f64());
    }
}

/// A chain bound to one claimed sandbox for one trigger point (a Run, or a whole Stream).
pub struct ChainSession<'e> {
    engine: &'e Engine,
    pub chain: Arc<Chain>,
    claimed: Option<Claimed>,
    context: Value,
    host: Arc<crate::runner::RunHostCalls>,
    pub sandbox_id: String,
    /// A failure while loading the hooks, reported by the next walk.
    pending: Option<SandboxFailure>,
}

impl<'e> ChainSession<'e> {
    /// Claims a sandbox and loads the chain into it. No sandbox in time → UNAVAILABLE.
    pub async fn open(
        engine: &'e Engine,
        chain: Arc<Chain>,
        target: &Target,
        run_id: &str,
    ) -> Result<Self, EngineError> {
        let caller = Caller::new(&target.key, &target.session_id, &target.context, run_id);
        let context = json!({
            "namespace": target.key.namespace,
            "target": target.key.target,
            "trigger_point": target.key.trigger_point.as_str(),
            "session_id": target.session_id,
            "run_id": run_id,
            "caller": target.context,
        });
        let registry = engine.registry();
        let host = Arc::new(engine.runner.for_run(registry, chain.clone(), caller));
        let mut session = Self {
            engine,
            chain,
            claimed: None,
            context,
            host,
            sandbox_id: String::new(),
            pending: None,
        };
        match session.claim().await {
            Ok(()) => Ok(session),
            Err(ClaimOrInit::Claim(e)) => Err(EngineError::Unavailable(e)),
            // The sandbox died or hung while loading the hooks: the walk reports it per policy.
            Err(ClaimOrInit::Init(f)) => {
                session.pending = Some(f);
                Ok(session)
            }
        }
    }

    async fn claim(&mut self) -> Result<(), ClaimOrInit> {
        let pool = self.engine.pools.pool_for(&self.chain);
        let mut claimed = pool
            .claim(self.engine.limits.claim_timeout)
            .await
            .map_err(|e| ClaimOrInit::Claim(e.to_string()))?;
        self.sandbox_id = claimed.conn().id.clone();
        let init = claimed
            .conn()
            .init(&self.chain, &self.engine.limits.wire())
            .await;
        self.claimed = Some(claimed);
        match init {
            Ok(_) => Ok(()),
            Err(f) => {
                self.claimed = None;
                Err(ClaimOrInit::Init(f))
            }
        }
    }

    /// Runs the chain on `payload`, threading `state`. Sandbox failures become hook errors under the
    /// chain's policy; under `Open` the walk resumes after the failed hook in a fresh sandbox.
    pub async fn walk(&mut self, payload: Value, state: &mut StateVector) -> Walk {
        let mut walk = Walk::new(payload);
        let mut start = 0;
        let budget = Duration::from_millis(self.chain.spec.timeout_ms as u64);
        let host: Arc<dyn HostCalls> = self.host.clone();
        loop {
            if self.claimed.is_none() {
                let failure = match self.pending.take() {
                    Some(f) => Some(f),
                    None => match self.claim().await {
                        Ok(()) => None,
                        Err(ClaimOrInit::Claim(e)) => {
                            Some(SandboxFailure::Died(format!("no replacement sandbox: {e}")))
                        }
                        Err(ClaimOrInit::Init(f)) => Some(f),
                    },
                };
                if let Some(f) = failure {
                    outcome::failure_before_walk(&self.chain, &f, &mut walk, start);
                    match walk.resume_at.take() {
                        Some(next) => {
                            start = next;
                            continue;
                        }
                        None => return walk,
                    }
                }
            }
            let Some(claimed) = self.claimed.as_mut() else {
                return walk;
            };
            let conn = claimed.conn();
            let report = conn
                .walk(
                    start,
                    &walk.payload,
                    state.as_slice(),
                    &self.context,
                    budget,
                    host.as_ref(),
                )
                .await;
            outcome::fold(
                &self.chain,
                start,
                &report,
                &mut walk,
                state,
                &self.engine.limits,
            );
            if !conn.healthy() || report.failure.is_some() {
                // Dropping the claim destroys the sandbox (killed at once when broken).
                self.claimed = None;
            }
            match walk.resume_at.take() {
                Some(next) => start = next,
                None => return walk,
            }
        }
    }

    /// The host_calls made so far, for the audit.
    pub fn host_calls(&self) -> Vec<AuditHostCall> {
        self.host.audit()
    }
}

enum ClaimOrInit {
    Claim(String),
    Init(SandboxFailure),
}
