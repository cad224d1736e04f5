//! Rolling out new hook code (`spec.rollout`), as a Deployment rolls out a pod template. Every chain
//! the gateway serves has revisions (one per version of its hooks, named by the code hash's digits,
//! the newest `revisionHistoryLimit` kept) and one live revision. A change to the hooks without
//! `spec.rollout` goes live at once. With it, the new hooks become the chain's candidate and the
//! live revision keeps serving:
//!
//! - **Shadow**: the candidate runs beside the live hooks on the same payloads, after the live
//!   answer is written, with its own concurrency budget (past it, dropped and counted); its verdicts
//!   are compared, counted and audited, never applied. Hooks in shadow may call only capabilities
//!   marked `safeToRepeat`. Promotion is by hand.
//! - **Canary**: a share of sessions (`steps`), chosen by a hash of the session id and the
//!   candidate's revision (one conversation sees one version throughout), is served by the
//!   candidate. A step ends after `stepDuration` with at least `minRuns` candidate runs; the last
//!   one promotes. A candidate whose error or block rate exceeds the live hooks' in the same step
//!   by more than the bounds is rolled back.
//!
//! By hand: removing `spec.rollout` promotes; the annotations `sluice.dev/promote: <revision>` and
//! `sluice.dev/rollback: <revision>` promote or roll back the candidate they name. A rolled-back
//! candidate stays out until the hooks change again.
//!
//! All of this is in the gateway's memory: `docs/rollout.md` says what that means for restarts and
//! for several gateways.

use crate::chain::Chain;
use crate::chains::Chains;
use crate::log_text::Escaped;
use crate::metrics::{ChainLabels, Metrics};
use crate::outcome::Walk;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use sluice_crds::{Action, HookChainSpec, RolloutSpec, RolloutStrategy};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Hook latencies kept per hook and version for the status's p50/p99.
const LATENCY_SAMPLES: usize = 512;

/// Which version of a chain served a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Live,
    Candidate,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Live => "live",
            Self::Candidate => "candidate",
        }
    }
}

/// One version of a chain's hooks.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RevisionStatus {
    /// 1 for the first version this gateway saw, counting up.
    pub number: u64,
    pub revision: String,
    /// When this gateway first saw it (RFC 3339).
    pub first_seen: String,
}

/// Runs, hook errors and blocks of one version in one canary step.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Tally {
    pub runs: u64,
    /// Runs in which a hook of the chain failed.
    pub errors: u64,
    /// Runs that ended `block`.
    pub blocks: u64,
}

impl Tally {
    fn count(&mut self, walk: &Walk) {
        self.runs += 1;
        if walk.hooks.iter().any(|h| h.error.is_some()) {
            self.errors += 1;
        }
        if walk.action == Action::Block {
            self.blocks += 1;
        }
    }

    /// Percent of runs, 0 with none.
    fn rate(part: u64, runs: u64) -> f64 {
        if runs == 0 {
            0.0
        } else {
            100.0 * part as f64 / runs as f64
        }
    }
}

/// How shadow runs compared, overall.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ShadowSummary {
    /// Shadow runs that finished and were compared.
    pub runs: u64,
    /// Same action and same payload as the live answer.
    pub agreed: u64,
    /// A different top action.
    pub action_differs: u64,
    /// The same action, a different payload (outgoing text or value).
    pub output_differs: u64,
    /// Shadow runs in which a hook of the candidate failed.
    pub errors: u64,
    /// Shadow runs not made: the chain's shadow budget was spent, or no sandbox was free.
    pub dropped: u64,
    /// host_calls refused in shadow (the capability is not `safeToRepeat`).
    pub host_calls_refused: u64,
    /// Percent of compared runs that disagreed (action or payload).
    pub disagreement_percent: f64,
    pub hooks: Vec<ShadowHook>,
}

/// How one hook of the candidate compared with the live hook of the same name.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ShadowHook {
    pub hook: String,
    pub runs: u64,
    /// Same action as the live hook of the same name.
    pub agreed: u64,
    /// A different action, or the hook is new in the candidate.
    pub differs: u64,
    pub errors: u64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// The live hook's latency over the same runs, where it has one.
    pub live_p50_ms: Option<f64>,
    pub live_p99_ms: Option<f64>,
}

/// What `/rollouts` and the logs show of one chain.
#[derive(Clone, Debug, Serialize)]
pub struct RolloutStatus {
    pub chain: String,
    pub live_revision: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub candidate_revision: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strategy: Option<RolloutStrategy>,
    /// RolledOut (the newest hooks are live), Shadowing, Progressing (a canary), RolledBack.
    pub phase: &'static str,
    /// Percent of sessions the candidate serves (0 in shadow).
    pub canary_percent: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step: Option<usize>,
    pub message: String,
    /// In this step: the live hooks and the candidate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub canary: Option<[Tally; 2]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shadow: Option<ShadowSummary>,
    /// Oldest first; the live revision and the candidate are among them.
    pub revisions: Vec<RevisionStatus>,
}

