//! The pool decision: given a chain's pool spec, the pods the cache shows and what the operator is
//! still waiting to see (expectations), which pods to delete and how many to create. A pure
//! function, so the backfill discipline is proven by plain unit tests:
//!
//! - never create while a create is not yet visible in the cache (a lagging cache would otherwise
//!   make the operator create the same pods twice);
//! - count terminating pods (and pods just deleted) toward `max`;
//! - hold unschedulable pods instead of deleting and recreating them, and create no more beside them;
//! - roll warm pods of an old template, keeping old ready ones only while new ones are not ready;
//! - never touch a claimed pod, unless its claim is past the deadline (its gateway is gone); mark one
//!   on a cordoned or lost node `draining`, so its gateway gives it back when its trigger point ends;
//! - make warm pods again ahead of a drain: a cordoned node's warm pods serve on until evicted but
//!   count as leaving; a lost node's are deleted, and no pod of a lost node counts toward `max` (it
//!   cannot serve, and may stay Terminating until the node comes back);
//! - replace a pod that never becomes ready within the start deadline (bad image, missing runtime
//!   handler, failing probe), but only one at a time while the template has not proven it can
//!   start, so a broken image does not churn.

use crate::reconcile::build::{
    ANNOTATION_CLAIMED_AT, ANNOTATION_DRAINING, LABEL_POOL, LABEL_TEMPLATE, POOL_CLAIMED, POOL_WARM,
};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use std::collections::HashSet;

/// What the pool needs to know about one pod.
#[derive(Clone, Debug, PartialEq)]
pub struct Observed {
    pub name: String,
    pub resource_version: Option<String>,
    pub template: Option<String>,
    pub pool: PoolState,
    /// `Failed` or `Succeeded`: the pod will never serve again.
    pub finished: bool,
    pub ready: bool,
    pub terminating: bool,
    /// The scheduler's message, when the pod is `PodScheduled=False` for reason `Unschedulable`.
    pub unschedulable: Option<String>,
    pub created: Option<Timestamp>,
    /// When the scheduler placed it (`PodScheduled=True`): its start deadline counts from here, not
    /// from creation, so a pod that waited for a node (an autoscaler adding one) gets its full time.
    pub scheduled: Option<Timestamp>,
    /// `sluice.dev/claimed-at`, when present and a valid RFC 3339 time. Anyone who can patch pods
    /// writes it: `plan` clamps it to now and never lets it overflow.
    pub claimed_at: Option<Timestamp>,
    /// Why a pod that is not ready is not: the container's waiting reason and message, a sandbox
    /// that does not start, a startup probe that does not pass.
    pub problem: Option<String>,
    /// Where its node stands (`Observed::on_node`; `Serving` when unknown).
    pub node: NodeState,
    /// Already marked `sluice.dev/draining`.
    pub draining: bool,
}

/// Where a pod's node stands, from the operator's node cache.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum NodeState {
    /// Schedulable and Ready; also a pod not scheduled yet, or a node the cache does not show (the
    /// operator may not be allowed to watch nodes: then nothing here changes the pool).
    #[default]
    Serving,
    /// `spec.unschedulable` (cordoned, as a drain does first): its node is being taken out of
    /// service. Holds the node's name.
    Cordoned(String),
    /// Not Ready, or tainted unreachable or not-ready by the node controller: its pods cannot
    /// serve. Holds the node's name.
    Lost(String),
}

impl NodeState {
    /// What the `sluice.dev/draining` annotation of a claimed pod on this node says.
    fn why(&self) -> Option<String> {
        match self {
            NodeState::Serving => None,
            NodeState::Cordoned(n) => Some(format!("node {n} is cordoned")),
            NodeState::Lost(n) => Some(format!("node {n} is not ready")),
        }
    }
}

/// Longest pod problem quoted in conditions and Events.
const MAX_PROBLEM: usize = 300;

fn bounded(s: String) -> String {
    crate::reconcile::text::bounded(s, MAX_PROBLEM)
}

