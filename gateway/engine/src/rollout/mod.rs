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
//! Who keeps the state: in local mode this gateway (`store`: across restarts in the state
//! directory); in a cluster the operator (`status.rollout` and ControllerRevisions), which every
//! gateway follows (`chain::ChainRollout::follow_directed`), each reporting a canary it finds out of
//! bounds (`RolloutSink`). Reading order: `status` (what is shown) → `chain` (one chain's rollout)
//! → this module (every chain's, and what a run gets) → `store`.

mod chain;
mod status;
mod store;

pub use status::{RevisionStatus, Role, RolloutStatus, ShadowHook, ShadowSummary, Tally};

use crate::chain::Chain;
use crate::chains::Chains;
use crate::log_text::Escaped;
use crate::metrics::{ChainLabels, Metrics};
use crate::outcome::Walk;
use chain::{ChainRollout, Event, in_canary, push_sample, short};
use sluice_crds::{Action, RolloutStrategy};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use store::Store;
use tokio::sync::OwnedSemaphorePermit;

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

/// Where a gateway reports a candidate it rolled back on its own, so that the rest of the cluster
/// follows (the kube assembly sets the chain's `sluice.dev/rollback` annotation).
pub trait RolloutSink: Send + Sync {
    fn rolled_back(&self, namespace: &str, name: &str, revision: &str, why: &str);
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

    /// The revision that would serve `chain` for `session` now, without judging or counting
    /// anything (`select` does both): the live one, or a canary's candidate where it places the
    /// session. `None` when it cannot be known ahead of the run: a canary places a run without a
    /// session by the run's own id.
    pub(crate) fn serving_revision(&self, chain: &Arc<Chain>, session: &str) -> Option<String> {
        let all = self.lock();
        let Some(r) = all.get(&chain.qualified_name()) else {
            return Some(chain.revision().to_string());
        };
        let Some(c) = r.candidate.as_ref() else {
            return Some(r.live.revision().to_string());
        };
        match c.strategy() {
            RolloutStrategy::Shadow => Some(r.live.revision().to_string()),
            RolloutStrategy::Canary if session.is_empty() => None,
            RolloutStrategy::Canary => Some(
                if in_canary(c.chain.revision(), session, c.percent()) {
                    c.chain.revision()
                } else {
                    r.live.revision()
                }
                .to_string(),
            ),
        }
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
            let shown = h.shown_name();
            let name = shown.as_str();
            let theirs = live
                .hooks
                .iter()
                .find(|l| l.name == h.name && l.layer == h.layer);
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
