//! The OpenAI-compatible proxy (`--openai-listen ADDR --openai-upstream URL`): the gateway serves
//! `POST /v1/chat/completions` (streamed and not) and passes `GET /v1/models` through, running the
//! chains of the caller's target on every request, reply and tool call (`chat`), so that an
//! application changes only its base URL. Callers are identified as on the gRPC port (TLS client
//! certificate, or the `authorization` header's bearer token against the caller policy).
//!
//! Reading order: this file (the listener, routing, who is calling, bad input) → `target` (whose
//! chains guard a request) → `chat` (one completion through the trigger points) → `allow` (what of
//! the upstream's answer may reach the client) → `passed` (what the chains already decided about a
//! conversation's history) → `sse` (the streamed reply) → `upstream` (the model behind) → `error`
//! (the API's error shape).

mod allow;
mod chat;
mod error;
mod hooks;
mod passed;
pub(crate) mod sse;
mod target;
mod upstream;

use crate::callers::ReloadingPolicy;
use crate::http_port::{Certs, Running};
use crate::tls::ReloadingTls;
use bytes::Bytes;
use error::ApiError;
use http_body_util::BodyExt;
use hyper::{Method, Request, Response, body::Body as _};
use sluice_engine::{CallerAuth, Engine};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use upstream::Upstream;

pub use upstream::UpstreamError;

/// How the proxy is configured (`--openai-*`).
#[derive(Clone, Debug)]
pub struct OpenAiOptions {
    pub listen: SocketAddr,
    /// The OpenAI-compatible endpoint requests go on to, e.g. `https://api.openai.com/v1`.
    pub upstream: String,
    /// A file holding the upstream's API key (sent as `authorization: Bearer`); hooks never see it.
    pub api_key_file: Option<PathBuf>,
    /// How long an upstream call may take before its first byte (and between bytes of a stream).
    pub upstream_timeout: Duration,
    /// The target whose chains guard a request whose model no chain serves (and that names no
    /// target); without it such a request is refused (`--openai-default-target`).
    pub default_target: Option<String>,
    /// Models let through with the platform's baseline alone when no chain serves them
    /// (`--openai-unguarded-model`); their answers say so (`x-sluice-unguarded`).
    pub unguarded_models: Vec<String>,
}

impl OpenAiOptions {
    pub fn new(listen: SocketAddr, upstream: impl Into<String>) -> Self {
        Self {
            listen,
            upstream: upstream.into(),
            api_key_file: None,
            upstream_timeout: Duration::from_secs(120),
            default_target: None,
            unguarded_models: Vec::new(),
        }
    }
}

pub(crate) use crate::http_port::Body;

/// Header naming the namespace a request's chains are in (default: `default`, or the caller's only
/// namespace); the caller policy decides whether the caller may use it.
const NAMESPACE_HEADER: &str = "x-sluice-namespace";
/// Header naming the conversation (the session id of every run), optional.
const SESSION_HEADER: &str = "x-sluice-session";

/// The proxy, shared by every connection.
pub(crate) struct Proxy {
    engine: Arc<Engine>,
    callers: Option<Arc<ReloadingPolicy>>,
    upstream: Upstream,
    opts: OpenAiOptions,
    /// What the chains already decided about the payloads of conversations (`passed`).
    passed: Arc<passed::Passed>,
}

/// Starts the proxy on a listener already bound.
pub(crate) fn start(
    engine: Arc<Engine>,
    callers: Option<Arc<ReloadingPolicy>>,
    tls: Option<Arc<ReloadingTls>>,
    listener: tokio::net::TcpListener,
    opts: &OpenAiOptions,
) -> anyhow::Result<Running> {
    let upstream = Upstream::new(opts)?;
    let proxy = Arc::new(Proxy {
        engine,
        callers,
        upstream,
        opts: opts.clone(),
        passed: Default::default(),
    });
    let running = crate::http_port::serve("OpenAI-compatible", listener, tls, move |req, certs| {
        proxy.clone().handle(req, certs)
    });
    tracing::info!(addr = %opts.listen, upstream = %opts.upstream, "OpenAI-compatible proxy listening");
    Ok(running)
}

