//! The HookChain status the operator reports: `CodeValid`, `PoolReady` and `Ready` conditions with
//! reasons a platform engineer can act on, the warm and claimed counts, the code hash and the
//! generation they describe. Pure: the reconciler writes the result with server-side apply.

use crate::reconcile::decide::pool::{Hold, Plan};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use sluice_crds::cpu::SandboxCpuLimit;
use sluice_crds::{HookChain, HookChainStatus};

pub const CODE_VALID: &str = "CodeValid";
pub const POOL_READY: &str = "PoolReady";
pub const READY: &str = "Ready";
pub const ROLLED_OUT: &str = "RolledOut";
/// Whether one walk of the chain fits in one CFS period of the platform's sandbox CPU limit.
pub const CPU_SUFFICIENT: &str = "CpuSufficient";

/// The verdict on a chain's spec, hook code and capabilities.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// "True", "False" or "Unknown" (the checker could not run).
    pub status: &'static str,
    pub reason: &'static str,
    pub message: String,
}

impl Verdict {
    pub fn is_invalid(&self) -> bool {
        self.status == "False"
    }
}

/// A condition whose `lastTransitionTime` stays as it was unless its status flips.
pub fn condition(
    previous: &[Condition],
    type_: &str,
    status: &str,
    reason: &str,
    message: String,
    generation: Option<i64>,
    now: Timestamp,
) -> Condition {
    let since = previous
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or(Time(now));
    Condition {
        type_: type_.to_string(),
        status: status.to_string(),
        reason: reason.to_string(),
        message,
        observed_generation: generation,
        last_transition_time: since,
    }
}

/// `CpuSufficient`: (status, reason, message). Not part of `Ready`: a throttled chain serves, slowly.
pub fn cpu_sufficient(
    hooks: usize,
    limit: SandboxCpuLimit,
) -> (&'static str, &'static str, String) {
    match limit.walk_fits(hooks) {
        Ok(()) if limit.0.is_none() => (
            "True",
            "NoLimit",
            "sandboxes have no CPU limit (the platform's --sandbox-cpu-limit is none)".into(),
        ),
        Ok(()) => (
            "True",
            "WalkFits",
            format!(
                "a walk of {hooks} hooks takes about {} ms of CPU, within the {} ms per {} ms period of the sandbox CPU limit ({limit})",
                sluice_crds::cpu::walk_cpu(hooks).as_millis(),
                limit.quota().unwrap_or_default().as_millis(),
                sluice_crds::cpu::CFS_PERIOD.as_millis()
            ),
        ),
        Err(throttled) => ("False", "WalkThrottled", throttled.to_string()),
    }
}

/// `PoolReady` from the pool plan: (status, reason, message).
pub fn pool_ready(warm_target: u32, max: u32, plan: &Plan) -> (&'static str, &'static str, String) {
    let c = &plan.counts;
    let have = format!("{} of {} warm sandboxes ready", c.warm, warm_target);
    if c.warm >= warm_target {
        return ("True", "Ready", format!("{have}, {} claimed", c.claimed));
    }
    match &plan.hold {
        Some(Hold::Invalid) => (
            "False",
            "Paused",
            format!("{have}; no new sandboxes until CodeValid is True"),
        ),
        Some(Hold::Unschedulable { pod, message }) => (
            "False",
            "Unschedulable",
            format!(
                "{have}; pod {pod} cannot be scheduled: {message} (held, not recreated; check the runtime class, node capacity or spec.resources)"
            ),
        ),
        Some(Hold::StartFailing { message }) => (
            "False",
            "StartFailing",
            format!(
                "{have}; {message} (replaced one at a time until one starts; check --supervisor-image, the runtime class handler on the nodes, whether the supervisor can make cells there (its log says), and the startup probe)"
            ),
        ),
        Some(Hold::AtMax) if warm_target > max => (
            "False",
            "AtMax",
            format!("{have}; spec.pool.warm={warm_target} is more than spec.pool.max={max}"),
        ),
        Some(Hold::AtMax) => (
            "False",
            "AtMax",
            format!(
                "{have}; the pool is at spec.pool.max={max} ({} claimed, {} starting, {} terminating)",
                c.claimed, c.starting, c.terminating
            ),
        ),
        Some(Hold::AwaitingCache) | None => (
            "False",
            "Starting",
            match &plan.start_problem {
                Some(why) => format!("{have}, {} starting; {why}", c.starting),
                None => format!("{have}, {} starting", c.starting),
            },
        ),
    }
}