/// The chain versions one trigger point runs, and what the rollouts make of it.
pub(crate) struct Selection {
    /// The chains that serve (the live revision, or a canary's candidate).
    pub chains: Chains,
    /// Per chain served from a rollout in progress: its name, the role that served and the
    /// strategy.
    pub served: Vec<Served>,
    /// Candidates to run in shadow on the same payload, each with its budget's permit.
    pub shadows: Vec<ShadowJob>,
    /// Shadow runs dropped for want of budget, for the audit.
    pub shadows_dropped: usize,
}

impl Selection {
    /// Records in the run's audit event which version answered for each chain in a rollout.
    pub(crate) fn describe(&self, audit: &mut crate::audit::AuditEvent) {
        let mut dropped = self.shadows_dropped;
        for s in &self.served {
            let shadow = self
                .shadows
                .iter()
                .find(|j| j.candidate.qualified_name() == s.chain);
            let (shadow_revision, shadow_state) = match (s.strategy, shadow) {
                (RolloutStrategy::Shadow, Some(j)) => {
                    (Some(j.candidate.revision().to_string()), Some("started"))
                }
                (RolloutStrategy::Shadow, None) if dropped > 0 => {
                    dropped -= 1;
                    (None, Some("dropped"))
                }
                _ => (None, None),
            };
            audit.rollout.push(crate::audit::AuditRollout {
                chain: s.chain.clone(),
                strategy: s.strategy.as_str(),
                answered_by: s.role.as_str(),
                revision: s.revision.clone(),
                shadow_revision,
                shadow: shadow_state,
            });
        }
    }
}

pub(crate) struct Served {
    pub chain: String,
    pub revision: String,
    pub role: Role,
    pub strategy: RolloutStrategy,
}

/// One shadow run to make: the served chains with `baseline` or the tenant's chain replaced by
/// `candidate`.
pub(crate) struct ShadowJob {
    pub chains: Chains,
    pub candidate: Arc<Chain>,
    pub _permit: OwnedSemaphorePermit,
}

/// Every chain's rollout state.
pub(crate) struct Rollouts {
    chains: Mutex<HashMap<String, ChainRollout>>,
    metrics: Metrics,
    /// Where the state is kept across restarts (local mode), and what was read from it for chains
    /// not seen yet.
    store: Mutex<Option<Store>>,
    /// Set when a rollout changed on its own (a step, a promotion, a rollback): saved once the
    /// change is done.
    dirty: std::sync::atomic::AtomicBool,
    sink: Mutex<Option<Arc<dyn RolloutSink>>>,
}

struct Store {
    path: std::path::PathBuf,
    restored: HashMap<String, Saved>,
}

/// What survives a restart of one chain's rollout: the live hooks (a restarted gateway must not take
/// the candidate in the chain file for them), the history, a rollback, the canary's step.
#[derive(Serialize, Deserialize)]
struct Saved {
    namespace: String,
    name: String,
    live: HookChainSpec,
    history: Vec<RevisionStatus>,
    next_number: u64,
    rolled_back: Option<(String, String)>,
    candidate: Option<(String, usize)>,
}

struct ChainRollout {
    history: VecDeque<RevisionStatus>,
    next_number: u64,
    live: Arc<Chain>,
    candidate: Option<Candidate>,
    /// The revision last rolled back and why: applied again, it stays out.
    rolled_back: Option<(String, String)>,
}

struct Candidate {
    chain: Arc<Chain>,
    spec: RolloutSpec,
    step_duration: Duration,
    step: usize,
    step_started: Instant,
    live_tally: Tally,
    candidate_tally: Tally,
    shadow: ShadowSummary,
    shadow_slots: Arc<Semaphore>,
    /// Per hook name: candidate latencies, live latencies (ms).
    latencies: HashMap<String, (VecDeque<f64>, VecDeque<f64>)>,
    /// In a cluster the operator steps and promotes (`status.rollout`): the gateway serves the
    /// share it is told and judges only the bounds, whose breach it reports (`RolloutSink`).
    directed: Option<u32>,
}

/// Where a gateway reports a candidate it rolled back on its own, so that the rest of the cluster
/// follows (the kube assembly sets the chain's `sluice.dev/rollback` annotation).
pub trait RolloutSink: Send + Sync {
    fn rolled_back(&self, namespace: &str, name: &str, revision: &str, why: &str);
}

/// What a rollout did on its own or by order, for the log and the metrics.
enum Event {
    Started(RolloutStrategy),
    Step(u32),
    Promoted(&'static str),
    RolledBack(String),
}

impl Candidate {
    fn new(chain: Arc<Chain>, spec: RolloutSpec) -> Self {
        let step_duration = sluice_crds::duration::parse_duration(&spec.step_duration)
            .unwrap_or(Duration::from_secs(60));
        Self {
            shadow_slots: Arc::new(Semaphore::new(spec.shadow_concurrency.max(1) as usize)),
            chain,
            spec,
            step_duration,
            step: 0,
            step_started: Instant::now(),
            live_tally: Tally::default(),
            candidate_tally: Tally::default(),
            shadow: ShadowSummary::default(),
            latencies: HashMap::new(),
            directed: None,
        }
    }