/// Why `pod` is not ready, in the words of its status.
fn not_ready_problem(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    let conditions = status.conditions.as_deref().unwrap_or_default();
    let condition = |t: &str| conditions.iter().find(|c| c.type_ == t);
    let with_message = |reason: &str, message: Option<&String>| match message {
        Some(m) if !m.is_empty() => format!("{reason}: {m}"),
        _ => reason.to_string(),
    };
    let sandbox = "ContainerCreating: the pod sandbox has not started (see the pod's \
                   FailedCreatePodSandBox events: is the runtime class handler, runsc, installed \
                   on the node?)";
    let sandbox_down = condition("PodReadyToStartContainers").is_some_and(|c| c.status == "False");
    let containers = status
        .init_container_statuses
        .iter()
        .flatten()
        .chain(status.container_statuses.iter().flatten());
    for c in containers {
        let state = c.state.as_ref();
        if let Some(w) = state.and_then(|s| s.waiting.as_ref()) {
            let reason = w.reason.as_deref().unwrap_or("Waiting");
            if matches!(reason, "ContainerCreating" | "PodInitializing") {
                if sandbox_down {
                    return Some(sandbox.into());
                }
                continue;
            }
            return Some(bounded(with_message(reason, w.message.as_ref())));
        }
        if let Some(t) = state.and_then(|s| s.terminated.as_ref()) {
            let reason = t.reason.as_deref().unwrap_or("Terminated");
            return Some(bounded(with_message(
                &format!("{reason} (exit code {})", t.exit_code),
                t.message.as_ref(),
            )));
        }
        if state.and_then(|s| s.running.as_ref()).is_some() && !c.ready {
            return Some(format!(
                "container {} is running but its startup probe has not passed",
                c.name
            ));
        }
    }
    if sandbox_down {
        return Some(sandbox.into());
    }
    None
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolState {
    Warm,
    Claimed,
    /// A label the operator does not know: the pod is left alone but counts toward max.
    Other,
}

impl Observed {
    pub fn from_pod(pod: &Pod) -> Self {
        let meta = &pod.metadata;
        let label = |k: &str| meta.labels.as_ref().and_then(|l| l.get(k)).cloned();
        let status = pod.status.as_ref();
        let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or_default();
        let conditions = status.and_then(|s| s.conditions.as_ref());
        let condition = |t: &str| conditions.and_then(|cs| cs.iter().find(|c| c.type_ == t));
        let ready = condition("Ready").is_some_and(|c| c.status == "True");
        let unschedulable = condition("PodScheduled")
            .filter(|c| c.status == "False" && c.reason.as_deref() == Some("Unschedulable"))
            .map(|c| c.message.clone().unwrap_or_else(|| "no node fits".into()));
        Observed {
            name: meta.name.clone().unwrap_or_default(),
            resource_version: meta.resource_version.clone(),
            template: label(LABEL_TEMPLATE),
            pool: match label(LABEL_POOL).as_deref() {
                Some(POOL_WARM) => PoolState::Warm,
                Some(POOL_CLAIMED) => PoolState::Claimed,
                _ => PoolState::Other,
            },
            finished: matches!(phase, "Failed" | "Succeeded"),
            ready,
            terminating: meta.deletion_timestamp.is_some(),
            unschedulable,
            created: meta.creation_timestamp.as_ref().map(|t| t.0),
            scheduled: condition("PodScheduled")
                .filter(|c| c.status == "True")
                .and_then(|c| c.last_transition_time.as_ref())
                .map(|t| t.0),
            // Unparseable: as if absent (the claim is timed from the pod's creation).
            claimed_at: meta
                .annotations
                .as_ref()
                .and_then(|a| a.get(ANNOTATION_CLAIMED_AT))
                .and_then(|v| v.parse::<Timestamp>().ok()),
            problem: if ready { None } else { not_ready_problem(pod) },
            node: NodeState::Serving,
            draining: meta
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(ANNOTATION_DRAINING)),
        }
    }

    /// The same, on a node that stands as `node` does.
    pub fn on_node(self, node: NodeState) -> Self {
        Self { node, ..self }
    }
}

/// Everything the decision depends on.
#[derive(Clone, Debug)]
pub struct Input<'a> {
    pub warm: u32,
    pub max: u32,
    /// Template hash of the pod the chain wants now.
    pub template: &'a str,
    pub pods: &'a [Observed],
    /// Pods created but not yet seen in the cache.
    pub pending_creates: usize,
    /// Pods deleted whose deletion the cache does not show yet.
    pub pending_deletes: &'a HashSet<String>,
    pub now: Timestamp,
    pub claim_deadline: SignedDuration,
    /// A warm pod of the current template not ready this long after it was scheduled (or created,
    /// while it is not) is replaced (unless the scheduler cannot place it: that one is held).
    pub start_deadline: SignedDuration,
    /// Pods of the current template that failed to start in a row (the reconciler remembers;
    /// reset once one of the template's pods is ready).
    pub start_failures: u32,
    /// The last of those failures, `pod x: why`.
    pub last_start_failure: Option<&'a str>,
    /// False for an invalid or deleted chain: only clean-up, no growth, no rollout.
    pub may_grow: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeleteReason {
    /// The pod's phase is Failed or Succeeded.
    Finished,
    /// Claimed longer than the claim deadline: its gateway crashed or lost it.
    ClaimExpired,
    /// A warm pod of an old template.
    Outdated,
    /// More warm pods than `spec.pool.warm`.
    ScaleDown,
    /// Not ready within the start deadline.
    StartTimeout,
    /// A warm pod on a lost node: it cannot serve.
    NodeLost,
}

impl DeleteReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Finished => "finished",
            Self::ClaimExpired => "claim_expired",
            Self::Outdated => "outdated",
            Self::ScaleDown => "scale_down",
            Self::StartTimeout => "start_timeout",
            Self::NodeLost => "node_lost",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Deletion {
    pub name: String,
    pub reason: DeleteReason,
    /// Warm pods are deleted on condition they are unchanged, so a pod a gateway claims in the
    /// meantime survives (the delete fails with a conflict).
    pub resource_version: Option<String>,
}

/// Why the pool is not growing to `warm`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Hold {
    /// The chain is invalid or being deleted.
    Invalid,
    /// Created pods are not in the cache yet.
    AwaitingCache,
    /// A pod of the current template cannot be scheduled (the scheduler's message).
    Unschedulable { pod: String, message: String },
    /// Pods of the current template keep failing to start (`pod x: why`): they are replaced one
    /// at a time until one becomes ready.
    StartFailing { message: String },
    /// `max` pods exist (warm, claimed, starting and terminating together).
    AtMax,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Ready warm pods that stay (any template).
    pub warm: u32,
    pub claimed: u32,
    /// Warm pods of the current template not ready yet, pending creates included.
    pub starting: u32,
    /// Terminating, just deleted, or deleted by this plan.
    pub terminating: u32,
    /// Pods with a pool label the operator does not know: left alone, counted toward max.
    pub other: u32,
    /// Pods on lost nodes: they cannot serve, and are not counted toward max.
    pub lost: u32,
    /// Warm pods on cordoned nodes: they serve until the drain evicts them, but are made again
    /// elsewhere meanwhile (counted toward max).
    pub leaving: u32,
    /// Every pod counted toward `max`.
    pub total: u32,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub create: u32,
    pub delete: Vec<Deletion>,
    pub counts: Counts,
    pub hold: Option<Hold>,
    /// When the next claimed pod's deadline passes, so the caller can requeue for it.
    pub next_claim_expiry: Option<Timestamp>,
    /// When the next starting pod's start deadline passes.
    pub next_start_deadline: Option<Timestamp>,
    /// Pods deleted by this plan for not starting in time, as (pod, why).
    pub start_failed: Vec<(String, String)>,
    /// Why a starting pod of the current template is not ready yet (`pod x: why`), if known.
    pub start_problem: Option<String>,
    /// A pod of the current template is ready: the template can start.
    pub template_proven: bool,
    /// Claimed pods on cordoned or lost nodes to mark `sluice.dev/draining`, as (pod, why).
    pub drain: Vec<(String, String)>,
}

