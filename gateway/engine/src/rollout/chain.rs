//! One chain's rollout: its revisions, its live version and its candidate, how a canary is judged
//! and stepped, and how a cluster's `status.rollout` is followed.

use super::status::{RevisionStatus, RolloutStatus, ShadowSummary, Tally};
use crate::chain::Chain;
use crate::log_text::Escaped;
use sha2::{Digest, Sha256};
use sluice_crds::rollout::names;
use sluice_crds::{RolloutSpec, RolloutStrategy};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

/// Hook latencies kept per hook and version for the status's p50/p99.
const LATENCY_SAMPLES: usize = 512;

pub(super) struct ChainRollout {
    pub(super) history: VecDeque<RevisionStatus>,
    pub(super) next_number: u64,
    pub(super) live: Arc<Chain>,
    pub(super) candidate: Option<Candidate>,
    /// The revision last rolled back and why: applied again, it stays out.
    pub(super) rolled_back: Option<(String, String)>,
}

pub(super) struct Candidate {
    pub(super) chain: Arc<Chain>,
    pub(super) spec: RolloutSpec,
    pub(super) step_duration: Duration,
    pub(super) step: usize,
    pub(super) step_started: Instant,
    pub(super) live_tally: Tally,
    pub(super) candidate_tally: Tally,
    pub(super) shadow: ShadowSummary,
    pub(super) shadow_slots: Arc<Semaphore>,
    /// Per hook name: candidate latencies, live latencies (ms).
    pub(super) latencies: HashMap<String, (VecDeque<f64>, VecDeque<f64>)>,
    /// In a cluster the operator steps and promotes (`status.rollout`): the gateway serves the
    /// share it is told and judges only the bounds, whose breach it reports (`RolloutSink`).
    pub(super) directed: Option<u32>,
}

/// What a rollout did on its own or by order, for the log and the metrics.
pub(super) enum Event {
    Started(RolloutStrategy),
    Step(u32),
    Promoted(&'static str),
    RolledBack(String),
}

impl Candidate {
    pub(super) fn new(chain: Arc<Chain>, spec: RolloutSpec) -> Self {
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

    pub(super) fn strategy(&self) -> RolloutStrategy {
        self.spec.strategy
    }

    /// Percent of sessions the candidate serves now.
    pub(super) fn percent(&self) -> u32 {
        if let Some(p) = self.directed {
            return p;
        }
        match self.spec.strategy {
            RolloutStrategy::Shadow => 0,
            RolloutStrategy::Canary => self.spec.steps.get(self.step).copied().unwrap_or(100),
        }
    }

    /// A canary out of bounds, with why; a step that is over; the last one over: promotion.
    pub(super) fn judge(&mut self, now: Instant) -> Option<Event> {
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

    pub(super) fn shadow_summary(&self) -> ShadowSummary {
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

pub(super) fn push_sample(samples: &mut VecDeque<f64>, ms: f64) {
    if samples.len() == LATENCY_SAMPLES {
        samples.pop_front();
    }
    samples.push_back(ms);
}

/// Whether `session` falls in the first `percent` of 100 buckets for this candidate: a hash of
/// both, so one session stays on one side for the whole rollout, in every gateway replica.
pub(super) fn in_canary(candidate_revision: &str, session: &str, percent: u32) -> bool {
    let digest = Sha256::new()
        .chain_update(candidate_revision.as_bytes())
        .chain_update([0])
        .chain_update(session.as_bytes())
        .finalize();
    let n = u32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]]);
    n % 100 < percent
}

impl ChainRollout {
    pub(super) fn new(chain: Arc<Chain>) -> Self {
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
    pub(super) fn remember(&mut self, chain: &Chain) {
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
    pub(super) fn follow_directed(
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
    pub(super) fn follow(&mut self, chain: &Arc<Chain>) -> Option<Event> {
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

    pub(super) fn status(&self) -> RolloutStatus {
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
pub(super) fn short(revision: &str) -> &str {
    &revision[..revision.len().min(10)]
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
}