    fn strategy(&self) -> RolloutStrategy {
        self.spec.strategy
    }

    /// Percent of sessions the candidate serves now.
    fn percent(&self) -> u32 {
        if let Some(p) = self.directed {
            return p;
        }
        match self.spec.strategy {
            RolloutStrategy::Shadow => 0,
            RolloutStrategy::Canary => self.spec.steps.get(self.step).copied().unwrap_or(100),
        }
    }

    /// A canary out of bounds, with why; a step that is over; the last one over: promotion.
    fn judge(&mut self, now: Instant) -> Option<Event> {
        if self.spec.strategy != RolloutStrategy::Canary {
            return None;
        }
        let (live, cand) = (self.live_tally, self.candidate_tally);
        if cand.runs >= self.spec.min_runs as u64 {
            for (what, c, l, bound) in [
                (
                    "error",
                    Tally::rate(cand.errors, cand.runs),
                    Tally::rate(live.errors, live.runs),
                    self.spec.max_error_rate_increase,
                ),
                (
                    "block",
                    Tally::rate(cand.blocks, cand.runs),
                    Tally::rate(live.blocks, live.runs),
                    self.spec.max_block_rate_increase,
                ),
            ] {
                if c - l > bound as f64 {
                    return Some(Event::RolledBack(format!(
                        "the candidate's {what} rate {c:.1}% ({} runs) exceeds the live hooks' {l:.1}% ({} runs) by more than maxBlockRateIncrease/maxErrorRateIncrease {bound} points",
                        cand.runs, live.runs
                    ).replace(
                        "maxBlockRateIncrease/maxErrorRateIncrease",
                        if what == "error" { "maxErrorRateIncrease" } else { "maxBlockRateIncrease" },
                    )));
                }
            }
            if self.directed.is_none()
                && now.duration_since(self.step_started) >= self.step_duration
            {
                if self.step + 1 >= self.spec.steps.len() {
                    return Some(Event::Promoted("its last canary step passed"));
                }
                self.step += 1;
                self.step_started = now;
                self.live_tally = Tally::default();
                self.candidate_tally = Tally::default();
                return Some(Event::Step(self.percent()));
            }
        }
        None
    }

    fn shadow_summary(&self) -> ShadowSummary {
        let mut s = self.shadow.clone();
        let disagreed = s.action_differs + s.output_differs;
        s.disagreement_percent = Tally::rate(disagreed, s.runs);
        for hook in &mut s.hooks {
            if let Some((cand, live)) = self.latencies.get(&hook.hook) {
                (hook.p50_ms, hook.p99_ms) = percentiles(cand).unwrap_or_default();
                if let Some((p50, p99)) = percentiles(live) {
                    hook.live_p50_ms = Some(p50);
                    hook.live_p99_ms = Some(p99);
                }
            }
        }
        s
    }
}

fn percentiles(samples: &VecDeque<f64>) -> Option<(f64, f64)> {
    if samples.is_empty() {
        return None;
    }
    let mut v: Vec<f64> = samples.iter().copied().collect();
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
    Some((at(0.5), at(0.99)))
}

fn push_sample(samples: &mut VecDeque<f64>, ms: f64) {
    if samples.len() == LATENCY_SAMPLES {
        samples.pop_front();
    }
    samples.push_back(ms);
}

/// Whether `session` falls in the first `percent` of 100 buckets for this candidate: a hash of
/// both, so one session stays on one side for the whole rollout, in every gateway replica.
pub(crate) fn in_canary(candidate_revision: &str, session: &str, percent: u32) -> bool {
    let digest = Sha256::new()
        .chain_update(candidate_revision.as_bytes())
        .chain_update([0])
        .chain_update(session.as_bytes())
        .finalize();
    let n = u32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]]);
    n % 100 < percent
}

/// Whether an order (a revision prefix of at least 7 digits) names `revision`.
fn names(order: Option<&String>, revision: &str) -> bool {
    order.is_some_and(|o| o.len() >= 7 && revision.starts_with(o.as_str()))
}

impl ChainRollout {
    fn new(chain: Arc<Chain>) -> Self {
        let mut r = Self {
            history: VecDeque::new(),
            next_number: 1,
            live: chain.clone(),
            candidate: None,
            rolled_back: None,
        };
        r.remember(&chain);
        r
    }

    /// Adds a revision to the history (once per version), keeping the newest
    /// `revisionHistoryLimit`, never dropping the live one or the candidate.
    fn remember(&mut self, chain: &Chain) {
        if self.history.iter().any(|r| r.revision == chain.revision()) {
            return;
        }
        self.history.push_back(RevisionStatus {
            number: self.next_number,
            revision: chain.revision().to_string(),
            first_seen: crate::audit::now_rfc3339(),
        });
        self.next_number += 1;
        let limit = chain.spec.revision_history_limit.max(1) as usize;
        while self.history.len() > limit {
            let keep = [
                Some(self.live.revision().to_string()),
                self.candidate
                    .as_ref()
                    .map(|c| c.chain.revision().to_string()),
            ];
            match self
                .history
                .iter()
                .position(|r| !keep.contains(&Some(r.revision.clone())))
            {
                Some(i) => {
                    self.history.remove(i);
                }
                None => break,
            }
        }
    }

