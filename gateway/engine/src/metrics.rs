//! Prometheus metrics of the gateway (`sluice_gateway_<what>_<unit>`), documented one by one in
//! `docs/operations.md`. The HTTP endpoint that serves them is `sluice-telemetry`'s.
//!
//! Per-chain series carry `namespace`, `target` and `trigger_point` of the chain that served (for a
//! target with no chain of its own that a platform baseline served: the baseline's, `target="*"`).
//! Requests for chains that do not exist are counted together under `_unknown`, so a caller that
//! makes up targets cannot make up series.

use crate::chain::Chain;
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{
    CounterVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry,
};
use std::sync::{Arc, Mutex};

/// The label value of requests that matched no chain.
pub(crate) const UNKNOWN: &str = "_unknown";

/// The labels of one chain in per-chain series: namespace, target, trigger point.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct ChainLabels {
    pub(crate) namespace: String,
    pub(crate) target: String,
    pub(crate) trigger_point: String,
}

impl ChainLabels {
    pub(crate) fn of(chain: &Chain) -> Self {
        Self {
            namespace: chain.namespace.clone(),
            target: chain.spec.target.clone(),
            trigger_point: chain.spec.trigger_point.as_str().to_string(),
        }
    }

    /// Requests that matched no chain (or could not be read far enough to say which).
    pub(crate) fn unknown() -> Self {
        Self {
            namespace: UNKNOWN.into(),
            target: UNKNOWN.into(),
            trigger_point: UNKNOWN.into(),
        }
    }

