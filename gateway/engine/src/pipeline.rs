//! The chains one trigger point runs: the platform's enforced baseline first, then the tenant's own
//! chain. Tighten-only: the baseline walks the payload first, under its own failure policy and in
//! its own sandbox; when it ends the walk (block, skip, or a failure under `Closed`) the tenant's
//! chain does not run, otherwise the tenant's chain starts from the baseline's output, and whatever
//! the tenant changed is walked by the baseline once more. A tenant chain therefore cannot remove,
//! reorder or weaken a baseline hook, nor undo what it did. Each chain keeps its own state vector;
//! the answer lists the baseline's hooks first, named `baseline/<hook>`, then the tenant's, and
//! `terminal_index` counts in that combined list. When the tenant's chain ends the walk with a
//! message, the baseline walks that message too before it leaves (`Pipeline::recheck_message`).

use crate::audit::AuditEvent;
use crate::chains::Chains;
use crate::claimed_chain::ClaimedChain;
use crate::engine::Engine;
use crate::host_call_guard::HostCallReport;
use crate::outcome::Walk;
use crate::outcome::{Layer, merge_action};
use crate::pool::Claimed;
use crate::request::{EngineError, Target};
use crate::run::Handback;
use crate::run_id::RunId;
use crate::state_vector::StateVector;
use serde_json::Value;
use sluice_crds::TriggerPoint;

/// One chain of the pipeline, in its claimed sandbox.
struct Stage<'e> {
    claimed: ClaimedChain<'e>,
    baseline: bool,
}

/// One claimed sandbox per chain, for one trigger point (a Run, or a whole Stream).
pub(crate) struct Pipeline<'e> {
    stages: Vec<Stage<'e>>,
}

impl<'e> Pipeline<'e> {
    /// Claims and loads a sandbox for every chain: the tenant's first, then the baseline's, whose
    /// walk comes right after. The baseline's pool serves every tenant, so a run holds one of its
    /// sandboxes only around the baseline's own walks, never while the tenant's chain waits for a
    /// sandbox of its own (a boot, under `reuse: None`, with the tenant's module code in it). No
    /// sandbox in time for either → UNAVAILABLE. The baseline's is handed back after each of its
    /// walks and claimed again for the next (`walk`).
    pub(crate) async fn open(
        engine: &'e Engine,
        chains: &Chains,
        target: &Target,
        run_id: RunId,
        shadow: bool,
    ) -> Result<Self, EngineError> {
        // `ordered` is baseline first; claim in reverse, then put the stages back in walk order.
        let mut stages = Vec::new();
        for (chain, baseline) in chains.ordered().collect::<Vec<_>>().into_iter().rev() {
            let claimed = ClaimedChain::open(engine, chain.clone(), target, run_id, shadow).await?;
            stages.push(Stage { claimed, baseline });
        }
        stages.reverse();
        Ok(Self { stages })
    }

    /// The sandboxes the run still holds, to be handed back when its answer is on its way.
    pub(crate) fn into_handback(mut self) -> Handback {
        Handback(
            self.stages
                .iter_mut()
                .filter_map(|s| s.claimed.take_claim())
                .map(Claimed::answered)
                .collect(),
        )
    }