    /// Follows the rollout the cluster's operator directs: its live revision, its candidate and
    /// share. The live revision's hooks come with the chain (from its ControllerRevision).
    fn follow_directed(
        &mut self,
        chain: &Arc<Chain>,
        d: &sluice_crds::definition::Directed,
    ) -> Option<Event> {
        let state = &d.state;
        let live = if state.live_revision == chain.revision() {
            Some(chain.clone())
        } else if state.live_revision == self.live.revision() {
            Some(self.live.clone())
        } else {
            d.live
                .as_ref()
                .and_then(|spec| Chain::new(&chain.namespace, &chain.name, spec).ok())
                .map(Arc::new)
        };
        let Some(live) = live else {
            tracing::warn!(chain = %Escaped(&chain.qualified_name()), live = %short(&state.live_revision), "the live revision's hooks cannot be read; serving the ones served before");
            return None;
        };
        self.remember(&live);
        self.remember(chain);
        let promoted = live.revision() != self.live.revision();
        self.live = live;
        // A candidate this gateway rolled back stays out while the operator catches up.
        let rolled_back_here = |r: &str| self.rolled_back.as_ref().is_some_and(|(x, _)| x == r);
        let candidate = state
            .candidate_revision
            .as_deref()
            .filter(|r| *r == chain.revision() && state.phase != "RolledBack")
            .filter(|r| !rolled_back_here(r));
        let mut event =
            promoted.then_some(Event::Promoted("the operator's status.rollout says so"));
        match (candidate, chain.spec.rollout.clone()) {
            (Some(_), Some(spec)) => {
                let keep = self
                    .candidate
                    .as_ref()
                    .is_some_and(|c| c.chain.same_hooks(chain) && c.spec.strategy == spec.strategy);
                if !keep {
                    self.candidate = Some(Candidate::new(chain.clone(), spec.clone()));
                    event = Some(Event::Started(spec.strategy));
                }
                if let Some(c) = self.candidate.as_mut() {
                    if c.directed.is_some_and(|p| p != state.canary_percent) {
                        // A new step: its counts start afresh, as the operator's step does.
                        c.live_tally = Tally::default();
                        c.candidate_tally = Tally::default();
                        event = Some(Event::Step(state.canary_percent));
                    }
                    c.chain = chain.clone();
                    c.spec = spec;
                    c.step = state.step.unwrap_or(0) as usize;
                    c.directed = Some(state.canary_percent);
                }
                self.rolled_back = None;
            }
            _ => {
                self.candidate = None;
                if let Some(r) = &state.rolled_back_revision {
                    self.rolled_back = Some((r.clone(), state.message.clone()));
                } else if state.candidate_revision.is_none() {
                    self.rolled_back = None;
                }
            }
        }
        event
    }

    /// Follows a new version of the chain from the registry; what happened, if anything.
    fn follow(&mut self, chain: &Arc<Chain>) -> Option<Event> {
        if let Some(d) = &chain.directed {
            return self.follow_directed(chain, d);
        }
        if chain.same_hooks(&self.live) {
            // The same hooks (perhaps other pool or timeout settings): they stay live; a candidate
            // that was in progress is gone (the spec went back to the live hooks).
            self.live = chain.clone();
            self.rolled_back = None;
            return self.candidate.take().map(|_| {
                Event::RolledBack("spec.hooks went back to the live revision".to_string())
            });
        }
        self.remember(chain);
        let rollout = chain.spec.rollout.clone();
        let Some(spec) = rollout else {
            self.live = chain.clone();
            self.candidate = None;
            self.rolled_back = None;
            return Some(Event::Promoted(
                "spec.rollout is absent: the newest hooks go live at once",
            ));
        };
        // Orders by hand first (a rollback before a promotion naming the same revision), then a
        // rollback remembered from before.
        if names(chain.orders.rollback.as_ref(), chain.revision()) {
            if self
                .rolled_back
                .as_ref()
                .is_some_and(|(r, _)| r == chain.revision())
            {
                return None;
            }
            self.candidate = None;
            let why = "the sluice.dev/rollback annotation names it".to_string();
            self.rolled_back = Some((chain.revision().to_string(), why.clone()));
            return Some(Event::RolledBack(why));
        }
        if names(chain.orders.promote.as_ref(), chain.revision()) {
            self.live = chain.clone();
            self.candidate = None;
            self.rolled_back = None;
            return Some(Event::Promoted(
                "the sluice.dev/promote annotation names it",
            ));
        }
        if self
            .rolled_back
            .as_ref()
            .is_some_and(|(r, _)| r == chain.revision())
        {
            return None;
        }
        match &mut self.candidate {
            Some(c) if c.chain.same_hooks(chain) => {
                // The same candidate; the rollout's own settings may have changed.
                if c.spec.strategy != spec.strategy {
                    *c = Candidate::new(chain.clone(), spec.clone());
                    return Some(Event::Started(spec.strategy));
                }
                c.chain = chain.clone();
                c.step_duration = sluice_crds::duration::parse_duration(&spec.step_duration)
                    .unwrap_or(c.step_duration);
                c.spec = spec;
                None
            }
            _ => {
                let strategy = spec.strategy;
                self.candidate = Some(Candidate::new(chain.clone(), spec));
                Some(Event::Started(strategy))
            }
        }
    }