fn u(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The pool's plan: sort the pods, roll and scale down, count, make room at `max`, decide what holds
/// the pool back, and how many pods to create.
pub fn plan(input: &Input) -> Plan {
    let mut draft = Draft::default();
    let mut sorted = draft.sort(input);
    draft.plan.template_proven = !sorted.cur_ready.is_empty()
        || input
            .pods
            .iter()
            .any(|p| p.ready && !p.finished && p.template.as_deref() == Some(input.template));
    let start_failing = draft.start_failing(input);
    let kept_old = if input.may_grow {
        draft.roll_and_scale_down(input, &mut sorted)
    } else {
        sorted.old_ready.len()
    };
    draft.count(input, &sorted, kept_old);
    let (want, room) = draft.want_and_room(input, &sorted);
    draft.make_room_at_max(input, &sorted, kept_old, want, room);
    draft.plan.hold = hold(input, &sorted, start_failing, want, room);
    draft.plan.create = match draft.plan.hold {
        None | Some(Hold::AtMax) => want.min(room),
        // One pod starting at a time, pending creates included.
        Some(Hold::StartFailing { .. }) => want
            .min(room)
            .min(1u32.saturating_sub(u(sorted.cur_starting.len() + input.pending_creates))),
        _ => 0,
    };
    draft.plan.counts = draft.counts;
    draft.plan
}

/// The warm pods that stay after the first pass, by template and readiness.
#[derive(Default)]
struct Sorted<'a> {
    cur_ready: Vec<&'a Observed>,
    cur_starting: Vec<&'a Observed>,
    old_ready: Vec<&'a Observed>,
    /// The first pod of the current template the scheduler cannot place.
    unschedulable: Option<&'a Observed>,
}

/// The plan being made and its counts.
#[derive(Default)]
struct Draft {
    plan: Plan,
    counts: Counts,
}

// === impl Draft ===

impl Draft {
    /// Deletes `p` (on condition it is unchanged when `precondition`), counted as terminating.
    fn delete(&mut self, p: &Observed, reason: DeleteReason, precondition: bool) {
        self.plan.delete.push(Deletion {
            name: p.name.clone(),
            reason,
            resource_version: if precondition {
                p.resource_version.clone()
            } else {
                None
            },
        });
        self.counts.terminating += 1;
    }