impl Proxy {
    async fn handle(
        self: Arc<Self>,
        req: Request<hyper::body::Incoming>,
        certs: Arc<Option<Certs>>,
    ) -> Response<Body> {
        let auth =
            crate::http_port::caller(self.callers.as_deref(), &req, certs.as_ref().as_deref());
        let path = req.uri().path().trim_end_matches('/').to_string();
        // hyper closes a connection whose request body was left unread: an answer given before the
        // body was read says so, or a client that pools connections sends its next request into one
        // that is closing ("server disconnected without sending a response").
        let mut body_read = req.body().is_end_stream();
        let answer = match (req.method(), path.as_str()) {
            (&Method::POST, "/v1/chat/completions") => self.chat(req, auth, &mut body_read).await,
            (&Method::GET, "/v1/models") => match admitted(&auth) {
                Ok(()) => self.upstream.models().await,
                Err(e) => Err(e),
            },
            (_, "/v1/chat/completions") | (_, "/v1/models") => Err(ApiError::method_not_allowed()),
            _ => Err(ApiError::not_found(&path)),
        };
        let mut resp = answer.unwrap_or_else(ApiError::into_response);
        if !body_read {
            resp.headers_mut().insert(
                hyper::header::CONNECTION,
                hyper::header::HeaderValue::from_static("close"),
            );
        }
        resp
    }

    /// One chat completion: read and check the body, then `chat::complete`.
    async fn chat(
        self: Arc<Self>,
        req: Request<hyper::body::Incoming>,
        auth: CallerAuth,
        body_read: &mut bool,
    ) -> Result<Response<Body>, ApiError> {
        admitted(&auth)?;
        let content_type = req
            .headers()
            .get(hyper::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        if !content_type
            .split(';')
            .next()
            .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
        {
            return Err(ApiError::unsupported_media_type(content_type));
        }
        let header = |name: &str| {
            req.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let namespace = header(NAMESPACE_HEADER);
        let target = header(target::TARGET_HEADER);
        let session = header(SESSION_HEADER).unwrap_or_default();
        let limit = self.engine.limits().request_bytes;
        let body = http_body_util::Limited::new(req.into_body(), limit)
            .collect()
            .await
            .map_err(|e| {
                if e.is::<http_body_util::LengthLimitError>() {
                    ApiError::too_large(limit)
                } else {
                    ApiError::invalid(format!("the request body could not be read: {e}"))
                }
            })?
            .to_bytes();
        *body_read = true;
        let request = chat::ChatRequest::parse(&body)?;
        let namespace = namespace.unwrap_or_else(|| crate::http_port::default_namespace(&auth));
        // Whether a target has chains is not told to a caller that may not use the namespace.
        auth.admit(&namespace).map_err(ApiError::engine)?;
        let guard = target::resolve(
            &self.engine.registry(),
            &self.opts,
            &namespace,
            target.as_deref(),
            &request.model,
        )?;
        let hooks = hooks::Hooks {
            engine: self.engine.clone(),
            auth,
            namespace,
            target: guard.target().to_string(),
            session,
            passed: self.passed.clone(),
        };
        let mut resp = chat::complete(&self.upstream, hooks, request)
            .await
            .unwrap_or_else(ApiError::into_response);
        guard.mark(&mut resp);
        Ok(resp)
    }
}

/// Refuses a caller the policy does not know, before anything is read or sent upstream.
fn admitted(auth: &CallerAuth) -> Result<(), ApiError> {
    match auth {
        CallerAuth::Unauthenticated(why) => Err(ApiError::unauthenticated(why)),
        _ => Ok(()),
    }
}

/// A JSON answer.
pub(crate) fn json_response(status: hyper::StatusCode, v: &serde_json::Value) -> Response<Body> {
    let mut resp = Response::new(http_body_util::Full::new(Bytes::from(v.to_string())).boxed());
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    resp
}