    fn status(&self) -> RolloutStatus {
        let (phase, message) = match (&self.candidate, &self.rolled_back) {
            (Some(c), _) if c.strategy() == RolloutStrategy::Shadow => (
                "Shadowing",
                format!(
                    "revision {} runs in shadow beside {}",
                    short(c.chain.revision()),
                    short(self.live.revision())
                ),
            ),
            (Some(c), _) => (
                "Progressing",
                format!(
                    "revision {} serves {}% of sessions (step {} of {})",
                    short(c.chain.revision()),
                    c.percent(),
                    c.step + 1,
                    c.spec.steps.len()
                ),
            ),
            (None, Some((revision, why))) => (
                "RolledBack",
                format!("revision {} was rolled back: {why}", short(revision)),
            ),
            (None, None) => (
                "RolledOut",
                format!("revision {} is live", short(self.live.revision())),
            ),
        };
        RolloutStatus {
            chain: self.live.qualified_name(),
            live_revision: self.live.revision().to_string(),
            candidate_revision: self
                .candidate
                .as_ref()
                .map(|c| c.chain.revision().to_string()),
            strategy: self.candidate.as_ref().map(|c| c.strategy()),
            phase,
            canary_percent: self.candidate.as_ref().map_or(0, |c| c.percent()),
            step: self
                .candidate
                .as_ref()
                .filter(|c| c.strategy() == RolloutStrategy::Canary)
                .map(|c| c.step),
            message,
            canary: self
                .candidate
                .as_ref()
                .filter(|c| c.strategy() == RolloutStrategy::Canary)
                .map(|c| [c.live_tally, c.candidate_tally]),
            shadow: self
                .candidate
                .as_ref()
                .filter(|c| c.strategy() == RolloutStrategy::Shadow)
                .map(|c| c.shadow_summary()),
            revisions: self.history.iter().cloned().collect(),
        }
    }
}

/// A revision as people read it: its first 10 digits.
pub(crate) fn short(revision: &str) -> &str {
    &revision[..revision.len().min(10)]
}

impl Rollouts {
    pub(crate) fn new(metrics: Metrics) -> Self {
        Self {
            chains: Mutex::default(),
            metrics,
            store: Mutex::default(),
            dirty: Default::default(),
            sink: Mutex::default(),
        }
    }

    /// Where rollbacks this gateway decides on its own are reported (in a cluster).
    pub(crate) fn report_to(&self, sink: Arc<dyn RolloutSink>) {
        *self.sink.lock().unwrap_or_else(|p| p.into_inner()) = Some(sink);
    }

