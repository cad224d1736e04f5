//! Prometheus metrics of the operator (`sluice_operator_<what>_<unit>`) and the small HTTP server
//! that serves them on `/metrics`, with `/healthz` for the liveness probe.

use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};
use std::net::SocketAddr;

#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    pub reconciles: IntCounter,
    /// Failed reconciles by the stage that failed (`Error::stage`).
    pub reconcile_errors: IntCounterVec,
    pub pool_warm: IntGaugeVec,
    pub pool_claimed: IntGaugeVec,
    pub pods_created: IntCounter,
    pub pods_deleted: IntCounterVec,
    pub leader: IntGauge,
    pub webhook_reviews: IntCounterVec,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Adds `sluice_operator_build_info` and the process metrics (`sluice_operator_process_*`: CPU,
/// memory, open descriptors, start time).
fn with_process_and_build_info(registry: Registry) -> Registry {
    let build_info = IntGaugeVec::new(
        Opts::new(
            "sluice_operator_build_info",
            "Always 1; the operator's version in a label",
        ),
        &["version"],
    )
    .expect("valid metric");
    build_info
        .with_label_values(&[env!("CARGO_PKG_VERSION")])
        .set(1);
    registry
        .register(Box::new(build_info))
        .expect("distinct metric names");
    #[cfg(target_os = "linux")]
    registry
        .register(Box::new(
            prometheus::process_collector::ProcessCollector::new(
                std::process::id() as i32,
                "sluice_operator",
            ),
        ))
        .expect("distinct metric names");
    registry
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        // Registering fixed, distinct names in a fresh registry cannot fail.
        fn reg<C: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: C) -> C {
            r.register(Box::new(c.clone()))
                .expect("distinct metric names");
            c
        }
        let chain = ["namespace", "chain"];
        Self {
            reconciles: reg(
                &registry,
                IntCounter::new("sluice_operator_reconciles_total", "HookChain reconciles run")
                    .expect("valid metric"),
            ),
            reconcile_errors: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "sluice_operator_reconcile_errors_total",
                        "HookChain reconciles that failed and were retried, by the stage that failed",
                    ),
                    &["stage"],
                )
                .expect("valid metric"),
            ),
            pool_warm: reg(
                &registry,
                IntGaugeVec::new(
                    Opts::new("sluice_operator_pool_warm_pods", "Ready warm sandbox pods per chain"),
                    &chain,
                )
                .expect("valid metric"),
            ),
            pool_claimed: reg(
                &registry,
                IntGaugeVec::new(
                    Opts::new("sluice_operator_pool_claimed_pods", "Claimed sandbox pods per chain"),
                    &chain,
                )
                .expect("valid metric"),
            ),
            pods_created: reg(
                &registry,
                IntCounter::new("sluice_operator_pods_created_total", "Sandbox pods created")
                    .expect("valid metric"),
            ),
            pods_deleted: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "sluice_operator_pods_deleted_total",
                        "Sandbox pods deleted, by reason (finished, claim_expired, outdated, scale_down, start_timeout, chain_deleted)",
                    ),
                    &["reason"],
                )
                .expect("valid metric"),
            ),
            leader: reg(
                &registry,
                IntGauge::new(
                    "sluice_operator_leader",
                    "1 while this replica holds the leader lease",
                )
                .expect("valid metric"),
            ),
            webhook_reviews: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "sluice_operator_webhook_reviews_total",
                        "Admission reviews answered, by result (admitted, refused, malformed, failed)",
                    ),
                    &["result"],
                )
                .expect("valid metric"),
            ),
            registry: with_process_and_build_info(registry),
        }
    }

    pub fn set_pool(&self, namespace: &str, chain: &str, warm: u32, claimed: u32) {
        self.pool_warm
            .with_label_values(&[namespace, chain])
            .set(warm.into());
        self.pool_claimed
            .with_label_values(&[namespace, chain])
            .set(claimed.into());
    }

    pub fn forget_pool(&self, namespace: &str, chain: &str) {
        let _ = self.pool_warm.remove_label_values(&[namespace, chain]);
        let _ = self.pool_claimed.remove_label_values(&[namespace, chain]);
    }

    pub fn render(&self) -> String {
        sluice_telemetry::render(&self.registry)
    }

    /// Serves `GET /metrics` and `GET /healthz` on `addr` until the process ends.
    pub async fn serve(self, addr: SocketAddr) -> std::io::Result<()> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        tracing::info!(%addr, "metrics listening");
        self.serve_on(listener).await
    }

    pub async fn serve_on(self, listener: tokio::net::TcpListener) -> std::io::Result<()> {
        sluice_telemetry::serve_endpoint(listener, self.registry.clone(), None, Vec::new()).await
    }
}
