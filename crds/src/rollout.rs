//! A chain's rollout as the cluster keeps it (`status.rollout`, written by the operator, read by
//! every gateway): which revision of the hooks is live, which is the candidate and how far a canary
//! has got. One pure function, `advance`, moves it on from the spec, the annotations and the time:
//! the operator calls it on every reconcile; what the gateways judge (a canary out of bounds) comes
//! back as the `sluice.dev/rollback` annotation, an order like a person's.

use crate::definition::RolloutOrders;
use crate::{HookChainSpec, RolloutStrategy};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// The label on a chain's ControllerRevisions: the chain's name.
pub const REVISION_LABEL: &str = "sluice.dev/hookchain";

/// The ControllerRevision that keeps one revision of a chain's hooks.
pub fn revision_object_name(chain: &str, revision: &str) -> String {
    format!("{chain}-{}", &revision[..revision.len().min(10)])
}

/// The revision of a spec's hooks: the code hash's digits.
pub fn revision_of(spec: &HookChainSpec) -> String {
    spec.code_hash().trim_start_matches("sha256:").to_string()
}

/// Where a chain's rollout stands (`status.rollout`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RolloutState {
    /// The revision that serves every session not in a canary.
    pub live_revision: String,
    /// The revision being rolled out (spec.hooks), while it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub candidate_revision: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy: Option<RolloutStrategy>,
    /// RolledOut, Shadowing, Progressing (a canary) or RolledBack.
    pub phase: String,
    /// Percent of sessions the candidate serves (a canary).
    #[serde(default)]
    pub canary_percent: u32,
    /// The canary's step (index into spec.rollout.steps).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<u32>,
    /// When the step began (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_started_at: Option<String>,
    /// The revision last rolled back: applied again, it stays out until the hooks change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rolled_back_revision: Option<String>,
    /// Where the rollout stands, in a sentence.
    pub message: String,
    /// How a shadow candidate compares with the live hooks, one entry per gateway, each written
    /// by that gateway (server-side apply, a field manager of its own) about its own traffic.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["gateway"]))]
    pub shadow: Vec<GatewayShadow>,
}

/// One gateway's shadow comparison (`status.rollout.shadow[]`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GatewayShadow {
    /// The gateway (its pod name).
    pub gateway: String,
    /// The candidate compared.
    pub candidate_revision: String,
    /// Shadow runs compared.
    pub runs: u64,
    /// Same action and payload as the live answer.
    pub agreed: u64,
    /// Another top action.
    pub action_differs: u64,
    /// The same action, another payload.
    pub output_differs: u64,
    /// Runs in which a hook of the candidate failed.
    pub errors: u64,
    /// Shadow runs not made (no budget, no free sandbox).
    pub dropped: u64,
    /// Percent of compared runs that disagreed, e.g. "12.5".
    pub disagreement_percent: String,
    /// When the gateway wrote this (RFC 3339).
    pub updated_at: String,
}

/// The field manager under which one gateway writes its shadow entry.
pub fn gateway_field_manager(identity: &str) -> String {
    let mut m = format!("sluice-gateway-{identity}");
    m.truncate(128);
    m
}

/// What `advance` did, for an Event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transition {
    Started(RolloutStrategy),
    Step(u32),
    Promoted(String),
    RolledBack(String),
}

impl Transition {
    /// The Event's reason.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Started(_) => "RolloutStarted",
            Self::Step(_) => "CanaryStep",
            Self::Promoted(_) => "Promoted",
            Self::RolledBack(_) => "RolledBack",
        }
    }
}

/// Whether an order (a revision prefix of at least 7 digits) names `revision`.
pub fn names(order: Option<&String>, revision: &str) -> bool {
    order.is_some_and(|o| o.len() >= 7 && revision.starts_with(o.as_str()))
}

fn short(revision: &str) -> &str {
    &revision[..revision.len().min(10)]
}

