//! The gRPC face of the engine: `sluice.v1.Gateway`. Translates requests and answers (`Run` and
//! `Stream`); every decision is the engine's.

use crate::callers::ReloadingPolicy;
use futures::StreamExt;
use serde_json::Value;
use sluice_crds::Action;
use sluice_engine::{
    CallerAuth, ClientStreamError, Engine, EngineError, RunInput, StreamError, StreamInput,
    StreamOpen, StreamOutput, Walk,
};
use sluice_proto::convert::{from_proto, to_proto};
use sluice_proto::{self as proto, gateway_server::Gateway};
use std::pin::Pin;
use std::sync::Arc;
use tonic::{Request, Response, Status};
use tracing::Instrument;

pub(crate) struct GatewayService {
    pub(crate) engine: Arc<Engine>,
    /// The caller policy, if the gateway has one; without it every caller is `Unchecked`.
    pub(crate) callers: Option<Arc<ReloadingPolicy>>,
}

impl GatewayService {
    /// Who sent `request`: from its TLS session and `authorization` metadata only.
    fn auth<T>(&self, request: &Request<T>) -> CallerAuth {
        let Some(callers) = &self.callers else {
            return CallerAuth::Unchecked;
        };
        let certs = request.peer_certs();
        let authorization = request
            .metadata()
            .get("authorization")
            .map(|v| v.as_bytes());
        callers
            .current()
            .identify(certs.as_deref().map(Vec::as_slice), authorization)
    }
}

fn engine_status(e: EngineError) -> Status {
    match e {
        EngineError::InvalidArgument(m) => Status::invalid_argument(m),
        EngineError::NotFound(m) => Status::not_found(m),
        EngineError::Unavailable(m) => Status::unavailable(m),
        EngineError::Unauthenticated(m) => Status::unauthenticated(m),
        EngineError::PermissionDenied(m) => Status::permission_denied(m),
    }
}

fn stream_status(e: StreamError) -> Status {
    let message = e.to_string();
    match e {
        StreamError::Refused(e) => engine_status(e),
        StreamError::ShuttingDown => Status::unavailable(message),
        StreamError::Idle(_) => Status::deadline_exceeded(message),
        StreamError::Cancelled(_) => Status::cancelled(message),
        StreamError::TooLarge(_) => Status::resource_exhausted(message),
    }
}

/// A stream request as the engine takes it. A request without a message ends the stream, as the
/// end of the client's stream does.
fn stream_input(
    auth: &CallerAuth,
    r: Result<proto::StreamRequest, Status>,
) -> Option<Result<StreamInput, ClientStreamError>> {
    use proto::stream_request::Msg;
    match r {
        Err(s) => Some(Err(ClientStreamError(s.message().to_string()))),
        Ok(proto::StreamRequest { msg: None }) => None,
        Ok(proto::StreamRequest { msg: Some(m) }) => Some(Ok(match m {
            Msg::Open(o) => StreamInput::Open(StreamOpen {
                namespace: o.namespace,
                target: o.target,
                trigger_point: o.trigger_point,
                context: o.context.into_iter().collect(),
                session_id: o.session_id,
                chunk_by_chunk: o.chunk_by_chunk,
                auth: auth.clone(),
            }),
            Msg::Chunk(text) => StreamInput::Chunk(text),
            Msg::Finish(_) => StreamInput::Finish,
        })),
    }
}

fn stream_response(
    out: Result<StreamOutput, StreamError>,
) -> Result<proto::StreamResponse, Status> {
    use proto::stream_response::Msg;
    let msg = match out.map_err(stream_status)? {
        StreamOutput::Commit(text) => Msg::Commit(text),
        StreamOutput::Blocked { message, hook } => {
            Msg::Blocked(proto::StreamBlocked { message, hook })
        }
        StreamOutput::Final(result) => Msg::Final(run_response(&result.run_id, &result.walk)),
    };
    Ok(proto::StreamResponse { msg: Some(msg) })
}

fn action_to_proto(a: Action) -> proto::Action {
    match a {
        Action::Pass => proto::Action::Pass,
        Action::Modify => proto::Action::Modify,
        Action::Block => proto::Action::Block,
        Action::Skip => proto::Action::Skip,
        Action::Detect => proto::Action::Detect,
    }
}

/// The RunResponse of a finished walk. The payload goes back in the form it came: text or value.
fn run_response(run_id: &str, walk: &Walk) -> proto::RunResponse {
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
                name: h.shown_name(),
                action: action_to_proto(h.action) as i32,
                message: h.message.clone(),
                findings: h.findings.as_ref().map(to_proto),
                error: h.error.clone().unwrap_or_default(),
                latency_us: h.latency_us,
                output: h.output.clone().unwrap_or_default(),
            })
            .collect(),
        terminal_index: walk.terminal_index.map(|i| i as u32),
        run_id: run_id.to_string(),
    }
}

fn payload_from_proto(p: Option<proto::run_request::Payload>) -> Option<Value> {
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
        let auth = self.auth(&request);
        let span = crate::observability::request_span(request.metadata(), "sluice.v1.Gateway/Run");
        let r = request.into_inner();
        let input = RunInput {
            namespace: r.namespace,
            target: r.target,
            trigger_point: r.trigger_point,
            payload: payload_from_proto(r.payload),
            context: r.context.into_iter().collect(),
            session_id: r.session_id,
            auth,
            via: None,
        };
        // The run goes on in a task of its own, as streams do: a client that disconnects drops
        // this handler, never the run, which is finished, settled and audited all the same.
        let engine = self.engine.clone();
        let run = tokio::spawn(async move { engine.run_holding(input).instrument(span).await });
        let (result, handback) = run
            .await
            .map_err(|e| Status::internal(format!("the run failed inside the gateway: {e}")))?
            .map_err(engine_status)?;
        let mut response = Response::new(run_response(&result.run_id, &result.walk));
        // The sandboxes go back (and prepare their next cells) once this answer is written.
        response
            .extensions_mut()
            .insert(crate::handback::hand_back_when_answered(handback));
        Ok(response)
    }

    type StreamStream = StreamOut;

    async fn stream(
        &self,
        request: Request<tonic::Streaming<proto::StreamRequest>>,
    ) -> Result<Response<Self::StreamStream>, Status> {
        let auth = self.auth(&request);
        let span =
            crate::observability::request_span(request.metadata(), "sluice.v1.Gateway/Stream");
        let inputs = request
            .into_inner()
            .map(move |r| stream_input(&auth, r))
            .take_while(|m| futures::future::ready(m.is_some()))
            .filter_map(futures::future::ready);
        // The engine's stream task starts in the request's span.
        let out = span
            .in_scope(|| self.engine.stream(inputs))
            .map(stream_response);
        Ok(Response::new(Box::pin(out)))
    }
}