    /// Runs the payload through every chain in order, each threading its own state vector (one per
    /// chain, as `Chains::fresh_states` makes them). Stops after a chain that ended the walk.
    ///
    /// Tighten-only holds for what the tenant's chain does to the payload as well: when the tenant
    /// changed what the baseline let through, the baseline walks the result once more (from the state
    /// it started this walk with, so a counter does not count twice, and with that second state
    /// thrown away). What it would still change, it changes (listed as `baseline-recheck/<hook>`), and
    /// what it would block stays blocked. A tenant cannot re-add a tool a baseline removed. Before
    /// that, the fields the application owns (`turn`, `usage_so_far`, `usage`) are put back: a tenant
    /// cannot forge the figures a baseline's limits are judged on.
    pub(crate) async fn walk(&mut self, payload: Value, states: &mut [StateVector]) -> Walk {
        let mut combined = Walk::new(payload);
        let mut offset = 0;
        let baseline_start = match self.stages.first() {
            Some(s) if s.baseline && self.stages.len() > 1 => states.first().cloned(),
            _ => None,
        };
        let mut baseline_output = None;
        let mut tenant_ended = false;
        for (stage, state) in self.stages.iter_mut().zip(states.iter_mut()) {
            let walk = stage.claimed.walk(combined.payload.clone(), state).await;
            if stage.baseline {
                // Every tenant shares the baseline's pool: its sandbox is held for its walk only.
                stage.claimed.release();
            }
            let layer = if stage.baseline {
                Layer::Baseline
            } else {
                Layer::Own
            };
            absorb(&mut combined, walk, offset, layer);
            offset += stage.claimed.chain.spec.hooks.len();
            if combined.is_terminal() {
                tenant_ended = !stage.baseline;
                break;
            }
            if stage.baseline {
                baseline_output = Some(combined.payload.clone());
            }
        }
        if combined.is_terminal() {
            if let (true, Some(scratch)) = (tenant_ended, baseline_start) {
                self.recheck_message(&mut combined, scratch, offset).await;
            }
            return combined;
        }
        if let (Some(mut scratch), Some(let_through)) = (baseline_start, baseline_output) {
            let trigger_point = self.stages[0].claimed.chain.spec.trigger_point;
            restore_app_owned(trigger_point, &mut combined.payload, &let_through);
            if combined.payload == let_through {
                return combined;
            }
            let recheck = self.stages[0]
                .claimed
                .walk(combined.payload.clone(), &mut scratch)
                .await;
            self.stages[0].claimed.release();
            if recheck.is_terminal() || recheck.payload != combined.payload {
                absorb(&mut combined, recheck, offset, Layer::Recheck);
            }
        }
        combined
    }

    /// A tenant's block or skip message reaches the user as much as a payload does, so at the
    /// trigger points that carry text the baseline walks it too (from the state it started with,
    /// thrown away after): what it would change in the message is changed, and if it would end the
    /// walk on it, its own verdict and message replace the tenant's.
    async fn recheck_message(
        &mut self,
        combined: &mut Walk,
        mut scratch: StateVector,
        offset: usize,
    ) {
        let baseline = &mut self.stages[0];
        if combined.message.is_empty() || !baseline.claimed.chain.spec.trigger_point.carries_text()
        {
            return;
        }
        let recheck = baseline
            .claimed
            .walk(Value::String(combined.message.clone()), &mut scratch)
            .await;
        baseline.claimed.release();
        let changed = recheck.payload.as_str() != Some(combined.message.as_str());
        if !recheck.is_terminal() && !changed {
            return;
        }
        combined
            .hooks
            .extend(recheck.hooks.into_iter().map(|mut h| {
                h.index += offset;
                h.layer = Layer::Recheck;
                h
            }));
        match recheck.terminal_index {
            Some(t) => {
                combined.terminal_index = Some(t + offset);
                combined.action = recheck.action;
                combined.message = recheck.message;
            }
            None => {
                combined.message = match recheck.payload {
                    Value::String(text) => text,
                    // A baseline that turns text into something else leaves nothing to show.
                    _ => String::new(),
                }
            }
        }
    }

    /// Sandbox ids for the audit: the tenant chain's (if any) and the baseline's (if any).
    /// host_calls refused to shadow runs (capabilities not safe to repeat).
    pub(crate) fn shadow_refused(&self) -> u64 {
        self.stages.iter().map(|s| s.claimed.shadow_refused()).sum()
    }

    pub(crate) fn record_sandboxes(&self, audit: &mut AuditEvent) {
        for stage in &self.stages {
            if stage.baseline {
                if let Some(b) = audit.baseline.as_mut() {
                    b.sandbox = Some(stage.claimed.sandbox_id.clone());
                }
            } else {
                audit.sandbox = Some(stage.claimed.sandbox_id.clone());
            }
        }
    }

    /// Records the host_calls so far in the audit event, baseline hooks named as in the answer: the
    /// first `audit_host_calls` listed, and counts of all of them when that is not all.
    pub(crate) fn record_host_calls(&self, audit: &mut AuditEvent, max_listed: usize) {
        let mut all = HostCallReport::default();
        for stage in &self.stages {
            let layer = if stage.baseline {
                Layer::Baseline
            } else {
                Layer::Own
            };
            let prefix = layer.prefix();
            all.merge(stage.claimed.host_calls(), prefix, max_listed);
        }
        (audit.host_calls, audit.host_call_summary) = all.into_audit();
    }
}