/// The state after `previous` given the spec, the annotations' orders and the time: the new state,
/// what happened (if anything), and when to look again (a canary's step ends). `now` and the
/// timestamps are seconds since the Unix epoch.
pub fn advance(
    previous: Option<&RolloutState>,
    spec: &HookChainSpec,
    orders: &RolloutOrders,
    now: i64,
    timestamp: impl Fn(i64) -> String,
    parse: impl Fn(&str) -> Option<i64>,
) -> (RolloutState, Option<Transition>, Option<Duration>) {
    let revision = revision_of(spec);
    let live = |rev: &str, message: String| RolloutState {
        live_revision: rev.to_string(),
        phase: "RolledOut".into(),
        message,
        ..Default::default()
    };
    let Some(prev) = previous.filter(|p| !p.live_revision.is_empty()) else {
        return (
            live(&revision, format!("revision {} is live", short(&revision))),
            None,
            None,
        );
    };
    if prev.live_revision == revision {
        let promoted = prev.candidate_revision.as_deref() == Some(revision.as_str());
        return (
            live(&revision, format!("revision {} is live", short(&revision))),
            promoted.then(|| Transition::Promoted(revision.clone())),
            None,
        );
    }
    let Some(rollout) = &spec.rollout else {
        return (
            live(
                &revision,
                format!(
                    "revision {} is live (no spec.rollout: at once)",
                    short(&revision)
                ),
            ),
            Some(Transition::Promoted(revision.clone())),
            None,
        );
    };
    let rolled_back = |why: String| RolloutState {
        live_revision: prev.live_revision.clone(),
        phase: "RolledBack".into(),
        rolled_back_revision: Some(revision.clone()),
        message: format!("revision {} was rolled back: {why}", short(&revision)),
        ..Default::default()
    };
    if names(orders.rollback.as_ref(), &revision) {
        let already = prev.rolled_back_revision.as_deref() == Some(revision.as_str());
        let why = "the sluice.dev/rollback annotation names it".to_string();
        return (
            rolled_back(why.clone()),
            (!already).then_some(Transition::RolledBack(why)),
            None,
        );
    }
    if names(orders.promote.as_ref(), &revision) {
        return (
            live(
                &revision,
                format!(
                    "revision {} is live (promoted by sluice.dev/promote)",
                    short(&revision)
                ),
            ),
            Some(Transition::Promoted(revision.clone())),
            None,
        );
    }
    if prev.rolled_back_revision.as_deref() == Some(revision.as_str()) {
        return (prev.clone(), None, None);
    }
    let step_duration =
        crate::duration::parse_duration(&rollout.step_duration).unwrap_or(Duration::from_secs(60));
    let same = prev.candidate_revision.as_deref() == Some(revision.as_str())
        && prev.strategy == Some(rollout.strategy);
    let (mut step, mut started, mut transition) = if same {
        (
            prev.step.unwrap_or(0),
            prev.step_started_at
                .as_deref()
                .and_then(&parse)
                .unwrap_or(now),
            None,
        )
    } else {
        (0, now, Some(Transition::Started(rollout.strategy)))
    };
    let mut next = None;
    if rollout.strategy == RolloutStrategy::Canary {
        let secs = step_duration.as_secs().max(1) as i64;
        while now >= started + secs {
            if step as usize + 1 >= rollout.steps.len() {
                return (
                    live(
                        &revision,
                        format!(
                            "revision {} is live (its last canary step passed)",
                            short(&revision)
                        ),
                    ),
                    Some(Transition::Promoted(revision.clone())),
                    None,
                );
            }
            step += 1;
            started += secs;
            transition = Some(Transition::Step(rollout.steps[step as usize]));
        }
        next = Some(Duration::from_secs((started + secs - now).max(1) as u64));
    }
    let (phase, percent, message) = match rollout.strategy {
        RolloutStrategy::Shadow => (
            "Shadowing",
            0,
            format!(
                "revision {} runs in shadow beside {}",
                short(&revision),
                short(&prev.live_revision)
            ),
        ),
        RolloutStrategy::Canary => {
            let percent = rollout.steps.get(step as usize).copied().unwrap_or(100);
            (
                "Progressing",
                percent,
                format!(
                    "revision {} serves {percent}% of sessions (step {} of {})",
                    short(&revision),
                    step + 1,
                    rollout.steps.len()
                ),
            )
        }
    };
    (
        RolloutState {
            live_revision: prev.live_revision.clone(),
            candidate_revision: Some(revision),
            strategy: Some(rollout.strategy),
            phase: phase.into(),
            canary_percent: percent,
            step: (rollout.strategy == RolloutStrategy::Canary).then_some(step),
            step_started_at: (rollout.strategy == RolloutStrategy::Canary)
                .then(|| timestamp(started)),
            rolled_back_revision: None,
            message,
            shadow: Vec::new(),
        },
        transition,
        next,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(tag: &str, rollout: serde_json::Value) -> HookChainSpec {
        let mut s = json!({"target": "bot", "triggerPoint": "input", "hooks": [
            {"name": "h", "action": "modify", "code": format!("def execute(c, s):\n    return {{'action': 'modify', 'outgoing': '{tag}'}}\n")}
        ]});
        if !rollout.is_null() {
            s["rollout"] = rollout;
        }
        serde_json::from_value(s).expect("a valid spec")
    }

    fn step(
        prev: Option<&RolloutState>,
        spec: &HookChainSpec,
        orders: &RolloutOrders,
        now: i64,
    ) -> (RolloutState, Option<Transition>, Option<Duration>) {
        advance(
            prev,
            spec,
            orders,
            now,
            |t| t.to_string(),
            |s| s.parse().ok(),
        )
    }

    #[test]
    fn a_canary_climbs_its_steps_on_schedule_and_is_promoted_after_the_last() {
        let none = RolloutOrders::default();
        let v1 = spec("v1", serde_json::Value::Null);
        let v2 = spec(
            "v2",
            json!({"strategy": "Canary", "steps": [10, 50], "stepDuration": "1m"}),
        );
        let (s, t, _) = step(None, &v1, &none, 0);
        assert_eq!((s.phase.as_str(), t), ("RolledOut", None));
        let (s, t, next) = step(Some(&s), &v2, &none, 100);
        assert_eq!(s.phase, "Progressing");
        assert_eq!(s.canary_percent, 10);
        assert_eq!(s.live_revision, revision_of(&v1));
        assert_eq!(t, Some(Transition::Started(RolloutStrategy::Canary)));
        assert_eq!(next, Some(Duration::from_secs(60)));
        let (s, t, _) = step(Some(&s), &v2, &none, 130);
        assert_eq!((s.canary_percent, t), (10, None), "not before its minute");
        let (s, t, _) = step(Some(&s), &v2, &none, 161);
        assert_eq!((s.canary_percent, t), (50, Some(Transition::Step(50))));
        let (s, t, _) = step(Some(&s), &v2, &none, 221);
        assert_eq!(s.phase, "RolledOut");
        assert_eq!(s.live_revision, revision_of(&v2));
        assert_eq!(t, Some(Transition::Promoted(revision_of(&v2))));
    }

    #[test]
    fn a_rollback_order_keeps_the_live_revision_and_the_candidate_out_until_the_hooks_change() {
        let v1 = spec("v1", serde_json::Value::Null);
        let v2 = spec("v2", json!({"strategy": "Shadow"}));
        let (s, _, _) = step(None, &v1, &RolloutOrders::default(), 0);
        let (s, _, _) = step(Some(&s), &v2, &RolloutOrders::default(), 1);
        assert_eq!(s.phase, "Shadowing");
        let stale = RolloutOrders {
            rollback: Some("0000000".into()),
            ..Default::default()
        };
        assert_eq!(step(Some(&s), &v2, &stale, 2).0.phase, "Shadowing");
        let order = RolloutOrders {
            rollback: Some(revision_of(&v2)[..8].into()),
            ..Default::default()
        };
        let (s, t, _) = step(Some(&s), &v2, &order, 3);
        assert_eq!(s.phase, "RolledBack");
        assert_eq!(s.live_revision, revision_of(&v1));
        assert!(matches!(t, Some(Transition::RolledBack(_))));
        // The order stays on the object: no second event; without it the rollback still holds.
        assert_eq!(step(Some(&s), &v2, &order, 4).1, None);
        assert_eq!(
            step(Some(&s), &v2, &RolloutOrders::default(), 5).0.phase,
            "RolledBack"
        );
        // New hooks start a new rollout.
        let v3 = spec("v3", json!({"strategy": "Shadow"}));
        assert_eq!(step(Some(&s), &v3, &order, 6).0.phase, "Shadowing");
        // Removing spec.rollout promotes.
        let (s, t, _) = step(Some(&s), &spec("v2", serde_json::Value::Null), &order, 7);
        assert_eq!(s.live_revision, revision_of(&v2));
        assert!(matches!(t, Some(Transition::Promoted(_))));
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
