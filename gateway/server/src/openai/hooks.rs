//! One trigger point of one request, through the engine's `Run` and `Stream` paths: where the
//! request's chains are (namespace, target, session, caller) and what a walk's verdict means here.

use super::error::ApiError;
use super::passed::{Passed, Scope};
use serde_json::Value;
use sluice_crds::{Action, FailurePolicy, TriggerPoint};
use sluice_engine::{
    CallerAuth, ChainKey, ClientStreamError, Engine, EngineError, RunInput, StreamError,
    StreamInput, StreamOpen, StreamOutput,
};
use std::sync::Arc;

/// Where a request's runs go.
#[derive(Clone)]
pub(crate) struct Hooks {
    pub(crate) engine: Arc<Engine>,
    pub(crate) auth: CallerAuth,
    pub(crate) namespace: String,
    pub(crate) target: String,
    pub(crate) session: String,
    /// What the chains already decided about payloads of this proxy's requests.
    pub(crate) passed: Arc<Passed>,
}

/// A verdict, and whether every hook of the walk answered (no hook failed and was passed over by
/// `failurePolicy: Open`): only such verdicts may be remembered and reused.
pub(crate) struct Checked {
    pub(crate) verdict: Verdict,
    pub(crate) clean: bool,
}

/// What a trigger point decided.
#[derive(Debug)]
pub(crate) enum Verdict {
    /// Go on with this payload (the one sent, or a hook's rewrite). Also the answer when no chain
    /// serves the trigger point.
    Go(Value),
    /// Stop: `message` is for the user (which hook it was is in the audit).
    Block { message: String },
    /// Do not call what comes next; `message` stands in for its answer.
    Skip(String),
}

impl Hooks {
    /// Runs `payload` through `trigger_point`. The run goes on in a task of its own: a client that
    /// disconnects drops this future, never the run, which is finished and audited all the same.
    pub(crate) async fn run(
        &self,
        trigger_point: TriggerPoint,
        payload: Value,
    ) -> Result<Verdict, ApiError> {
        Ok(self.run_checked(trigger_point, payload).await?.verdict)
    }

    /// `run`, saying whether every hook answered.
    pub(crate) async fn run_checked(
        &self,
        trigger_point: TriggerPoint,
        payload: Value,
    ) -> Result<Checked, ApiError> {
        let input = RunInput {
            namespace: self.namespace.clone(),
            target: self.target.clone(),
            trigger_point: trigger_point.as_str().to_string(),
            payload: Some(payload.clone()),
            context: Default::default(),
            session_id: self.session.clone(),
            auth: self.auth.clone(),
            via: Some(sluice_engine::Via::proxy("openai", None)),
        };
        let engine = self.engine.clone();
        let result = tokio::spawn(async move { engine.run(input).await })
            .await
            .map_err(|e| {
                ApiError::upstream(
                    hyper::StatusCode::INTERNAL_SERVER_ERROR,
                    format!("the run failed inside the gateway: {e}"),
                )
            })?;
        let walk = match result {
            Ok(r) => r.walk,
            // No chain at this trigger point: nothing to enforce there.
            Err(EngineError::NotFound(_)) => {
                return Ok(Checked {
                    verdict: Verdict::Go(payload),
                    clean: true,
                });
            }
            Err(e) => return Err(ApiError::engine(e)),
        };
        let clean = walk.hooks.iter().all(|h| h.error.is_none());
        let verdict = match walk.action {
            Action::Block => Verdict::Block {
                message: walk.message,
            },
            Action::Skip => Verdict::Skip(walk.message),
            Action::Pass | Action::Modify | Action::Detect => Verdict::Go(walk.payload),
        };
        Ok(Checked { verdict, clean })
    }

    /// Whether a chain (the tenant's or the platform's baseline) serves `tp` for this target.
    pub(crate) fn has_chain(&self, tp: TriggerPoint) -> bool {
        let registry = self.engine.registry();
        let key = ChainKey {
            namespace: self.namespace.clone(),
            target: self.target.clone(),
            trigger_point: tp,
        };
        registry.chain(&key).is_some() || registry.baseline(tp).is_some()
    }

    /// Whether a chain sees the reply (`after_model` or `output`): then nothing of the reply that
    /// such a chain cannot see (logprobs, audio, annotations) may leave.
    pub(crate) fn reply_is_guarded(&self) -> bool {
        self.has_chain(TriggerPoint::AfterModel) || self.has_chain(TriggerPoint::Output)
    }

    /// Where this request's payloads at `tp` are walked, under `revision`.
    pub(crate) fn scope<'a>(&'a self, tp: TriggerPoint, revision: &'a str) -> Scope<'a> {
        Scope {
            caller: self.auth.name().unwrap_or_default(),
            namespace: &self.namespace,
            target: &self.target,
            session: &self.session,
            trigger_point: tp.as_str(),
            revision,
        }
    }

    /// The revision of the chains that would walk `tp` for this request now (see
    /// `Engine::serving_revision`).
    pub(crate) fn revision(&self, tp: TriggerPoint) -> Option<String> {
        self.engine
            .serving_revision(&self.namespace, &self.target, tp, &self.session)
    }

    /// Whether the reply's `output` chains let a reply through when it fails (`failurePolicy:
    /// Open` on the tenant's chain and on the platform's baseline, if there is one). No chain at
    /// all counts as open: there is nothing to enforce.
    pub(crate) fn output_fails_open(&self) -> bool {
        let registry = self.engine.registry();
        let key = ChainKey {
            namespace: self.namespace.clone(),
            target: self.target.clone(),
            trigger_point: TriggerPoint::Output,
        };
        [
            registry.chain(&key),
            registry.baseline(TriggerPoint::Output),
        ]
        .into_iter()
        .flatten()
        .all(|c| c.spec.failure_policy == FailurePolicy::Open)
    }

    /// Opens the `output` stream of the reply: the engine's two-path stream, fed with `inputs`.
    pub(crate) fn stream<S>(
        &self,
        inputs: S,
    ) -> impl futures::Stream<Item = Result<StreamOutput, StreamError>> + Send + 'static
    where
        S: futures::Stream<Item = Result<StreamInput, ClientStreamError>> + Send + 'static,
    {
        let open = StreamInput::Open(StreamOpen {
            namespace: self.namespace.clone(),
            target: self.target.clone(),
            trigger_point: TriggerPoint::Output.as_str().into(),
            context: Default::default(),
            session_id: self.session.clone(),
            chunk_by_chunk: false,
            auth: self.auth.clone(),
        });
        let inputs = futures::StreamExt::chain(futures::stream::iter([Ok(open)]), inputs);
        self.engine.stream(inputs)
    }
}
