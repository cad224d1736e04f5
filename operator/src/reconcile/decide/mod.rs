//! Stage 4, decide: the pool plan (what to create, what to delete, what to hold) from what was read,
//! what should exist and the verdict. Pure apart from the clock the caller passes; the rules are
//! `pool::plan`.

pub mod pool;

use super::build::Desired;
use super::context::{Context, lock};
use super::read::Snapshot;
use crate::reconcile::status::Verdict;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use pool::Plan;
use sluice_crds::HookChain;

pub(crate) fn decide(
    chain: &HookChain,
    read: &Snapshot,
    desired: &Desired,
    verdict: &Verdict,
    now: Timestamp,
    ctx: &Context,
) -> Plan {
    let failures = lock(&ctx.start_failures)
        .get(&read.key)
        .filter(|f| f.template == desired.template)
        .cloned()
        .unwrap_or_default();
    let plan = pool::plan(&pool::Input {
        warm: chain.spec.pool.warm,
        max: chain.spec.pool.max,
        template: &desired.template,
        pods: &read.observed,
        pending_creates: read.pending.creates,
        pending_deletes: &read.pending.deletes,
        now,
        claim_deadline: SignedDuration::try_from(ctx.claim_deadline)
            .unwrap_or(SignedDuration::from_secs(300)),
        start_deadline: SignedDuration::try_from(ctx.start_deadline)
            .unwrap_or(SignedDuration::from_secs(120)),
        start_failures: failures.count,
        last_start_failure: (!failures.last.is_empty()).then_some(failures.last.as_str()),
        may_grow: !verdict.is_invalid(),
    });
    tracing::debug!(chain = %read.key, ?plan, "pool plan");
    plan
}
