//! What a rollout shows: `/rollouts`, the tests, and the gateway's own status entries in a cluster.

use crate::outcome::Walk;
use serde::{Deserialize, Serialize};
use sluice_crds::{Action, RolloutStrategy};

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
    pub(super) fn count(&mut self, walk: &Walk) {
        self.runs += 1;
        if walk.hooks.iter().any(|h| h.error.is_some()) {
            self.errors += 1;
        }
        if walk.action == Action::Block {
            self.blocks += 1;
        }
    }

    /// Percent of runs, 0 with none.
    pub(super) fn rate(part: u64, runs: u64) -> f64 {
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