    /// Keeps the state in `path` from now on, and takes what an earlier gateway left there for the
    /// chains it will see. Unreadable state is logged and started over (the chain file's hooks go
    /// live, as on a first start).
    pub(crate) fn keep_in(&self, path: std::path::PathBuf) {
        if let Some(dir) = path.parent()
            && let Err(e) = std::fs::create_dir_all(dir)
        {
            tracing::warn!(path = %dir.display(), error = %e, "cannot make the directory for the rollout state");
        }
        let restored = match std::fs::read(&path) {
            Ok(bytes) => match serde_json::from_slice::<Vec<Saved>>(&bytes) {
                Ok(saved) => saved
                    .into_iter()
                    .map(|s| (format!("{}/{}", s.namespace, s.name), s))
                    .collect(),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "rollout state unreadable; starting over");
                    HashMap::new()
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => HashMap::new(),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "rollout state unreadable; starting over");
                HashMap::new()
            }
        };
        *self.store.lock().unwrap_or_else(|p| p.into_inner()) = Some(Store { path, restored });
    }

    /// A chain's rollout as an earlier gateway left it, if it did.
    fn restore(&self, chain: &Arc<Chain>) -> Option<ChainRollout> {
        let mut store = self.store.lock().unwrap_or_else(|p| p.into_inner());
        let saved = store.as_mut()?.restored.remove(&chain.qualified_name())?;
        let live = Chain::new(&saved.namespace, &saved.name, &saved.live).ok()?;
        let mut r = ChainRollout {
            history: saved.history.into(),
            next_number: saved.next_number,
            live: Arc::new(live),
            candidate: None,
            rolled_back: saved.rolled_back,
        };
        r.follow(chain);
        if let (Some(c), Some((revision, step))) = (r.candidate.as_mut(), saved.candidate)
            && c.chain.revision() == revision
            && step < c.spec.steps.len()
        {
            c.step = step;
        }
        Some(r)
    }

    /// Writes every chain's state where `keep_in` said (atomically: a crash leaves the old file).
    fn save(&self, all: &HashMap<String, ChainRollout>) {
        let store = self.store.lock().unwrap_or_else(|p| p.into_inner());
        let Some(store) = store.as_ref() else { return };
        let saved: Vec<Saved> = all
            .values()
            .map(|r| Saved {
                namespace: r.live.namespace.clone(),
                name: r.live.name.clone(),
                live: r.live.spec.clone(),
                history: r.history.iter().cloned().collect(),
                next_number: r.next_number,
                rolled_back: r.rolled_back.clone(),
                candidate: r
                    .candidate
                    .as_ref()
                    .map(|c| (c.chain.revision().to_string(), c.step)),
            })
            .collect();
        let tmp = store.path.with_extension("json.tmp");
        let written = serde_json::to_vec(&saved)
            .map_err(std::io::Error::other)
            .and_then(|bytes| std::fs::write(&tmp, bytes))
            .and_then(|()| std::fs::rename(&tmp, &store.path));
        if let Err(e) = written {
            tracing::warn!(path = %store.path.display(), error = %e, "could not keep the rollout state");
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, ChainRollout>> {
        self.chains.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Follows a new registry: chains new to the gateway start with their hooks live; changed hooks
    /// go live or become a candidate (`spec.rollout`); chains that are gone are forgotten. Returns the
    /// live version of every chain, which the pools prepare cells for.
    pub(crate) fn follow<'a>(
        &self,
        chains: impl IntoIterator<Item = &'a Arc<Chain>>,
    ) -> Vec<Arc<Chain>> {
        let mut all = self.lock();
        let mut seen = std::collections::HashSet::new();
        for chain in chains {
            let name = chain.qualified_name();
            seen.insert(name.clone());
            match all.get_mut(&name) {
                None => {
                    let r = self.restore(chain).unwrap_or_else(|| {
                        let mut r = ChainRollout::new(chain.clone());
                        // In a cluster the operator says what is live, not the spec.
                        if chain.directed.is_some() {
                            r.follow(chain);
                        }
                        r
                    });
                    all.insert(name, r);
                }
                Some(r) => {
                    if let Some(event) = r.follow(chain) {
                        self.report(r, &event);
                    }
                }
            }
        }
        all.retain(|name, _| seen.contains(name));
        self.save(&all);
        all.values().map(|r| r.live.clone()).collect()
    }

    /// The candidates in progress, whose pools must stay open beside the live chains'.
    pub(crate) fn candidates(&self) -> Vec<Arc<Chain>> {
        self.lock()
            .values()
            .filter_map(|r| r.candidate.as_ref().map(|c| c.chain.clone()))
            .collect()
    }

    /// The versions that serve one trigger point of `session`, and the shadow runs to make.
    /// `promoted` receives the chains whose candidate went live on this call (their pools must
    /// prepare cells for them from now on).
    pub(crate) fn select(
        &self,
        chains: &Chains,
        session: &str,
        promoted: &mut Vec<Arc<Chain>>,
    ) -> Selection {
        let mut all = self.lock();
        let mut served = Vec::new();
        let mut shadows = Vec::new();
        let mut shadows_dropped = 0;
        let mut pick = |chain: &Arc<Chain>| -> (Arc<Chain>, Option<Arc<Chain>>) {
            let Some(r) = all.get_mut(&chain.qualified_name()) else {
                return (chain.clone(), None);
            };
            if let Some(c) = r.candidate.as_mut()
                && let Some(event) = c.judge(Instant::now())
            {
                self.apply(r, event, promoted);
            }
            let Some(c) = r.candidate.as_ref() else {
                return (r.live.clone(), None);
            };
            match c.strategy() {
                RolloutStrategy::Canary => {
                    let role = if in_canary(c.chain.revision(), session, c.percent()) {
                        Role::Candidate
                    } else {
                        Role::Live
                    };
                    let serving = match role {
                        Role::Candidate => c.chain.clone(),
                        Role::Live => r.live.clone(),
                    };
                    served.push(Served {
                        chain: chain.qualified_name(),
                        revision: serving.revision().to_string(),
                        role,
                        strategy: RolloutStrategy::Canary,
                    });
                    (serving, None)
                }
                RolloutStrategy::Shadow => {
                    served.push(Served {
                        chain: chain.qualified_name(),
                        revision: r.live.revision().to_string(),
                        role: Role::Live,
                        strategy: RolloutStrategy::Shadow,
                    });
                    (r.live.clone(), Some(c.chain.clone()))
                }
            }
        };
        let (baseline, baseline_shadow) = match &chains.baseline {
            Some(b) => {
                let (s, sh) = pick(b);
                (Some(s), sh)
            }
            None => (None, None),
        };
        let (tenant, tenant_shadow) = match &chains.tenant {
            Some(t) => {
                let (s, sh) = pick(t);
                (Some(s), sh)
            }
            None => (None, None),
        };
        let serving = Chains { baseline, tenant };
        for (candidate, is_baseline) in [(baseline_shadow, true), (tenant_shadow, false)] {
            let Some(candidate) = candidate else { continue };
            let Some(r) = all.get_mut(&candidate.qualified_name()) else {
                continue;
            };
            let Some(c) = r.candidate.as_mut() else {
                continue;
            };
            match c.shadow_slots.clone().try_acquire_owned() {
                Ok(permit) => {
                    let mut chains = serving.clone();
                    if is_baseline {
                        chains.baseline = Some(candidate.clone());
                    } else {
                        chains.tenant = Some(candidate.clone());
                    }
                    shadows.push(ShadowJob {
                        chains,
                        candidate,
                        _permit: permit,
                    });
                }
                Err(_) => {
                    c.shadow.dropped += 1;
                    shadows_dropped += 1;
                    self.shadow_counter(&r.live, "dropped");
                }
            }
        }
        if self.dirty.swap(false, std::sync::atomic::Ordering::Relaxed) {
            self.save(&all);
        }
        Selection {
            chains: serving,
            served,
            shadows,
            shadows_dropped,
        }
    }

    /// Counts a finished run against the canaries that served it, and judges them.
    pub(crate) fn record(&self, served: &[Served], walk: &Walk, promoted: &mut Vec<Arc<Chain>>) {
        if served.is_empty() {
            return;
        }
        let mut all = self.lock();
        for s in served {
            let Some(r) = all.get_mut(&s.chain) else {
                continue;
            };
            let Some(c) = r.candidate.as_mut() else {
                continue;
            };
            // Only canaries are judged, and only on runs of the candidate in progress.
            let stale = s.role == Role::Candidate && s.revision != c.chain.revision();
            if s.strategy != RolloutStrategy::Canary || stale {
                continue;
            }
            match s.role {
                Role::Candidate => c.candidate_tally.count(walk),
                Role::Live => c.live_tally.count(walk),
            }
            self.metrics
                .rollout_runs
                .with_label_values(&ChainLabels::of(&r.live).with(&[
                    &s.chain,
                    s.role.as_str(),
                    outcome_label(walk),
                ]))
                .inc();
            if let Some(event) = c.judge(Instant::now()) {
                self.apply(r, event, promoted);
            }
        }
        if self.dirty.swap(false, std::sync::atomic::Ordering::Relaxed) {
            self.save(&all);
        }
    }

    /// Compares a shadow run with the live answer of the same payload and counts it.
    pub(crate) fn record_shadow(
        &self,
        candidate: &Chain,
        live: &Walk,
        shadow: &Walk,
        refused_host_calls: u64,
    ) -> &'static str {
        let verdict = if shadow.hooks.iter().any(|h| h.error.is_some()) {
            "error"
        } else if shadow.action != live.action {
            "action_differs"
        } else if shadow.payload != live.payload {
            "output_differs"
        } else {
            "agreed"
        };
        let mut all = self.lock();
        let Some(r) = all.get_mut(&candidate.qualified_name()) else {
            return verdict;
        };
        let Some(c) = r
            .candidate
            .as_mut()
            .filter(|c| c.chain.same_hooks(candidate))
        else {
            return verdict;
        };
        let s = &mut c.shadow;
        s.runs += 1;
        s.host_calls_refused += refused_host_calls;
        match verdict {
            "error" => s.errors += 1,
            "action_differs" => s.action_differs += 1,
            "output_differs" => s.output_differs += 1,
            _ => s.agreed += 1,
        }
        let labels = ChainLabels::of(&r.live);
        let chain = r.live.qualified_name();
        for h in &shadow.hooks {
            let name = h.name.as_str();
            let theirs = live.hooks.iter().find(|l| l.name == h.name);
            let hook_verdict = if h.error.is_some() {
                "error"
            } else if theirs.is_some_and(|l| l.action == h.action && l.error.is_none()) {
                "agreed"
            } else {
                "differs"
            };
            let entry = match s.hooks.iter_mut().position(|x| x.hook == name) {
                Some(i) => &mut s.hooks[i],
                None => {
                    s.hooks.push(ShadowHook {
                        hook: name.to_string(),
                        ..Default::default()
                    });
                    s.hooks.last_mut().expect("just pushed")
                }
            };
            entry.runs += 1;
            match hook_verdict {
                "error" => entry.errors += 1,
                "agreed" => entry.agreed += 1,
                _ => entry.differs += 1,
            }
            let (cand, live_samples) = c.latencies.entry(name.to_string()).or_default();
            push_sample(cand, h.latency_us as f64 / 1000.0);
            if let Some(l) = theirs {
                push_sample(live_samples, l.latency_us as f64 / 1000.0);
            }
            self.metrics
                .shadow_hooks
                .with_label_values(&labels.with(&[&chain, name, hook_verdict]))
                .inc();
            self.metrics
                .shadow_hook_seconds
                .with_label_values(&labels.with(&[&chain, name]))
                .observe(h.latency_us as f64 / 1e6);
        }
        if refused_host_calls > 0 {
            self.metrics
                .shadow_host_calls_refused
                .with_label_values(&labels.with(&[&chain]))
                .inc_by(refused_host_calls);
        }
        self.shadow_counter(&r.live, verdict);
        verdict
    }

    /// A shadow run that could not be made (no sandbox free in time, the gateway stopping).
    pub(crate) fn shadow_dropped(&self, candidate: &Chain) {
        let mut all = self.lock();
        if let Some(r) = all.get_mut(&candidate.qualified_name()) {
            if let Some(c) = r.candidate.as_mut() {
                c.shadow.dropped += 1;
            }
            self.shadow_counter(&r.live, "dropped");
        }
    }

    fn shadow_counter(&self, live: &Chain, verdict: &str) {
        let labels = ChainLabels::of(live);
        let chain = live.qualified_name();
        self.metrics
            .shadow_runs
            .with_label_values(&labels.with(&[&chain, verdict]))
            .inc();
    }

    /// Every chain's rollout state, by chain name.
    pub(crate) fn status(&self) -> Vec<RolloutStatus> {
        let mut out: Vec<RolloutStatus> = self.lock().values().map(|r| r.status()).collect();
        out.sort_by(|a, b| a.chain.cmp(&b.chain));
        out
    }

    fn apply(&self, r: &mut ChainRollout, event: Event, promoted: &mut Vec<Arc<Chain>>) {
        match &event {
            Event::Promoted(_) => {
                if let Some(c) = r.candidate.take() {
                    r.live = c.chain;
                    promoted.push(r.live.clone());
                }
            }
            Event::RolledBack(why) => {
                if let Some(c) = r.candidate.take() {
                    r.rolled_back = Some((c.chain.revision().to_string(), why.clone()));
                    if c.directed.is_some()
                        && let Some(sink) =
                            self.sink.lock().unwrap_or_else(|p| p.into_inner()).clone()
                    {
                        sink.rolled_back(
                            &c.chain.namespace,
                            &c.chain.name,
                            c.chain.revision(),
                            why,
                        );
                    }
                }
            }
            Event::Started(_) | Event::Step(_) => {}
        }
        self.dirty.store(true, std::sync::atomic::Ordering::Relaxed);
        self.report(r, &event);
    }

    /// Logs what happened and counts it. A rollback is a warning: someone should look.
    fn report(&self, r: &ChainRollout, event: &Event) {
        let chain = r.live.qualified_name();
        let live = short(r.live.revision()).to_string();
        let candidate = r
            .candidate
            .as_ref()
            .map(|c| short(c.chain.revision()).to_string())
            .unwrap_or_default();
        let name = match event {
            Event::Started(strategy) => {
                tracing::info!(chain = %Escaped(&chain), live = %live, candidate = %candidate, strategy = strategy.as_str(), "rollout started");
                "started"
            }
            Event::Step(percent) => {
                tracing::info!(chain = %Escaped(&chain), candidate = %candidate, percent, "canary stepped up");
                "step"
            }
            Event::Promoted(why) => {
                tracing::info!(chain = %Escaped(&chain), live = %live, why, "revision promoted");
                "promoted"
            }
            Event::RolledBack(why) => {
                let revision = r.rolled_back.as_ref().map(|(r, _)| short(r)).unwrap_or("");
                tracing::warn!(chain = %Escaped(&chain), live = %live, candidate = revision, why = %Escaped(why), "candidate rolled back");
                "rolled_back"
            }
        };
        self.metrics
            .rollout_events
            .with_label_values(&ChainLabels::of(&r.live).with(&[&chain, name]))
            .inc();
    }
}

