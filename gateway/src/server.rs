//! The gRPC face of the engine: `sluice.v1.Gateway`. Translates requests and answers; every decision
//! is the engine's.

use crate::convert::{from_proto, to_proto};
use crate::engine::{Engine, EngineError, RunInput};
use crate::outcome::Walk;
use crate::proto::{self, gateway_server::Gateway};
use serde_json::Value;
use sluice_crds::Action;
use std::pin::Pin;
use std::sync::Arc;
use tonic::{Request, Response, Status};

pub struct GatewayService {
    pub engine: Arc<Engine>,
}

impl From<EngineError> for Status {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::InvalidArgument(m) => Status::invalid_argument(m),
            EngineError::NotFound(m) => Status::not_found(m),
            EngineError::Unavailable(m) => Status::unavailable(m),
        }
    }
}

pub fn action_to_proto(a: Action) -> proto::Action {
    match a {
        Action::Pass => proto::Action::Pass,
        Action::Modify => proto::Action::Modify,
        Action::Block => proto::Action::Block,
        Action::Skip => proto::Action::Skip,
        Action::Detect => proto::Action::Detect,
    }
}

/// The RunResponse of a finished walk. The payload goes back in the form it came: text or value.
pub fn run_response(run_id: &str, walk: &Walk) -> proto::RunResponse {
    let payload = match &walk.payload {
        Value::String(s) => proto::run_response::Payload::Text(s.clone()),
        other => proto::run_response::Payload::Value(to_proto(other)),
    };
    proto::RunResponse {
        action: action_to_proto(walk.action) as i32,
        payload: Some(payload),
        message: walk.message.clone(),
        hooks: walk
            .hooks
            .iter()
            .map(|h| proto::HookOutcome {
                name: h.name.clone(),
                action: action_to_proto(h.action) as i32,
                message: h.message.clone(),
                findings: h.findings.as_ref().map(to_proto),
                error: h.error.clone().unwrap_or_default(),
                latency_us: h.latency_us,
            })
            .collect(),
        terminal_index: walk.terminal_index.map(|i| i as u32),
        run_id: run_id.to_string(),
    }
}

pub fn payload_from_proto(p: Option<proto::run_request::Payload>) -> Option<Value> {
    match p {
        Some(proto::run_request::Payload::Text(t)) => Some(Value::String(t)),
        Some(proto::run_request::Payload::Value(v)) => Some(from_proto(&v)),
        None => None,
    }
}

type StreamOut = Pin<Box<dyn futures::Stream<Item = Result<proto::StreamResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Gateway for GatewayService {
    async fn run(
        &self,
        request: Request<proto::RunRequest>,
    ) -> Result<Response<proto::RunResponse>, Status> {
        let r = request.into_inner();
        let input = RunInput {
            namespace: r.namespace,
            target: r.target,
            trigger_point: r.trigger_point,
            payload: payload_from_proto(r.payload),
            context: r.context.into_iter().collect(),
            session_id: r.session_id,
        };
        let result = self.engine.run(input).await?;
        Ok(Response::new(run_response(&result.run_id, &result.walk)))
    }

    type StreamStream = StreamOut;

    async fn stream(
        &self,
        request: Request<tonic::Streaming<proto::StreamRequest>>,
    ) -> Result<Response<Self::StreamStream>, Status> {
        let out = crate::stream::serve(self.engine.clone(), request.into_inner()).await?;
        Ok(Response::new(out))
    }
}
