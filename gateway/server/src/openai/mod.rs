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
mod sse;
mod target;
mod upstream;

use crate::callers::ReloadingPolicy;
use crate::tls::ReloadingTls;
use bytes::Bytes;
use error::ApiError;
use http_body_util::{BodyExt, combinators::BoxBody};
use hyper::{Method, Request, Response, body::Body as _};
use sluice_engine::{CallerAuth, Engine};
use std::convert::Infallible;
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

pub(crate) type Body = BoxBody<Bytes, Infallible>;

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

/// The running proxy: its accept loop, which on [`Running::drain`] stops accepting and waits for
/// the requests in flight.
pub(crate) struct Running {
    stop: tokio::sync::watch::Sender<bool>,
    serving: tokio::task::JoinHandle<()>,
    /// The TLS handshakes' task, when the port has TLS.
    handshakes: Option<tokio::task::JoinHandle<()>>,
    /// Resolves once the accept loop has let go of the listening socket.
    closed: Option<tokio::sync::oneshot::Receiver<()>>,
}

impl Running {
    /// Stops accepting connections and returns once the port is closed: a client that connects
    /// after this is refused, whatever the requests in flight are doing.
    pub(crate) async fn stop_accepting(&mut self) {
        self.stop.send_replace(true);
        if let Some(h) = self.handshakes.take() {
            h.abort();
            let _ = h.await;
        }
        if let Some(closed) = self.closed.take() {
            let _ = closed.await;
        }
    }

    /// Stops accepting connections, lets every request in flight finish (a streamed reply to its
    /// end) for at most `within`, then closes what is left.
    pub(crate) async fn drain(mut self, within: Duration) {
        self.stop_accepting().await;
        if tokio::time::timeout(within, &mut self.serving)
            .await
            .is_err()
        {
            tracing::warn!(
                "OpenAI-compatible requests did not finish within {within:?}; closing anyway"
            );
            self.serving.abort();
        }
    }
}

/// Starts the proxy on a listener already bound.
pub(crate) fn start(
    engine: Arc<Engine>,
    callers: Option<Arc<ReloadingPolicy>>,
    tls: Option<Arc<ReloadingTls>>,
    listener: tokio::net::TcpListener,
    opts: &OpenAiOptions,
) -> anyhow::Result<Running> {
    use tokio_stream::StreamExt;
    let upstream = Upstream::new(opts)?;
    let proxy = Arc::new(Proxy {
        engine,
        callers,
        upstream,
        opts: opts.clone(),
        passed: Default::default(),
    });
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    // Every connection is watched: on drain, idle ones close and busy ones finish their request.
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let (closing, closed) = tokio::sync::oneshot::channel();
    let (serving, handshakes) = match tls {
        None => (
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        accepted = listener.accept() => {
                            let Ok((tcp, _)) = accepted else {
                                tokio::time::sleep(Duration::from_millis(100)).await;
                                continue;
                            };
                            crate::assembly::no_delay(&tcp);
                            tokio::spawn(proxy.clone().connection(tcp, None, &graceful));
                        }
                        _ = stopped.changed() => break,
                    }
                }
                drop(listener);
                let _ = closing.send(());
                graceful.shutdown().await;
            }),
            None,
        ),
        Some(tls) => {
            let (mut incoming, accept) = tls.incoming(listener);
            let serving = tokio::spawn(async move {
                loop {
                    tokio::select! {
                        conn = incoming.next() => {
                            let Some(conn) = conn else { break };
                            let Ok(conn) = conn else { continue };
                            let certs = conn.get_ref().1.peer_certificates().map(|c| c.to_vec());
                            tokio::spawn(proxy.clone().connection(conn, certs, &graceful));
                        }
                        _ = stopped.changed() => break,
                    }
                }
                // The listener is the handshakes' task's, which `stop_accepting` ends.
                drop(incoming);
                let _ = closing.send(());
                graceful.shutdown().await;
            });
            (serving, Some(accept))
        }
    };
    tracing::info!(addr = %opts.listen, upstream = %opts.upstream, "OpenAI-compatible proxy listening");
    Ok(Running {
        stop,
        serving,
        handshakes,
        closed: Some(closed),
    })
}

type Certs = Vec<rustls_pki_types::CertificateDer<'static>>;

impl Proxy {
    /// Serves one HTTP/1.1 connection, watched by `graceful` so that a drain lets its request in
    /// flight finish.
    fn connection<S>(
        self: Arc<Self>,
        io: S,
        certs: Option<Certs>,
        graceful: &hyper_util::server::graceful::GracefulShutdown,
    ) -> impl std::future::Future<Output = ()> + Send + 'static
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let certs = Arc::new(certs);
        let svc = hyper::service::service_fn(move |req| {
            let (proxy, certs) = (self.clone(), certs.clone());
            async move { Ok::<_, Infallible>(proxy.handle(req, certs.as_ref().as_deref()).await) }
        });
        let conn = hyper::server::conn::http1::Builder::new()
            .serve_connection(hyper_util::rt::TokioIo::new(io), svc);
        let conn = graceful.watch(conn);
        async move {
            let _ = conn.await;
        }
    }

    async fn handle(
        self: Arc<Self>,
        req: Request<hyper::body::Incoming>,
        certs: Option<&[rustls_pki_types::CertificateDer<'static>]>,
    ) -> Response<Body> {
        let auth = self.auth(&req, certs);
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

    /// Who sent `req`: its TLS client certificate and `authorization` header only.
    fn auth<B>(
        &self,
        req: &Request<B>,
        certs: Option<&[rustls_pki_types::CertificateDer<'static>]>,
    ) -> CallerAuth {
        let Some(callers) = &self.callers else {
            return CallerAuth::Unchecked;
        };
        let authorization = req
            .headers()
            .get(hyper::header::AUTHORIZATION)
            .map(|v| v.as_bytes());
        callers.current().identify(certs, authorization)
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
        let namespace = namespace.unwrap_or_else(|| default_namespace(&auth));
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

/// The namespace of a request without `x-sluice-namespace`: the caller's, when the policy gives it
/// exactly one, else `default`.
fn default_namespace(auth: &CallerAuth) -> String {
    match auth {
        CallerAuth::Verified(i) if i.namespaces.len() == 1 && i.namespaces[0] != "*" => {
            i.namespaces[0].clone()
        }
        _ => "default".to_string(),
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