/// The whole status for `chain` from the verdict and the pool plan.
pub fn status(
    chain: &HookChain,
    verdict: &Verdict,
    plan: &Plan,
    rollout: Option<sluice_crds::rollout::RolloutState>,
    cpu_limit: SandboxCpuLimit,
    now: Timestamp,
) -> HookChainStatus {
    let previous = chain
        .status
        .as_ref()
        .map(|s| s.conditions.as_slice())
        .unwrap_or_default();
    let generation = chain.metadata.generation;
    let code = condition(
        previous,
        CODE_VALID,
        verdict.status,
        verdict.reason,
        verdict.message.clone(),
        generation,
        now,
    );
    let (ps, pr, pm) = pool_ready(chain.spec.pool.warm, chain.spec.pool.max, plan);
    let pool = condition(previous, POOL_READY, ps, pr, pm, generation, now);
    let (rs, rr, rm) = if verdict.is_invalid() {
        ("False", verdict.reason, verdict.message.clone())
    } else if ps != "True" {
        ("False", pr, pool.message.clone())
    } else {
        (
            "True",
            "Ready",
            "the chain's code is valid and its warm pool is full".into(),
        )
    };
    let ready = condition(previous, READY, rs, rr, rm, generation, now);
    let (cs, cr, cm) = cpu_sufficient(chain.spec.hooks.len(), cpu_limit);
    let cpu = condition(previous, CPU_SUFFICIENT, cs, cr, cm, generation, now);
    let mut conditions = vec![ready, code, pool, cpu];
    // `kubectl wait --for=condition=RolledOut`: true once spec.hooks are what serves everyone.
    if let Some(r) = &rollout {
        let current = r.phase == "RolledOut"
            && r.live_revision == sluice_crds::rollout::revision_of(&chain.spec);
        let (status, reason) = if current {
            ("True", "RolledOut")
        } else if r.phase == "RolledOut" {
            // The newest hooks fail their checks: the live ones keep serving (CodeValid says why).
            ("False", "NotValid")
        } else {
            ("False", r.phase.as_str())
        };
        conditions.push(condition(
            previous,
            ROLLED_OUT,
            status,
            reason,
            r.message.clone(),
            generation,
            now,
        ));
    }
    HookChainStatus {
        observed_generation: generation,
        warm: plan.counts.warm,
        claimed: plan.counts.claimed,
        code_hash: Some(chain.spec.code_hash()),
        conditions,
        rollout,
    }
}

/// The status of an object that could not even be read as a HookChain.
pub fn unreadable(
    previous: &[Condition],
    error: &str,
    generation: Option<i64>,
    now: Timestamp,
) -> Vec<Condition> {
    let message = format!("the object does not match the HookChain schema: {error}");
    vec![
        condition(
            previous,
            READY,
            "False",
            "InvalidObject",
            message.clone(),
            generation,
            now,
        ),
        condition(
            previous,
            CODE_VALID,
            "False",
            "InvalidObject",
            message,
            generation,
            now,
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcile::decide::pool::Counts;

    fn t(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    #[test]
    fn the_status_says_when_a_walk_cannot_fit_the_sandbox_cpu_limit() {
        let (status, reason, _) = cpu_sufficient(3, SandboxCpuLimit::default());
        assert_eq!((status, reason), ("True", "WalkFits"));
        let (status, reason, message) = cpu_sufficient(3, SandboxCpuLimit(Some(100)));
        assert_eq!((status, reason), ("False", "WalkThrottled"));
        assert!(message.contains("--sandbox-cpu-limit"), "{message}");
        assert_eq!(cpu_sufficient(40, SandboxCpuLimit(None)).1, "NoLimit");
    }

    #[test]
    fn transition_time_changes_only_when_the_status_flips() {
        let t1 = t("2026-01-01T00:00:00Z");
        let t2 = t("2026-01-01T00:05:00Z");
        let first = condition(&[], READY, "False", "Starting", "a".into(), Some(1), t1);
        let same = condition(
            std::slice::from_ref(&first),
            READY,
            "False",
            "AtMax",
            "b".into(),
            Some(2),
            t2,
        );
        assert_eq!(same.last_transition_time, Time(t1));
        assert_eq!(
            (same.reason.as_str(), same.message.as_str()),
            ("AtMax", "b")
        );
        let flipped = condition(&[same], READY, "True", "Ready", "c".into(), Some(2), t2);
        assert_eq!(flipped.last_transition_time, Time(t2));
    }

    #[test]
    fn pool_ready_says_why_the_pool_is_short() {
        let mut plan = Plan {
            counts: Counts {
                warm: 1,
                claimed: 3,
                starting: 0,
                terminating: 1,
                other: 0,
                lost: 0,
                leaving: 0,
                total: 5,
            },
            hold: Some(Hold::AtMax),
            ..Default::default()
        };
        let (s, r, m) = pool_ready(2, 5, &plan);
        assert_eq!((s, r), ("False", "AtMax"));
        assert!(
            m.contains("1 of 2") && m.contains("spec.pool.max=5") && m.contains("3 claimed"),
            "{m}"
        );
        plan.hold = Some(Hold::Unschedulable {
            pod: "p-1".into(),
            message: "Insufficient cpu".into(),
        });
        let (_, r, m) = pool_ready(2, 5, &plan);
        assert_eq!(r, "Unschedulable");
        assert!(m.contains("p-1") && m.contains("Insufficient cpu"), "{m}");
        plan.hold = Some(Hold::AtMax);
        let (_, _, m) = pool_ready(9, 5, &plan);
        assert!(
            m.contains("spec.pool.warm=9 is more than spec.pool.max=5"),
            "{m}"
        );
        plan.counts.warm = 2;
        assert_eq!(pool_ready(2, 5, &plan).0, "True");
    }
}