/// Fields of a structured payload that report facts the application owns (how far the conversation
/// is, what it has spent), not requests a hook may rewrite. Under a baseline the tenant's chain cannot
/// change them: a baseline's limits are judged, and answered, on the true figures.
fn app_owned(trigger_point: TriggerPoint) -> &'static [&'static str] {
    match trigger_point {
        TriggerPoint::BeforeModel => &["turn", "usage_so_far"],
        TriggerPoint::AfterModel => &["usage"],
        _ => &[],
    }
}

/// Puts the application-owned fields of `payload` back to what the baseline let through.
fn restore_app_owned(trigger_point: TriggerPoint, payload: &mut Value, let_through: &Value) {
    let (Some(out), Some(truth)) = (payload.as_object_mut(), let_through.as_object()) else {
        return;
    };
    for field in app_owned(trigger_point) {
        match truth.get(*field) {
            Some(v) => {
                out.insert(field.to_string(), v.clone());
            }
            None => {
                out.remove(*field);
            }
        }
    }
}

/// Folds one chain's walk into the combined walk: hooks appended (of `layer`, indices shifted by the
/// hooks of the chains before), payload carried on, and the top action re-derived over both: the
/// terminal action when one ended the walk, else modify, else detect, else pass.
pub(crate) fn absorb(combined: &mut Walk, walk: Walk, offset: usize, layer: Layer) {
    combined.payload = walk.payload;
    combined.hooks.extend(walk.hooks.into_iter().map(|mut h| {
        h.index += offset;
        h.layer = layer;
        h
    }));
    if let Some(t) = walk.terminal_index {
        combined.terminal_index = Some(t + offset);
        combined.action = walk.action;
        combined.message = walk.message;
        return;
    }
    combined.action = merge_action(combined.action, walk.action);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outcome::HookOutcome;
    use serde_json::json;
    use sluice_crds::Action;

    fn outcome(index: usize, name: &str, action: Action) -> HookOutcome {
        HookOutcome {
            index,
            name: name.into(),
            layer: Layer::Own,
            action,
            message: String::new(),
            findings: None,
            error: None,
            latency_us: 1,
            output: None,
            lines: None,
        }
    }

    #[test]
    fn the_tenant_sees_the_baseline_output_and_hooks_are_listed_baseline_first() {
        let mut combined = Walk::new(json!({"n": 0}));
        let mut base = Walk::new(json!({"n": 1}));
        base.action = Action::Modify;
        base.hooks = vec![
            outcome(0, "limit", Action::Pass),
            outcome(1, "rewrite", Action::Modify),
        ];
        absorb(&mut combined, base, 0, Layer::Baseline);
        let mut tenant = Walk::new(json!({"n": 1}));
        tenant.action = Action::Detect;
        tenant.hooks = vec![outcome(0, "look", Action::Detect)];
        absorb(&mut combined, tenant, 2, Layer::Own);
        assert_eq!(combined.action, Action::Modify, "modify outranks detect");
        assert_eq!(combined.payload, json!({"n": 1}));
        let names: Vec<(&str, Layer, usize)> = combined
            .hooks
            .iter()
            .map(|h| (h.name.as_str(), h.layer, h.index))
            .collect();
        assert_eq!(
            names,
            vec![
                ("limit", Layer::Baseline, 0),
                ("rewrite", Layer::Baseline, 1),
                ("look", Layer::Own, 2)
            ]
        );
        assert_eq!(combined.hooks[0].shown_name(), "baseline/limit");
        assert_eq!(combined.terminal_index, None);
    }

    #[test]
    fn a_tenant_block_counts_its_index_after_the_baseline_hooks() {
        let mut combined = Walk::new(json!({}));
        let mut base = Walk::new(json!({}));
        base.hooks = vec![outcome(0, "a", Action::Pass), outcome(1, "b", Action::Pass)];
        absorb(&mut combined, base, 0, Layer::Baseline);
        let mut tenant = Walk::new(json!({}));
        tenant.hooks = vec![outcome(0, "stop", Action::Block)];
        tenant.action = Action::Block;
        tenant.terminal_index = Some(0);
        tenant.message = "no".into();
        absorb(&mut combined, tenant, 2, Layer::Own);
        assert_eq!(
            (
                combined.action,
                combined.terminal_index,
                combined.message.as_str()
            ),
            (Action::Block, Some(2), "no")
        );
    }
}
