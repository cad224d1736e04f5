//! What every reconcile shares: the client, the caches, the settings, and the memory the operator
//! keeps between reconciles (code checks by hash, NetworkPolicy applications, start failures); and
//! how Events are published.

use super::build::Settings;
use crate::expectations::Expectations;
use crate::metrics::Metrics;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;
use kube::core::DeserializeGuard;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::Store;
use sluice_crds::Capability;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a new pod may take to become ready before it is replaced (`--start-deadline`).
pub const DEFAULT_START_DEADLINE: Duration = Duration::from_secs(120);

/// Pods of one chain's current template that failed to start in a row.
#[derive(Clone, Debug, Default)]
pub(crate) struct StartFailures {
    pub(super) template: String,
    pub(super) count: u32,
    /// `pod x: why`
    pub(super) last: String,
}

/// What every reconcile shares.
pub struct Context {
    pub client: Client,
    pub settings: Settings,
    pub claim_deadline: Duration,
    /// A pod not ready this long after its creation is replaced (see `pool::plan`).
    pub start_deadline: Duration,
    pub pods: Store<Pod>,
    /// The cluster's nodes: a claimed pod on a cordoned or lost node is marked draining, warm pods
    /// move off them (`pool::NodeState`). Empty (not watched, or not allowed to be): every pod's
    /// node counts as serving.
    pub nodes: Store<Node>,
    pub capabilities: Store<DeserializeGuard<Capability>>,
    /// Where Capabilities may point; others are `Ready=False` (`EndpointNotAllowed`), and so are
    /// the chains whose hooks call them.
    pub allowed_endpoints: sluice_crds::endpoints::AllowedEndpoints,
    pub expectations: Expectations,
    pub recorder: Recorder,
    pub metrics: Metrics,
    /// Code analysis results by code hash: python3 runs once per version of a chain's hooks.
    pub(super) code_checks: Mutex<HashMap<String, super::validate::CodeProblems>>,
    /// When each chain's (by uid) NetworkPolicy was last applied.
    pub(super) netpol_applied: Mutex<HashMap<String, Instant>>,
    /// Start failures by chain (`ns/name`).
    pub(super) start_failures: Mutex<HashMap<String, StartFailures>>,
    /// When each chain's (`ns/name`) status was last written, so that counts alone are written
    /// at most every `status::COUNTS_EVERY`.
    pub(super) status_written: Mutex<HashMap<String, Instant>>,
    /// Revisions (`uid/revision`) already kept as ControllerRevisions: listed and created once.
    pub(super) revisions_kept: Mutex<std::collections::HashSet<String>>,
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
            nodes: kube::runtime::reflector::store().0,
            capabilities,
            allowed_endpoints: Default::default(),
            expectations,
            recorder,
            metrics,
            code_checks: Mutex::default(),
            revisions_kept: Mutex::default(),
            netpol_applied: Mutex::default(),
            start_failures: Mutex::default(),
            status_written: Mutex::default(),
        }
    }

    /// Sets where Capabilities may point (none but built-ins by default).
    pub fn with_allowed_endpoints(
        mut self,
        allowed: sluice_crds::endpoints::AllowedEndpoints,
    ) -> Self {
        self.allowed_endpoints = allowed;
        self
    }

    /// Sets the node cache (see `nodes`).
    pub fn with_nodes(mut self, nodes: Store<Node>) -> Self {
        self.nodes = nodes;
        self
    }

    /// Sets how long a new pod may take to become ready before it is replaced.
    pub fn with_start_deadline(mut self, deadline: Duration) -> Self {
        self.start_deadline = deadline;
        self
    }

    pub(super) async fn publish(
        &self,
        regarding: &k8s_openapi::api::core::v1::ObjectReference,
        type_: EventType,
        reason: &str,
        note: String,
    ) {
        let ev = Event {
            type_,
            reason: reason.into(),
            note: Some(super::text::bounded(note, MAX_NOTE)),
            action: "Reconcile".into(),
            secondary: None,
        };
        // Events help people; a failure to record one must not stop the pool.
        if let Err(e) = self.recorder.publish(&ev, regarding).await {
            tracing::warn!(error = %sluice_crds::log_text::Escaped(&e.to_string()), reason, "cannot publish event");
        }
    }
}

/// The API server refuses Event notes over 1 kB; a long list of problems is cut, not lost (the
/// condition message holds more).
const MAX_NOTE: usize = 1000;

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