    /// The three chain labels followed by `extra`, in the order the vectors declare them.
    pub(crate) fn with<'a>(&'a self, extra: &[&'a str]) -> Vec<&'a str> {
        let mut v = vec![
            self.namespace.as_str(),
            self.target.as_str(),
            self.trigger_point.as_str(),
        ];
        v.extend_from_slice(extra);
        v
    }
}

const CHAIN: [&str; 3] = ["namespace", "target", "trigger_point"];

fn labels(extra: &[&'static str]) -> Vec<&'static str> {
    let mut v = CHAIN.to_vec();
    v.extend_from_slice(extra);
    v
}

/// Counts of sandboxes per chain and state, read from the pools at each scrape.
pub(crate) type SandboxStates = Vec<(ChainLabels, &'static str, i64)>;
type StatesSource = Arc<Mutex<Option<Box<dyn Fn() -> SandboxStates + Send + Sync>>>>;

#[derive(Clone)]
pub struct Metrics {
    pub registry: Registry,
    /// Runs that reached a verdict, per chain, mode and top action.
    pub runs: IntCounterVec,
    pub run_seconds: HistogramVec,
    /// Every request, per chain (unknown ones together) and gRPC code.
    pub requests: IntCounterVec,
    pub hook_errors: IntCounterVec,
    pub hook_actions: IntCounterVec,
    pub hook_seconds: HistogramVec,
    pub sandboxes_started: IntCounterVec,
    pub sandbox_boot_failures: IntCounterVec,
    pub sandbox_boot_seconds: HistogramVec,
    pub sandbox_retirements: IntCounterVec,
    pub cells_prepared: IntCounterVec,
    pub sandbox_cpu_throttled_periods: IntCounterVec,
    pub sandbox_cpu_throttled_seconds: CounterVec,
    pub claims: IntCounterVec,
    pub claim_wait_seconds: HistogramVec,
    pub pool_warm: IntGaugeVec,
    pub host_calls: IntCounterVec,
    pub rejected: IntCounterVec,
    /// Audit events of NOT_FOUND runs left out by sampling (`docs/operations.md`).
    pub audit_sampled_out: IntCounter,
    pub pod_claims: IntCounterVec,
    /// Runs of chains in a canary rollout, by version (live, candidate) and outcome.
    pub rollout_runs: IntCounterVec,
    /// Rollouts started, stepped up, promoted and rolled back.
    pub rollout_events: IntCounterVec,
    /// Shadow runs by verdict against the live answer.
    pub shadow_runs: IntCounterVec,
    pub shadow_hooks: IntCounterVec,
    pub shadow_hook_seconds: HistogramVec,
    pub shadow_host_calls_refused: IntCounterVec,
    /// Definitions (files' documents, cluster objects) that fail their checks and are not served.
    pub definitions_invalid: IntGauge,
    /// Chains served from their last valid version because the newest fails its checks.
    pub chains_superseded: IntGauge,
    /// Answers `/readyz`: set once the registry is loaded and the pools are warm, cleared at shutdown.
    pub ready: std::sync::Arc<std::sync::atomic::AtomicBool>,
    states: StatesSource,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

fn counter_vec(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric")
}

fn histogram_vec(name: &str, help: &str, labels: &[&str], buckets: &[f64]) -> HistogramVec {
    HistogramVec::new(
        HistogramOpts::new(name, help).buckets(buckets.to_vec()),
        labels,
    )
    .expect("valid metric")
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let buckets = [
            0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
        ];
        let boot_buckets = [0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0];
        let runs = counter_vec(
            "sluice_gateway_runs_total",
            "Trigger points run to a verdict, by chain, mode (run, stream) and top action",
            &labels(&["mode", "action"]),
        );
        let run_seconds = histogram_vec(
            "sluice_gateway_run_duration_seconds",
            "Time from request to answer of one run, by chain",
            &CHAIN,
            &buckets,
        );
        let requests = counter_vec(
            "sluice_gateway_requests_total",
            "Run and Stream requests by chain and the gRPC code answered, in snake case (ok, not_found, invalid_argument, unavailable, cancelled, deadline_exceeded, resource_exhausted); requests for unknown chains are counted under _unknown",
            &labels(&["code"]),
        );
        let hook_errors = counter_vec(
            "sluice_gateway_hook_errors_total",
            "Hook errors (exceptions, timeouts, bad results), by the chain (namespace/name and its namespace, target, trigger point) and hook",
            &["chain", "namespace", "target", "trigger_point", "hook"],
        );
        // Per hook: its chain's labels and its own name. Bounded: hooks are bounded per chain.
        let hook_labels = ["chain", "namespace", "target", "trigger_point", "hook"];
        let hook_actions = counter_vec(
            "sluice_gateway_hook_actions_total",
            "What each hook did, by the chain (namespace/name and its namespace, target, trigger point), hook and action (pass, modify, block, skip, detect, or error when it failed)",
            &[
                "chain",
                "namespace",
                "target",
                "trigger_point",
                "hook",
                "action",
            ],
        );
        let hook_seconds = histogram_vec(
            "sluice_gateway_hook_duration_seconds",
            "Time one hook took in its cell (its time budget's share; host_calls not counted), by chain and hook",
            &hook_labels,
            &buckets,
        );
        let sandboxes_started = counter_vec(
            "sluice_gateway_sandboxes_started_total",
            "Sandboxes booted to ready (boots), by chain",
            &CHAIN,
        );
        let sandbox_boot_failures = counter_vec(
            "sluice_gateway_sandbox_boot_failures_total",
            "Sandboxes that failed to boot, by chain",
            &CHAIN,
        );
        let sandbox_boot_seconds = histogram_vec(
            "sluice_gateway_sandbox_boot_seconds",
            "Time from start to supervisor ready with the first cell open, by chain",
            &CHAIN,
            &boot_buckets,
        );
        let sandbox_retirements = counter_vec(
            "sluice_gateway_sandbox_retirements_total",
            "Sandboxes destroyed after serving, by chain and reason: reuse_none, max_uses, dirty (the supervisor's verdict), broken (deadline kill, broken stream, protocol), idle (past the warm target and idle_retire), pool_closed",
            &labels(&["reason"]),
        );
        let cells_prepared = counter_vec(
            "sluice_gateway_cells_prepared_total",
            "Cells opened ahead of a claim (each hook of the trigger point in a fresh process), by chain; rate() is cells per second",
            &CHAIN,
        );
        let sandbox_cpu_throttled_periods = counter_vec(
            "sluice_gateway_sandbox_cpu_throttled_periods_total",
            "CFS periods in which a sandbox used up its CPU quota (the sandbox CPU limit) and waited, by chain, counted at the end of each trigger point; local mode (a pod's are the kubelet's container_cpu_cfs_throttled_periods_total)",
            &CHAIN,
        );
        let sandbox_cpu_throttled_seconds = CounterVec::new(
            Opts::new(
                "sluice_gateway_sandbox_cpu_throttled_seconds_total",
                "Time sandboxes waited throttled at their CPU quota, by chain; local mode",
            ),
            &CHAIN,
        )
        .expect("valid metric");
        let claims = counter_vec(
            "sluice_gateway_claims_total",
            "Sandbox claims by chain and result: warm (one was waiting), cold (waited for a boot or a recycle), timeout, shadow (a rollout's shadow run took one no run was waiting for)",
            &labels(&["result"]),
        );
        let claim_wait_seconds = histogram_vec(
            "sluice_gateway_claim_wait_seconds",
            "Time a run waited for a sandbox of its chain (timeouts included)",
            &CHAIN,
            &buckets,
        );
        let pool_warm = IntGaugeVec::new(
            Opts::new(
                "sluice_gateway_pool_warm_sandboxes",
                "Warm sandboxes per chain (namespace/name)",
            ),
            &["chain"],
        )
        .expect("valid metric");
        let host_calls = counter_vec(
            "sluice_gateway_host_calls_total",
            "host_calls by capability and result",
            &["capability", "result"],
        );
        let rejected = counter_vec(
            "sluice_gateway_rejected_requests_total",
            "Requests refused before running, by gRPC code",
            &["code"],
        );
        let audit_sampled_out = IntCounter::new(
            "sluice_gateway_audit_sampled_out_total",
            "Audit events of NOT_FOUND requests not written (at most one is written per 10 s, with how many it stands for)",
        )
        .expect("valid metric");
        let pod_claims = counter_vec(
            "sluice_gateway_pod_claims_total",
            "kube backend claim attempts: claimed, conflict (another gateway won), none (no warm pod in time), error",
            &["result"],
        );
        let rollout_runs = counter_vec(
            "sluice_gateway_rollout_runs_total",
            "Runs of chains in a canary rollout, by chain (namespace/name), the version that served (live, candidate) and outcome (ok, block, error)",
            &labels(&["chain", "role", "outcome"]),
        );
        let rollout_events = counter_vec(
            "sluice_gateway_rollout_events_total",
            "Rollouts by chain and event: started, step (a canary grew), promoted, rolled_back",
            &labels(&["chain", "event"]),
        );
        let shadow_runs = counter_vec(
            "sluice_gateway_shadow_runs_total",
            "Shadow runs of a rollout's candidate by chain and verdict against the live answer: agreed, action_differs, output_differs, error, dropped (no budget or sandbox)",
            &labels(&["chain", "verdict"]),
        );
        let shadow_hooks = counter_vec(
            "sluice_gateway_shadow_hook_runs_total",
            "Hooks of a candidate in shadow by chain, hook and verdict against the live hook of the same name: agreed, differs (another action, or new), error",
            &labels(&["chain", "hook", "verdict"]),
        );
        let shadow_hook_seconds = histogram_vec(
            "sluice_gateway_shadow_hook_duration_seconds",
            "Time one hook of a candidate took in shadow, by chain and hook",
            &labels(&["chain", "hook"]),
            &buckets,
        );
        let shadow_host_calls_refused = counter_vec(
            "sluice_gateway_shadow_host_calls_refused_total",
            "host_calls refused to a candidate in shadow because the capability is not safeToRepeat, by chain",
            &labels(&["chain"]),
        );
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
        let build_info = IntGaugeVec::new(
            Opts::new(
                "sluice_gateway_build_info",
                "Always 1; the gateway's version in a label",
            ),
            &["version"],
        )
        .expect("valid metric");
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        let states: StatesSource = Arc::default();
        for c in [
            Box::new(pod_claims.clone()) as Box<dyn Collector>,
            Box::new(rollout_runs.clone()),
            Box::new(rollout_events.clone()),
            Box::new(shadow_runs.clone()),
            Box::new(shadow_hooks.clone()),
            Box::new(shadow_hook_seconds.clone()),
            Box::new(shadow_host_calls_refused.clone()),
            Box::new(definitions_invalid.clone()),
            Box::new(chains_superseded.clone()),
            Box::new(runs.clone()),
            Box::new(run_seconds.clone()),
            Box::new(requests.clone()),
            Box::new(hook_errors.clone()),
            Box::new(hook_actions.clone()),
            Box::new(hook_seconds.clone()),
            Box::new(sandboxes_started.clone()),
            Box::new(sandbox_boot_failures.clone()),
            Box::new(sandbox_boot_seconds.clone()),
            Box::new(sandbox_retirements.clone()),
            Box::new(cells_prepared.clone()),
            Box::new(sandbox_cpu_throttled_periods.clone()),
            Box::new(sandbox_cpu_throttled_seconds.clone()),
            Box::new(claims.clone()),
            Box::new(claim_wait_seconds.clone()),
            Box::new(pool_warm.clone()),
            Box::new(host_calls.clone()),
            Box::new(rejected.clone()),
            Box::new(audit_sampled_out.clone()),
            Box::new(build_info),
            Box::new(StatesCollector::new(states.clone())),
        ] {
            registry.register(c).expect("metric names are unique");
        }
        #[cfg(target_os = "linux")]
        registry
            .register(Box::new(
                prometheus::process_collector::ProcessCollector::new(
                    std::process::id() as i32,
                    "sluice_gateway",
                ),
            ))
            .expect("metric names are unique");
        Self {
            registry,
            runs,
            run_seconds,
            requests,
            hook_errors,
            hook_actions,
            hook_seconds,
            sandboxes_started,
            sandbox_boot_failures,
            sandbox_boot_seconds,
            sandbox_retirements,
            cells_prepared,
            sandbox_cpu_throttled_periods,
            sandbox_cpu_throttled_seconds,
            claims,
            claim_wait_seconds,
            pool_warm,
            host_calls,
            rejected,
            audit_sampled_out,
            pod_claims,
            rollout_runs,
            rollout_events,
            shadow_runs,
            shadow_hooks,
            shadow_hook_seconds,
            shadow_host_calls_refused,
            definitions_invalid,
            chains_superseded,
            ready: Default::default(),
            states,
        }
    }

    /// Where `sluice_gateway_sandboxes` reads its counts at each scrape (the pools).
    pub(crate) fn set_sandbox_states(&self, f: Box<dyn Fn() -> SandboxStates + Send + Sync>) {
        *self.states.lock().unwrap_or_else(|p| p.into_inner()) = Some(f);
    }

    /// Sandboxes booted so far, all chains together.
    pub fn boots(&self) -> u64 {
        sum(&self.sandboxes_started.collect(), |_| true)
    }

    /// Sandboxes retired so far for `reason`, all chains together.
    pub fn retirements(&self, reason: &str) -> u64 {
        sum(&self.sandbox_retirements.collect(), |labels| {
            labels.iter().any(|(n, v)| *n == "reason" && *v == reason)
        })
    }
}

/// The sum of a counter family's series whose labels pass `keep`.
fn sum(families: &[MetricFamily], keep: impl Fn(&[(&str, &str)]) -> bool) -> u64 {
    families
        .iter()
        .flat_map(|f| f.get_metric())
        .filter(|m| {
            let labels: Vec<(&str, &str)> = m
                .get_label()
                .iter()
                .map(|l| (l.name(), l.value()))
                .collect();
            keep(&labels)
        })
        .map(|m| m.get_counter().get_value() as u64)
        .sum()
}

/// `sluice_gateway_sandboxes{namespace, target, trigger_point, state}`: computed from the pools at
/// scrape time, so it can never drift from what the pools hold.
struct StatesCollector {
    template: IntGaugeVec,
    source: StatesSource,
}

impl StatesCollector {
    fn new(source: StatesSource) -> Self {
        Self {
            template: Self::vec(),
            source,
        }
    }

    fn vec() -> IntGaugeVec {
        IntGaugeVec::new(
            Opts::new(
                "sluice_gateway_sandboxes",
                "Sandboxes per chain and state: warm (cell open, waiting for a claim), claimed, booting, recycling (cell being replaced), tearing_down",
            ),
            &labels(&["state"]),
        )
        .expect("valid metric")
    }
}

impl Collector for StatesCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.template.desc()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let source = self.source.lock().unwrap_or_else(|p| p.into_inner());
        let Some(read) = source.as_ref() else {
            return vec![];
        };
        let gauges = Self::vec();
        for (chain, state, n) in read() {
            gauges.with_label_values(&chain.with(&[state])).add(n);
        }
        gauges.collect()
    }
}
