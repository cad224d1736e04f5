//! The engine: what every trigger point shares (registry, sandbox pools, capabilities, audit,
//! metrics, limits), and the bookkeeping that opens and closes a run (refusal, audit, metrics). The
//! runs themselves are `run.rs` (one payload) and `stream.rs` (an agent reply on two paths). Plain
//! Rust: no gRPC, no cluster.

use crate::audit::{Audit, AuditEvent, AuditHook};
use crate::chains::{BASELINE_PREFIX, Chains};
use crate::host_calls::Capabilities;
use crate::limits::Limits;
use crate::log_text::Escaped;
use crate::metrics::Metrics;
use crate::outcome::Walk;
use crate::registry::Registry;
use crate::request::EngineError;
use crate::sandbox_pool::Pools;
use arc_swap::ArcSwap;
use std::sync::Arc;
use std::time::Instant;

pub struct Engine {
    registry: ArcSwap<Registry>,
    pools: Pools,
    audit: Audit,
    metrics: Metrics,
    limits: Limits,
    capabilities: Arc<dyn Capabilities>,
    /// Flips to true when the gateway starts shutting down: open streams end with UNAVAILABLE.
    stopping: tokio::sync::watch::Sender<bool>,
}

impl Engine {
    /// An engine with an empty registry; `set_registry` gives it chains.
    pub fn new(
        pools: Pools,
        audit: Audit,
        metrics: Metrics,
        limits: Limits,
        capabilities: Arc<dyn Capabilities>,
    ) -> Self {
        Self {
            registry: ArcSwap::from_pointee(Registry::default()),
            pools,
            audit,
            metrics,
            limits,
            capabilities,
            stopping: tokio::sync::watch::channel(false).0,
        }
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
        self.pools.sync(registry.all_chains()).await;
    }

    /// Records a refused request (audit, metrics) and hands the error back.
    pub(crate) fn refuse(
        &self,
        audit: &mut AuditEvent,
        e: EngineError,
        began: Instant,
    ) -> EngineError {
        self.metrics.rejected.with_label_values(&[e.code()]).inc();
        audit.error = Some(e.to_string());
        audit.action = "none";
        audit.latency_us = began.elapsed().as_micros() as u64;
        self.audit.write(audit);
        // Refusals quote what the caller sent.
        tracing::info!(error = %Escaped(&e.to_string()), "run refused");
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