    /// Counts terminating, claimed and unknown pods, deletes finished ones, expired claims, pods
    /// that did not start in time and old pods not serving yet, and sorts the warm pods that stay.
    fn sort<'a>(&mut self, input: &Input<'a>) -> Sorted<'a> {
        let mut sorted = Sorted::default();
        let mut pods: Vec<&Observed> = input.pods.iter().collect();
        pods.sort_by(|a, b| a.name.cmp(&b.name));
        for p in pods {
            let gone = p.terminating || input.pending_deletes.contains(&p.name);
            if let NodeState::Lost(_) = p.node {
                // It cannot serve, and may stay Terminating until its node is back: not counted
                // toward max, so the pool is made again on the nodes that serve.
                self.counts.lost += 1;
                match p.pool {
                    PoolState::Warm if !gone => self.plan.delete.push(Deletion {
                        name: p.name.clone(),
                        reason: DeleteReason::NodeLost,
                        resource_version: p.resource_version.clone(),
                    }),
                    PoolState::Claimed if !gone => self.drain(p),
                    _ => {}
                }
                continue;
            }
            if gone {
                self.counts.terminating += 1;
                continue;
            }
            if p.finished {
                self.delete(p, DeleteReason::Finished, false);
                continue;
            }
            match p.pool {
                PoolState::Claimed => self.claimed(input, p),
                PoolState::Other => self.counts.other += 1,
                PoolState::Warm => self.warm(input, p, &mut sorted),
            }
        }
        sorted
    }

    /// Marks claimed `p` for its node's drain (once).
    fn drain(&mut self, p: &Observed) {
        if let (false, Some(why)) = (p.draining, p.node.why()) {
            self.plan.drain.push((p.name.clone(), why));
        }
    }

    fn claimed(&mut self, input: &Input, p: &Observed) {
        self.drain(p);
        // A claim without (a readable) claimed-at is timed from the pod's creation; a claim "from
        // the future" counts from now; an expiry past the end of time never comes.
        let since = p.claimed_at.or(p.created).map(|t| t.min(input.now));
        let expiry = since.and_then(|t| t.checked_add(input.claim_deadline).ok());
        match expiry {
            Some(e) if e <= input.now => self.delete(p, DeleteReason::ClaimExpired, false),
            _ => {
                self.counts.claimed += 1;
                if let Some(e) = expiry {
                    self.plan.next_claim_expiry =
                        Some(self.plan.next_claim_expiry.map_or(e, |n| n.min(e)));
                }
            }
        }
    }

    fn warm<'a>(&mut self, input: &Input, p: &'a Observed, sorted: &mut Sorted<'a>) {
        if let NodeState::Cordoned(_) = p.node {
            // It serves until the drain evicts it (when every node is cordoned, deleting it would
            // leave nothing), and is made again on another node now, not then.
            self.counts.leaving += 1;
            return;
        }
        let current = p.template.as_deref() == Some(input.template);
        let start_expiry = p
            .scheduled
            .or(p.created)
            .map(|t| t.min(input.now))
            .and_then(|t| t.checked_add(input.start_deadline).ok());
        match (current, p.ready) {
            (true, true) => sorted.cur_ready.push(p),
            (true, false) if p.unschedulable.is_some() => {
                // Held: deleting and recreating would not place it either.
                if sorted.unschedulable.is_none() {
                    sorted.unschedulable = Some(p);
                }
                sorted.cur_starting.push(p)
            }
            (true, false) if start_expiry.is_some_and(|e| e <= input.now) => {
                self.delete(p, DeleteReason::StartTimeout, true);
                let why = p
                    .problem
                    .clone()
                    .unwrap_or_else(|| "not ready (no reason reported)".into());
                self.plan.start_failed.push((p.name.clone(), why));
            }
            (true, false) => {
                if let Some(e) = start_expiry {
                    self.plan.next_start_deadline =
                        Some(self.plan.next_start_deadline.map_or(e, |n| n.min(e)));
                }
                if self.plan.start_problem.is_none()
                    && let Some(why) = &p.problem
                {
                    self.plan.start_problem = Some(format!("pod {}: {why}", p.name));
                }
                sorted.cur_starting.push(p)
            }
            (false, true) => sorted.old_ready.push(p),
            // An old pod that is not serving yet is replaced at once.
            (false, false) if input.may_grow => self.delete(p, DeleteReason::Outdated, true),
            (false, false) => self.counts.starting += 1,
        }
    }

    /// While the template's pods keep failing to start and none has started, they are replaced one
    /// at a time: a broken image or runtime handler costs one pod per start deadline, not a pool.
    /// The message of that hold, if so.
    fn start_failing(&self, input: &Input) -> Option<String> {
        let failures = input.start_failures as usize + self.plan.start_failed.len();
        (failures > 0 && !self.plan.template_proven).then(|| {
            let message = match (self.plan.start_failed.first(), input.last_start_failure) {
                (Some((pod, why)), _) => format!("pod {pod}: {why}"),
                (None, Some(last)) => last.to_string(),
                (None, None) => "pods of this template did not become ready".into(),
            };
            format!(
                "{failures} pod(s) in a row did not become ready within {}s; last: {message}",
                input.start_deadline.as_secs()
            )
        })
    }

    /// Old ready pods keep serving only until enough new ones are ready; pods beyond `warm` go.
    /// How many old ready pods stay.
    fn roll_and_scale_down(&mut self, input: &Input, sorted: &mut Sorted) -> usize {
        let warm = input.warm as usize;
        let kept_old = sorted
            .old_ready
            .len()
            .min(warm.saturating_sub(sorted.cur_ready.len()));
        for p in &sorted.old_ready[kept_old..] {
            self.delete(p, DeleteReason::Outdated, true);
        }
        // Scale down only against a settled cache: pending creates are invisible here.
        let current = sorted.cur_ready.len() + sorted.cur_starting.len() + input.pending_creates;
        if input.pending_creates == 0 && current > warm {
            // Pods that are not serving go first, newest (last by name is arbitrary) first.
            for _ in 0..current - warm {
                let Some(p) = sorted.cur_starting.pop().or_else(|| sorted.cur_ready.pop()) else {
                    break;
                };
                self.delete(p, DeleteReason::ScaleDown, true);
            }
        }
        kept_old
    }

    fn count(&mut self, input: &Input, sorted: &Sorted, kept_old: usize) {
        let c = &mut self.counts;
        c.starting += u(sorted.cur_starting.len() + input.pending_creates);
        c.warm = u(sorted.cur_ready.len() + kept_old);
        c.total = c.warm + c.claimed + c.starting + c.terminating + c.other + c.leaving;
    }

    /// Pods of the current template still to create for `warm`, and room left under `max`.
    fn want_and_room(&self, input: &Input, sorted: &Sorted) -> (u32, u32) {
        let have = sorted.cur_ready.len() + sorted.cur_starting.len() + input.pending_creates;
        let want = u((input.warm as usize).saturating_sub(have));
        (want, input.max.saturating_sub(self.counts.total))
    }

    /// At max during a rollout: old pods are retired one at a time to make room for new ones, the
    /// next only once the previous one is gone.
    fn make_room_at_max(
        &mut self,
        input: &Input,
        sorted: &Sorted,
        kept_old: usize,
        want: u32,
        room: u32,
    ) {
        let freeing = self.counts.terminating > 0 || input.pending_creates > 0;
        if want > 0 && room == 0 && kept_old > 0 && input.may_grow && !freeing {
            self.delete(sorted.old_ready[kept_old - 1], DeleteReason::Outdated, true);
            self.counts.warm -= 1;
        }
    }
}

/// Why the pool does not grow to `warm`, if it does not.
fn hold(
    input: &Input,
    sorted: &Sorted,
    start_failing: Option<String>,
    want: u32,
    room: u32,
) -> Option<Hold> {
    if !input.may_grow {
        Some(Hold::Invalid)
    } else if let Some(p) = sorted.unschedulable {
        Some(Hold::Unschedulable {
            pod: p.name.clone(),
            message: p.unschedulable.clone().unwrap_or_default(),
        })
    } else if let Some(message) = start_failing {
        Some(Hold::StartFailing { message })
    } else if input.pending_creates > 0 {
        Some(Hold::AwaitingCache)
    } else if want > room {
        Some(Hold::AtMax)
    } else {
        None
    }
}

