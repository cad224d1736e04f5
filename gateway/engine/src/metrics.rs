//! Prometheus metrics of the gateway (`sluice_gateway_<what>_<unit>`). The HTTP endpoint that serves
//! them is `sluice-telemetry`'s.

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

#[derive(Clone)]
pub struct Metrics {
    pub registry: Registry,
    pub runs: IntCounterVec,
    pub run_seconds: HistogramVec,
    pub hook_errors: IntCounterVec,
    pub sandboxes_started: IntCounter,
    pub sandbox_boot_failures: IntCounter,
    pub sandbox_boot_seconds: Histogram,
    pub sandbox_retirements: IntCounterVec,
    pub cells_prepared: IntCounter,
    pub claims: IntCounterVec,
    pub pool_warm: IntGaugeVec,
    pub host_calls: IntCounterVec,
    pub rejected: IntCounterVec,
    pub pod_claims: IntCounterVec,
    /// Definitions (files' documents, cluster objects) that fail their checks and are not served.
    pub definitions_invalid: IntGauge,
    /// Chains served from their last valid version because the newest fails its checks.
    pub chains_superseded: IntGauge,
    /// Answers `/readyz`: set once the registry is loaded and the pools are warm, cleared at shutdown.
    pub ready: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let buckets = vec![
            0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
        ];
        let runs = IntCounterVec::new(
            Opts::new(
                "sluice_gateway_runs_total",
                "Trigger points run, by trigger point, mode and top action",
            ),
            &["trigger_point", "mode", "action"],
        )
        .expect("valid metric");
        let run_seconds = HistogramVec::new(
            HistogramOpts::new(
                "sluice_gateway_run_duration_seconds",
                "Time from request to answer of one run",
            )
            .buckets(buckets.clone()),
            &["trigger_point"],
        )
        .expect("valid metric");
        let hook_errors = IntCounterVec::new(
            Opts::new(
                "sluice_gateway_hook_errors_total",
                "Hook errors (exceptions, timeouts, bad results), by chain",
            ),
            &["chain"],
        )
        .expect("valid metric");
        let sandboxes_started = IntCounter::new(
            "sluice_gateway_sandboxes_started_total",
            "Sandboxes booted to ready",
        )
        .expect("valid metric");
        let sandbox_boot_failures = IntCounter::new(
            "sluice_gateway_sandbox_boot_failures_total",
            "Sandboxes that failed to boot",
        )
        .expect("valid metric");
        let sandbox_boot_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "sluice_gateway_sandbox_boot_seconds",
                "Time from start to supervisor ready",
            )
            .buckets(buckets),
        )
        .expect("valid metric");
        let sandbox_retirements = IntCounterVec::new(
            Opts::new(
                "sluice_gateway_sandbox_retirements_total",
                "Sandboxes destroyed after serving, by reason: reuse_none, max_uses, dirty (the supervisor's verdict), broken (deadline kill, broken stream, protocol), idle (past the warm target and idle_retire), pool_closed",
            ),
            &["reason"],
        )
        .expect("valid metric");
        let cells_prepared = IntCounter::new(
            "sluice_gateway_cells_prepared_total",
            "Cells opened ahead of a claim (each hook of the trigger point in a fresh process)",
        )
        .expect("valid metric");
        let claims = IntCounterVec::new(
            Opts::new(
                "sluice_gateway_claims_total",
                "Sandbox claims: warm (one was waiting), cold (waited for a boot), timeout",
            ),
            &["result"],
        )
        .expect("valid metric");
        let pool_warm = IntGaugeVec::new(
            Opts::new(
                "sluice_gateway_pool_warm_sandboxes",
                "Warm sandboxes per chain",
            ),
            &["chain"],
        )
        .expect("valid metric");
        let host_calls = IntCounterVec::new(
            Opts::new(
                "sluice_gateway_host_calls_total",
                "host_calls by capability and result",
            ),
            &["capability", "result"],
        )
        .expect("valid metric");
        let rejected = IntCounterVec::new(
            Opts::new(
                "sluice_gateway_rejected_requests_total",
                "Requests refused before running, by gRPC code",
            ),
            &["code"],
        )
        .expect("valid metric");
        let pod_claims = IntCounterVec::new(
            Opts::new(
                "sluice_gateway_pod_claims_total",
                "kube backend claim attempts: claimed, conflict (another gateway won), none (no warm pod in time), error",
            ),
            &["result"],
        )
        .expect("valid metric");
        let definitions_invalid = IntGauge::new(
            "sluice_gateway_definitions_invalid",
            "Problems found in the newest HookChain and Capability definitions (not served; a chain with a last valid version keeps serving it)",
        )
        .expect("valid metric");
        let chains_superseded = IntGauge::new(
            "sluice_gateway_chains_superseded",
            "Chains served from their last valid version because the newest fails its checks",
        )
        .expect("valid metric");
        for c in [
            Box::new(pod_claims.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(definitions_invalid.clone()),
            Box::new(chains_superseded.clone()),
            Box::new(runs.clone()),
            Box::new(run_seconds.clone()),
            Box::new(hook_errors.clone()),
            Box::new(sandboxes_started.clone()),
            Box::new(sandbox_boot_failures.clone()),
            Box::new(sandbox_boot_seconds.clone()),
            Box::new(sandbox_retirements.clone()),
            Box::new(cells_prepared.clone()),
            Box::new(claims.clone()),
            Box::new(pool_warm.clone()),
            Box::new(host_calls.clone()),
            Box::new(rejected.clone()),
        ] {
            registry.register(c).expect("metric names are unique");
        }
        Self {
            registry,
            runs,
            run_seconds,
            hook_errors,
            sandboxes_started,
            sandbox_boot_failures,
            sandbox_boot_seconds,
            sandbox_retirements,
            cells_prepared,
            claims,
            pool_warm,
            host_calls,
            rejected,
            pod_claims,
            definitions_invalid,
            chains_superseded,
            ready: Default::default(),
        }
    }
}