fn outcome_label(walk: &Walk) -> &'static str {
    if walk.hooks.iter().any(|h| h.error.is_some()) {
        "error"
    } else if walk.action == Action::Block {
        "block"
    } else {
        "ok"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_stays_on_one_side_and_the_share_is_about_the_percent() {
        let revision = "0123456789abcdef";
        let sessions: Vec<String> = (0..10_000).map(|i| format!("session-{i}")).collect();
        let in_ten: Vec<bool> = sessions
            .iter()
            .map(|s| in_canary(revision, s, 10))
            .collect();
        let share = in_ten.iter().filter(|b| **b).count();
        assert!((800..=1200).contains(&share), "{share} of 10000 at 10%");
        for (s, was) in sessions.iter().zip(&in_ten) {
            assert_eq!(in_canary(revision, s, 10), *was, "{s} changed sides");
            if *was {
                assert!(
                    in_canary(revision, s, 50),
                    "{s} left the canary when it grew"
                );
            }
        }
        assert!(sessions.iter().all(|s| in_canary(revision, s, 100)));
        assert!(!sessions.iter().any(|s| in_canary(revision, s, 0)));
    }

    #[test]
    fn an_order_names_a_revision_by_a_prefix_of_seven_digits_or_more() {
        let rev = "9f3c2a17b4d6e801";
        assert!(names(Some(&"9f3c2a1".to_string()), rev));
        assert!(names(Some(&rev.to_string()), rev));
        assert!(
            !names(Some(&"9f3c2a".to_string()), rev),
            "too short to name one"
        );
        assert!(!names(Some(&"aaaaaaaa".to_string()), rev));
        assert!(!names(None, rev));
    }
}