/// Sizes of successive create batches for `n` pods: 1, 2, 4, … (slow start). A failing batch stops
/// the rest, so a quota or admission error costs one request, not `n`.
pub fn slow_start(n: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let (mut left, mut size) = (n, 1u32);
    while left > 0 {
        let b = size.min(left);
        out.push(b);
        left -= b;
        size = size.saturating_mul(2);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: &str = "tmpl-new";

    fn now() -> Timestamp {
        "2026-01-01T12:00:00Z".parse().unwrap()
    }

    fn pod(name: &str) -> Observed {
        Observed {
            name: name.into(),
            resource_version: Some(format!("rv-{name}")),
            template: Some(T.into()),
            pool: PoolState::Warm,
            finished: false,
            ready: true,
            terminating: false,
            unschedulable: None,
            created: Some(now() - SignedDuration::from_secs(3600)),
            scheduled: None,
            claimed_at: None,
            problem: None,
            node: NodeState::Serving,
            draining: false,
        }
    }

    fn starting(name: &str) -> Observed {
        Observed {
            ready: false,
            created: Some(now() - SignedDuration::from_secs(10)),
            ..pod(name)
        }
    }

    fn old(name: &str) -> Observed {
        Observed {
            template: Some("tmpl-old".into()),
            ..pod(name)
        }
    }

    fn claimed(name: &str, secs_ago: i64) -> Observed {
        Observed {
            pool: PoolState::Claimed,
            claimed_at: Some(now() - SignedDuration::from_secs(secs_ago)),
            ..pod(name)
        }
    }

    struct Case {
        warm: u32,
        max: u32,
        pods: Vec<Observed>,
        pending_creates: usize,
        pending_deletes: HashSet<String>,
        may_grow: bool,
        start_failures: u32,
        last_start_failure: Option<String>,
    }

    fn case(warm: u32, max: u32, pods: Vec<Observed>) -> Case {
        Case {
            warm,
            max,
            pods,
            pending_creates: 0,
            pending_deletes: HashSet::new(),
            may_grow: true,
            start_failures: 0,
            last_start_failure: None,
        }
    }

    impl Case {
        fn run(&self) -> Plan {
            plan(&Input {
                warm: self.warm,
                max: self.max,
                template: T,
                pods: &self.pods,
                pending_creates: self.pending_creates,
                pending_deletes: &self.pending_deletes,
                now: now(),
                claim_deadline: SignedDuration::from_secs(300),
                start_deadline: SignedDuration::from_secs(120),
                start_failures: self.start_failures,
                last_start_failure: self.last_start_failure.as_deref(),
                may_grow: self.may_grow,
            })
        }
    }

    fn deleted(p: &Plan) -> Vec<(&str, DeleteReason)> {
        p.delete
            .iter()
            .map(|d| (d.name.as_str(), d.reason.clone()))
            .collect()
    }

    #[test]
    fn an_empty_pool_fills_to_warm() {
        let p = case(3, 10, vec![]).run();
        assert_eq!((p.create, p.delete.len(), p.hold), (3, 0, None));
    }

    #[test]
    fn a_full_pool_does_nothing() {
        let p = case(2, 10, vec![pod("a"), pod("b")]).run();
        assert_eq!((p.create, p.delete.len(), p.hold.clone()), (0, 0, None));
        assert_eq!(p.counts.warm, 2);
    }

    #[test]
    fn starting_pods_count_as_coming_warm_pods() {
        let p = case(3, 10, vec![pod("a"), starting("b")]).run();
        assert_eq!(p.create, 1);
        assert_eq!((p.counts.warm, p.counts.starting), (1, 1));
    }

    #[test]
    fn nothing_is_created_while_creates_are_not_in_the_cache() {
        let mut c = case(3, 10, vec![]);
        c.pending_creates = 1;
        let p = c.run();
        assert_eq!(p.create, 0);
        assert_eq!(p.hold, Some(Hold::AwaitingCache));
        assert_eq!(p.counts.starting, 1);
    }

    #[test]
    fn claimed_and_terminating_pods_count_toward_max() {
        let mut c = case(
            3,
            4,
            vec![
                claimed("c1", 10),
                claimed("c2", 10),
                Observed {
                    terminating: true,
                    ..pod("t")
                },
            ],
        );
        let p = c.run();
        assert_eq!(p.create, 1, "{p:?}");
        assert_eq!(p.hold, Some(Hold::AtMax));
        // A pod deleted a moment ago but still plain in the cache counts as terminating too.
        c.pods.push(pod("gone"));
        c.pending_deletes.insert("gone".into());
        let p = c.run();
        assert_eq!(p.create, 0);
        assert_eq!(p.counts.terminating, 2);
        assert_eq!(p.counts.total, 4);
    }

    #[test]
    fn unschedulable_pods_are_held_and_nothing_more_is_created() {
        let stuck = Observed {
            unschedulable: Some("0/3 nodes are available: 3 Insufficient memory.".into()),
            ..starting("s")
        };
        let p = case(3, 10, vec![stuck]).run();
        assert_eq!(p.create, 0);
        assert!(p.delete.is_empty(), "held, not deleted: {p:?}");
        assert_eq!(
            p.hold,
            Some(Hold::Unschedulable {
                pod: "s".into(),
                message: "0/3 nodes are available: 3 Insufficient memory.".into()
            })
        );
    }

    #[test]
    fn finished_pods_are_deleted_and_replaced() {
        let failed = Observed {
            finished: true,
            ready: false,
            ..pod("f")
        };
        let p = case(2, 10, vec![pod("a"), failed]).run();
        assert_eq!(deleted(&p), [("f", DeleteReason::Finished)]);
        assert_eq!(p.create, 1);
    }

    #[test]
    fn claims_past_the_deadline_are_deleted_others_are_never_touched() {
        let no_annotation_old = Observed {
            claimed_at: None,
            ..claimed("n", 0)
        };
        let no_annotation_new = Observed {
            claimed_at: None,
            created: Some(now() - SignedDuration::from_secs(5)),
            ..claimed("m", 0)
        };
        let p = case(
            0,
            10,
            vec![
                claimed("fresh", 10),
                claimed("stale", 301),
                no_annotation_old,
                no_annotation_new,
            ],
        )
        .run();
        assert_eq!(
            deleted(&p),
            [
                ("n", DeleteReason::ClaimExpired),
                ("stale", DeleteReason::ClaimExpired)
            ]
        );
        assert_eq!(p.counts.claimed, 2);
        assert_eq!(
            p.next_claim_expiry,
            Some(now() + SignedDuration::from_secs(290)),
            "the fresh claim expires first"
        );
    }

    #[test]
    fn a_template_change_keeps_old_ready_pods_until_new_ones_are_ready() {
        // Nothing new yet: old pods keep serving, new ones are created beside them.
        let p = case(2, 10, vec![old("o1"), old("o2")]).run();
        assert!(p.delete.is_empty(), "{p:?}");
        assert_eq!(p.create, 2);
        assert_eq!(p.counts.warm, 2);
        // One new pod ready: one old pod goes, on condition nobody claimed it meanwhile.
        let p = case(2, 10, vec![old("o1"), old("o2"), pod("n1"), starting("n2")]).run();
        assert_eq!(deleted(&p), [("o2", DeleteReason::Outdated)]);
        assert_eq!(p.delete[0].resource_version.as_deref(), Some("rv-o2"));
        assert_eq!(p.create, 0);
        // All new ready: the rest goes. Claimed pods of the old template are never touched.
        let p = case(
            2,
            10,
            vec![
                old("o1"),
                pod("n1"),
                pod("n2"),
                Observed {
                    template: Some("tmpl-old".into()),
                    ..claimed("c", 5)
                },
            ],
        )
        .run();
        assert_eq!(deleted(&p), [("o1", DeleteReason::Outdated)]);
    }

    #[test]
    fn a_rollout_at_max_frees_room_one_old_pod_at_a_time() {
        let p = case(2, 2, vec![old("o1"), old("o2")]).run();
        assert_eq!(p.create, 0);
        assert_eq!(deleted(&p), [("o2", DeleteReason::Outdated)]);
        assert_eq!((p.counts.warm, p.counts.terminating), (1, 1));
        // While that one terminates, the other old pod keeps serving.
        let going = Observed {
            terminating: true,
            ..old("o2")
        };
        let p = case(2, 2, vec![old("o1"), going]).run();
        assert_eq!((p.create, p.delete.len(), p.counts.warm), (0, 0, 1));
        // Once there is room, new pods are created and the old one keeps serving meanwhile.
        let p = case(2, 2, vec![old("o1")]).run();
        assert_eq!((p.create, p.delete.len()), (1, 0));
        let p = case(2, 3, vec![old("o1"), old("o2")]).run();
        assert_eq!((p.create, p.delete.len()), (1, 0));
    }

    #[test]
    fn old_pods_not_yet_ready_are_replaced_at_once() {
        let p = case(
            1,
            10,
            vec![Observed {
                ready: false,
                ..old("o")
            }],
        )
        .run();
        assert_eq!(deleted(&p), [("o", DeleteReason::Outdated)]);
        assert_eq!(p.create, 1);
    }

    #[test]
    fn scaling_down_removes_pods_that_do_not_serve_first() {
        let p = case(1, 10, vec![pod("a"), pod("b"), starting("c")]).run();
        assert_eq!(
            deleted(&p),
            [
                ("c", DeleteReason::ScaleDown),
                ("b", DeleteReason::ScaleDown)
            ]
        );
        // Not against an unsettled cache.
        let mut c = case(1, 10, vec![pod("a"), pod("b")]);
        c.pending_creates = 1;
        assert!(c.run().delete.is_empty());
    }

    #[test]
    fn an_invalid_chain_only_cleans_up() {
        let mut c = case(
            3,
            10,
            vec![
                old("o"),
                Observed {
                    finished: true,
                    ..pod("f")
                },
                claimed("x", 999),
            ],
        );
        c.may_grow = false;
        let p = c.run();
        assert_eq!(p.create, 0);
        assert_eq!(p.hold, Some(Hold::Invalid));
        assert_eq!(
            deleted(&p),
            [
                ("f", DeleteReason::Finished),
                ("x", DeleteReason::ClaimExpired)
            ]
        );
        assert_eq!(p.counts.warm, 1, "existing warm pods are kept");
    }

    #[test]
    fn pods_with_an_unknown_pool_label_are_left_alone_but_count_toward_max() {
        let odd = Observed {
            pool: PoolState::Other,
            ..pod("odd")
        };
        let p = case(2, 2, vec![odd, pod("a")]).run();
        assert_eq!((p.create, p.delete.len()), (0, 0));
        assert_eq!(
            (p.counts.other, p.counts.claimed, p.counts.total),
            (1, 0, 2)
        );
        assert_eq!(p.hold, Some(Hold::AtMax));
    }

    #[test]
    fn a_claim_time_from_the_future_or_the_end_of_time_does_not_crash_and_counts_from_now() {
        let end_of_time = Observed {
            // The latest time jiff parses: adding the deadline to it overflows.
            claimed_at: Some("9999-12-30T21:59:59Z".parse().unwrap()),
            ..claimed("eot", 0)
        };
        let future = Observed {
            claimed_at: Some(now() + SignedDuration::from_secs(86_400)),
            ..claimed("fut", 0)
        };
        let max = Observed {
            claimed_at: Some(Timestamp::MAX),
            ..claimed("max", 0)
        };
        let p = case(0, 10, vec![end_of_time, future, max]).run();
        assert!(p.delete.is_empty(), "{p:?}");
        assert_eq!(p.counts.claimed, 3);
        assert_eq!(
            p.next_claim_expiry,
            Some(now() + SignedDuration::from_secs(300)),
            "claimed \"from the future\": the deadline counts from now"
        );
        // A creation time at the end of time (no annotation) does not crash either.
        let created = Observed {
            claimed_at: None,
            created: Some(Timestamp::MAX),
            ..claimed("c", 0)
        };
        let p = case(0, 10, vec![created]).run();
        assert_eq!(p.counts.claimed, 1);
    }

    #[test]
    fn an_unparseable_claim_time_falls_back_to_the_creation_time() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "c-x", "creationTimestamp": "2026-01-01T11:00:00Z",
                "labels": {"sluice.dev/pool": "claimed", "sluice.dev/template": T},
                "annotations": {"sluice.dev/claimed-at": "tomorrow, probably"}
            },
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .unwrap();
        let o = Observed::from_pod(&pod);
        assert_eq!(o.claimed_at, None);
        // Created an hour before now(): past the 300 s deadline.
        let p = case(0, 10, vec![o]).run();
        assert_eq!(deleted(&p), [("c-x", DeleteReason::ClaimExpired)]);
        // Past what jiff can represent: unparseable too.
        let mut pod = pod;
        pod.metadata.annotations = Some(
            [(
                ANNOTATION_CLAIMED_AT.to_string(),
                "9999-12-31T23:59:59Z".to_string(),
            )]
            .into(),
        );
        let p = case(0, 10, vec![Observed::from_pod(&pod)]).run();
        assert_eq!(deleted(&p), [("c-x", DeleteReason::ClaimExpired)]);
    }

    fn stuck(name: &str, secs_ago: i64, why: &str) -> Observed {
        Observed {
            created: Some(now() - SignedDuration::from_secs(secs_ago)),
            problem: Some(why.into()),
            ..starting(name)
        }
    }

    #[test]
    fn the_start_deadline_counts_from_scheduling() {
        // Created 10 minutes ago, waiting for a node (an autoscaler's) until 30 s ago: starting, not
        // timed out; past the deadline counted from the scheduling, replaced.
        let waited = |name: &str, scheduled_secs_ago: i64| Observed {
            scheduled: Some(now() - SignedDuration::from_secs(scheduled_secs_ago)),
            ..stuck(name, 600, "ContainerCreating")
        };
        let p = case(1, 10, vec![waited("a", 30)]).run();
        assert!(p.delete.is_empty(), "{p:?}");
        assert_eq!(
            p.next_start_deadline,
            Some(now() + SignedDuration::from_secs(90))
        );
        let p = case(1, 10, vec![waited("a", 121)]).run();
        assert_eq!(deleted(&p), [("a", DeleteReason::StartTimeout)]);
    }

    #[test]
    fn pods_that_never_become_ready_are_replaced_one_at_a_time() {
        // Within the deadline: starting, the reason is surfaced, a requeue is planned.
        let p = case(
            3,
            10,
            vec![stuck("a", 30, "ImagePullBackOff: Back-off pulling image")],
        )
        .run();
        assert!(p.delete.is_empty());
        assert_eq!(p.create, 2);
        assert_eq!(
            p.start_problem.as_deref(),
            Some("pod a: ImagePullBackOff: Back-off pulling image")
        );
        assert_eq!(
            p.next_start_deadline,
            Some(now() + SignedDuration::from_secs(90))
        );
        // Past it: deleted and replaced, but only one at a time while none has started.
        let p = case(
            3,
            10,
            vec![
                stuck("a", 121, "ImagePullBackOff: Back-off pulling image"),
                stuck("b", 121, "ImagePullBackOff: Back-off pulling image"),
                stuck("c", 121, "ImagePullBackOff: Back-off pulling image"),
            ],
        )
        .run();
        assert_eq!(
            deleted(&p),
            [
                ("a", DeleteReason::StartTimeout),
                ("b", DeleteReason::StartTimeout),
                ("c", DeleteReason::StartTimeout)
            ]
        );
        assert_eq!(p.delete[0].resource_version.as_deref(), Some("rv-a"));
        assert_eq!(p.create, 1, "{p:?}");
        let Some(Hold::StartFailing { message }) = &p.hold else {
            panic!("{p:?}")
        };
        assert!(
            message.contains("pod a: ImagePullBackOff") && message.contains("120s"),
            "{message}"
        );
        // The failures remembered, one replacement starting: nothing more is created.
        let mut c = case(3, 10, vec![stuck("d", 10, "ContainerCreating: sandbox")]);
        c.start_failures = 3;
        c.last_start_failure = Some("pod c: ImagePullBackOff".into());
        let p = c.run();
        assert_eq!(p.create, 0, "{p:?}");
        assert!(matches!(p.hold, Some(Hold::StartFailing { .. })), "{p:?}");
        // Once a pod of the template is ready, the pool fills at full speed again.
        c.pods = vec![pod("d")];
        let p = c.run();
        assert!(p.template_proven);
        assert_eq!((p.create, p.hold), (2, None));
    }

    #[test]
    fn unschedulable_pods_are_held_past_the_start_deadline() {
        let held = Observed {
            unschedulable: Some("0/3 nodes are available".into()),
            ..stuck("s", 999, "Pending")
        };
        let p = case(2, 10, vec![held]).run();
        assert!(p.delete.is_empty(), "{p:?}");
        assert!(matches!(p.hold, Some(Hold::Unschedulable { .. })));
        assert_eq!(p.create, 0);
    }

    #[test]
    fn observed_says_why_a_pod_is_not_ready() {
        let read = |status: serde_json::Value| {
            let pod: Pod = serde_json::from_value(serde_json::json!({
                "metadata": {"name": "p"}, "status": status
            }))
            .unwrap();
            Observed::from_pod(&pod).problem
        };
        let pull = read(
            serde_json::json!({"phase": "Pending", "containerStatuses": [{
                "name": "supervisor", "ready": false, "restartCount": 0, "image": "x", "imageID": "",
                "state": {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image \"x\""}}
            }]}),
        );
        assert_eq!(
            pull.as_deref(),
            Some("ImagePullBackOff: Back-off pulling image \"x\"")
        );
        let sandbox = read(serde_json::json!({"phase": "Pending", "conditions": [
            {"type": "PodReadyToStartContainers", "status": "False"},
            {"type": "PodScheduled", "status": "True"}
        ], "containerStatuses": [{
            "name": "supervisor", "ready": false, "restartCount": 0, "image": "x", "imageID": "",
            "state": {"waiting": {"reason": "ContainerCreating"}}
        }]}));
        assert!(
            sandbox
                .as_deref()
                .unwrap()
                .contains("FailedCreatePodSandBox"),
            "{sandbox:?}"
        );
        let probe = read(
            serde_json::json!({"phase": "Running", "containerStatuses": [{
                "name": "supervisor", "ready": false, "restartCount": 0, "image": "x", "imageID": "",
                "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
            }]}),
        );
        assert!(
            probe.as_deref().unwrap().contains("startup probe"),
            "{probe:?}"
        );
    }

    #[test]
    fn slow_start_doubles() {
        assert_eq!(slow_start(0), Vec::<u32>::new());
        assert_eq!(slow_start(1), [1]);
        assert_eq!(slow_start(10), [1, 2, 4, 3]);
    }

    #[test]
    fn observed_reads_the_pod() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "c-abcde", "resourceVersion": "7",
                "creationTimestamp": "2026-01-01T11:00:00Z",
                "labels": {"sluice.dev/pool": "claimed", "sluice.dev/template": "t1"},
                "annotations": {"sluice.dev/claimed-at": "2026-01-01T11:59:00Z"}
            },
            "status": {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "no gvisor node"},
                {"type": "Ready", "status": "False"}
            ]}
        }))
        .unwrap();
        let o = Observed::from_pod(&pod);
        assert_eq!(o.pool, PoolState::Claimed);
        assert_eq!(o.template.as_deref(), Some("t1"));
        assert!(!o.ready && !o.finished && !o.terminating);
        assert_eq!(o.unschedulable.as_deref(), Some("no gvisor node"));
        assert_eq!(o.claimed_at, Some("2026-01-01T11:59:00Z".parse().unwrap()));
    }

    fn on(node: NodeState, p: Observed) -> Observed {
        p.on_node(node)
    }

    #[test]
    fn a_cordoned_nodes_warm_pods_are_made_again_elsewhere_and_its_claimed_pods_marked_draining_once()
     {
        let cordoned = NodeState::Cordoned("n2".into());
        let p = case(
            3,
            10,
            vec![
                pod("a"),
                on(cordoned.clone(), pod("b")),
                on(cordoned.clone(), pod("c")),
                on(cordoned.clone(), claimed("held", 10)),
                on(
                    cordoned.clone(),
                    Observed {
                        draining: true,
                        ..claimed("marked", 10)
                    },
                ),
            ],
        )
        .run();
        assert!(
            p.delete.is_empty(),
            "they serve until the drain evicts them: {:?}",
            p.delete
        );
        assert_eq!(
            p.create, 2,
            "made again for the warm target, ahead of the drain"
        );
        assert_eq!((p.counts.warm, p.counts.leaving), (1, 2));
        assert_eq!(
            p.drain,
            vec![("held".to_string(), "node n2 is cordoned".to_string())],
            "the claimed pods are left to their gateways; one marked already is not marked again"
        );
        assert_eq!(p.counts.claimed, 2);
    }

    #[test]
    fn a_lost_nodes_pods_do_not_count_toward_max_and_the_pool_is_made_again() {
        let lost = NodeState::Lost("n2".into());
        let p = case(
            3,
            3,
            vec![
                on(
                    lost.clone(),
                    Observed {
                        terminating: true,
                        ..pod("stuck")
                    },
                ),
                on(lost.clone(), pod("w")),
                on(lost.clone(), claimed("held", 10)),
            ],
        )
        .run();
        assert_eq!(deleted(&p), vec![("w", DeleteReason::NodeLost)]);
        assert_eq!(p.create, 3, "max counts only pods that can serve");
        assert_eq!(p.hold, None);
        assert_eq!((p.counts.lost, p.counts.total), (3, 0));
        assert_eq!(
            p.drain,
            vec![("held".to_string(), "node n2 is not ready".to_string())]
        );
    }

    #[test]
    fn a_serving_node_changes_nothing() {
        let plain = case(2, 4, vec![pod("a"), claimed("c", 10)]).run();
        let on_serving = case(
            2,
            4,
            vec![
                on(NodeState::Serving, pod("a")),
                on(NodeState::Serving, claimed("c", 10)),
            ],
        )
        .run();
        assert_eq!(plain, on_serving);
        assert!(plain.drain.is_empty());
    }
}
