//! `Engine::run`: one payload through one trigger point. Check the request → resolve the chains →
//! claim a sandbox per chain → walk (baseline first) → audit. A refused request is audited too.

use crate::audit::AuditEvent;
use crate::chains::Chains;
use crate::engine::Engine;
use crate::log_text::Escaped;
use crate::outcome::Walk;
use crate::pipeline::Pipeline;
use crate::request::{EngineError, RunInput, Target, check_payload};
use crate::run_id::RunId;
use std::time::Instant;
use tracing::Instrument;

/// A finished run: its id (as in the audit) and the verdict.
#[derive(Debug)]
pub struct RunResult {
    pub run_id: String,
    pub walk: Walk,
}

impl Engine {
    /// Runs one payload through one trigger point.
    pub async fn run(&self, input: RunInput) -> Result<RunResult, EngineError> {
        let began = Instant::now();
        let run_id = RunId::new();
        // What the caller sent goes into the text log escaped: a newline in it starts no line.
        let span = tracing::info_span!(
            "run",
            run_id = %run_id,
            namespace = %Escaped(&input.namespace),
            target = %Escaped(&input.target),
            trigger_point = %Escaped(&input.trigger_point),
            chain = tracing::field::Empty,
            action = tracing::field::Empty,
            code = tracing::field::Empty,
        );
        async {
            let mut audit = AuditEvent::new(&run_id.to_string(), "run");
            audit.requested(
                &input.namespace,
                &input.target,
                &input.trigger_point,
                &input.session_id,
            );
            audit.caller = input.auth.name().map(str::to_string);
            let prepared = (|| {
                let target = Target::check(
                    self.limits(),
                    &input.auth,
                    &input.namespace,
                    &input.target,
                    &input.trigger_point,
                    input.context.clone(),
                    input.session_id.clone(),
                )?;
                let payload =
                    check_payload(self.limits(), target.key.trigger_point, &input.payload)?;
                let chains = Chains::resolve(&self.registry(), &target.key)?;
                Ok::<_, EngineError>((target, payload, chains))
            })();
            let (target, payload, chains) = match prepared {
                Ok(p) => p,
                Err(e) => return Err(self.refuse(&mut audit, e, began, None)),
            };
            // During a rollout, the version that serves this session (and a candidate in shadow).
            let selection = self.select(&chains, &target.session_id, &run_id.to_string());
            let chains = selection.chains.clone();
            chains.describe(&mut audit);
            selection.describe(&mut audit);
            tracing::Span::current().record(
                "chain",
                tracing::field::display(Escaped(&chains.main().qualified_name())),
            );
            let mut pipeline = match Pipeline::open(self, &chains, &target, run_id, false).await {
                Ok(p) => p,
                Err(e) => return Err(self.refuse(&mut audit, e, began, Some(&chains))),
            };
            pipeline.record_sandboxes(&mut audit);
            let mut states = chains.fresh_states();
            let shadow_payload = (!selection.shadows.is_empty()).then(|| payload.clone());
            let walk = pipeline.walk(payload, &mut states).await;
            pipeline.record_host_calls(&mut audit, self.limits().audit_host_calls);
            drop(pipeline);
            self.finish(&mut audit, &chains, &walk, began, "run");
            self.record_rollout(&selection, &walk);
            if let Some(payload) = shadow_payload {
                self.start_shadows(selection, &target, &payload, &walk, run_id);
            }
            Ok(RunResult {
                run_id: run_id.to_string(),
                walk,
            })
        }
        .instrument(span)
        .await
    }
}
