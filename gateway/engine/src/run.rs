//! `Engine::run`: one payload through one trigger point. Check the request → resolve the chains →
//! claim a sandbox per chain → walk (baseline first) → audit. A refused request is audited too.

use crate::audit::AuditEvent;
use crate::chains::Chains;
use crate::engine::Engine;
use crate::log_text::Escaped;
use crate::outcome::Walk;
use crate::pipeline::Pipeline;
use crate::pool::Claimed;
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

/// The sandboxes a finished run held (`Engine::run_holding`). Dropping it hands each back to its
/// pool, which ends its cell and prepares the next one there (or retires the sandbox). That
/// preparation takes a core of the machine for milliseconds, and the kube backend's exec path
/// relays it through the API server, the kubelet and containerd: started before the answer was
/// written, it competed with the answer for the CPU.
#[derive(Default)]
pub struct Handback(pub(crate) Vec<Claimed>);

impl Handback {
    /// How many sandboxes it holds.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Debug for Handback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Handback({} sandboxes)", self.0.len())
    }
}

impl Engine {
    /// Runs one payload through one trigger point; its sandboxes go back as it ends.
    pub async fn run(&self, input: RunInput) -> Result<RunResult, EngineError> {
        self.run_holding(input)
            .await
            .map(|(result, _handback)| result)
    }

    /// As `run`, but the sandboxes that served the run go back only when the caller drops the
    /// `Handback`: once its answer is written (the gRPC server's Run), so that the sandboxes'
    /// preparation of their next cells does not compete with the answer. Drop it soon: a pool's
    /// sandbox is held until then.
    pub async fn run_holding(&self, input: RunInput) -> Result<(RunResult, Handback), EngineError> {
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
            audit.via = input.via.clone();
            let prepared = (|| {
                self.audit_admits()?;
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
            let handback = pipeline.into_handback();
            self.finish(&mut audit, &chains, &walk, began, "run");
            self.record_rollout(&selection, &walk);
            if let Some(payload) = shadow_payload {
                self.start_shadows(selection, &target, &payload, &walk, run_id);
            }
            Ok((
                RunResult {
                    run_id: run_id.to_string(),
                    walk,
                },
                handback,
            ))
        }
        .instrument(span)
        .await
    }
}
