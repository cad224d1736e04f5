//! The MCP proxy (`--mcp-listen ADDR --mcp-server NAME=URL`): the gateway serves each named upstream
//! MCP server (Streamable HTTP) at `/mcp/NAME` and runs the chains of target `NAME` on what passes:
//! `tools/list` through `before_model` (a chain can hide tools, and a hidden tool cannot be
//! called), `tools/call` arguments through `before_tool` and results through `after_tool`,
//! `sampling/createMessage` from the server through `input`. Any other method is refused. An agent
//! changes only its MCP server's URL. Callers are identified and bound to namespaces as on the gRPC
//! port; an MCP session stays with the caller and namespace that opened it.
//!
//! Reading order: this file (the port, routing, who is calling, sessions) → `guard` (each method
//! through its trigger point, and the allow-list of what may pass) → `upstream` (the MCP servers
//! behind, their JSON and SSE answers).

mod guard;
mod rpc;
mod session;
mod upstream;

use crate::callers::ReloadingPolicy;
use crate::http_port::{Body, Certs, Running};
use crate::tls::ReloadingTls;
use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::{Method, Request, Response, StatusCode};
use rpc::Message;
use sluice_crds::TriggerPoint;
use sluice_engine::{CallerAuth, Engine, EngineError};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// One upstream MCP server: the name it is served under (the target of its chains) and its
/// Streamable HTTP endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct McpServer {
    pub name: String,
    pub url: String,
}

impl std::str::FromStr for McpServer {
    type Err = String;

    /// `NAME=URL`, as `--mcp-server` takes it.
    fn from_str(s: &str) -> Result<Self, String> {
        let (name, url) = s
            .split_once('=')
            .ok_or_else(|| format!("{s:?} is not NAME=URL"))?;
        let name = name.trim();
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
        {
            return Err(format!(
                "{name:?} is not a server name (letters, digits, '-', '_' and '.'; it is the target of its chains)"
            ));
        }
        let url = url.trim();
        if !(url.starts_with("http://") || url.starts_with("https://"))
            || url.parse::<hyper::Uri>().is_err()
        {
            return Err(format!("{url:?} is not an http:// or https:// URL"));
        }
        Ok(Self {
            name: name.to_string(),
            url: url.to_string(),
        })
    }
}

/// How the MCP proxy is configured (`--mcp-*`).
#[derive(Clone, Debug)]
pub struct McpOptions {
    pub listen: SocketAddr,
    pub servers: Vec<McpServer>,
    /// How long an upstream server may take before its answer's head, and between two events of a
    /// streamed answer.
    pub upstream_timeout: Duration,
    /// Servers whose non-text content (images, audio, binary resources: what no chain reads) is
    /// passed on; from every other server it is dropped.
    pub pass_non_text: Vec<String>,
    /// The key session ids are sealed under (`--mcp-session-key-file`, at least 32 bytes): every
    /// replica of a gateway needs the same one to serve a session another opened. Without it, a
    /// key of the process's own.
    pub session_key_file: Option<std::path::PathBuf>,
}

impl McpOptions {
    pub fn new(listen: SocketAddr, servers: Vec<McpServer>) -> Self {
        Self {
            listen,
            servers,
            upstream_timeout: Duration::from_secs(60),
            pass_non_text: Vec::new(),
            session_key_file: None,
        }
    }
}

/// Header naming the namespace a request's chains are in, as on the OpenAI-compatible port.
const NAMESPACE_HEADER: &str = "x-sluice-namespace";
/// The trigger points MCP messages pass (a platform baseline at one of them guards every server).
const GUARDED_AT: [sluice_crds::TriggerPoint; 4] = [
    sluice_crds::TriggerPoint::Input,
    sluice_crds::TriggerPoint::BeforeModel,
    sluice_crds::TriggerPoint::BeforeTool,
    sluice_crds::TriggerPoint::AfterTool,
];
/// The MCP session header (Streamable HTTP).
const SESSION_HEADER: &str = "mcp-session-id";

/// The proxy, shared by every connection.
pub(crate) struct Proxy {
    engine: Arc<Engine>,
    callers: Option<Arc<ReloadingPolicy>>,
    servers: BTreeMap<String, Arc<upstream::Server>>,
    sessions: Arc<session::Sessions>,
}

/// Starts the proxy on a listener already bound.
pub(crate) fn start(
    engine: Arc<Engine>,
    callers: Option<Arc<ReloadingPolicy>>,
    tls: Option<Arc<ReloadingTls>>,
    listener: tokio::net::TcpListener,
    opts: &McpOptions,
) -> anyhow::Result<Running> {
    let client = upstream::client()?;
    let servers = opts
        .servers
        .iter()
        .map(|s| {
            let server = upstream::Server {
                name: s.name.clone(),
                url: s.url.clone(),
                client: client.clone(),
                timeout: opts.upstream_timeout,
                pass_non_text: opts.pass_non_text.contains(&s.name),
            };
            (s.name.clone(), Arc::new(server))
        })
        .collect();
    let key = match &opts.session_key_file {
        Some(path) => {
            let key = std::fs::read(path).with_context(|| {
                format!(
                    "reading the MCP session key {} (--mcp-session-key-file)",
                    path.display()
                )
            })?;
            anyhow::ensure!(
                key.len() >= 32,
                "the MCP session key {} has {} bytes: it needs at least 32 (e.g. `head -c 32 /dev/urandom`)",
                path.display(),
                key.len()
            );
            key
        }
        None => session::Sessions::random_key(),
    };
    let proxy = Arc::new(Proxy {
        engine,
        callers,
        servers,
        sessions: Arc::new(session::Sessions::new(key)),
    });
    let running = crate::http_port::serve("MCP", listener, tls, move |req, certs| {
        proxy.clone().handle(req, certs)
    });
    let names: Vec<&str> = opts.servers.iter().map(|s| s.name.as_str()).collect();
    tracing::info!(addr = %opts.listen, servers = ?names, "MCP proxy listening");
    Ok(running)
}

/// One request's place: who sent it, for which server and namespace, in which session.
#[derive(Clone)]
pub(crate) struct Call {
    pub(crate) engine: Arc<Engine>,
    pub(crate) server: Arc<upstream::Server>,
    pub(crate) auth: CallerAuth,
    pub(crate) namespace: String,
    /// This replica's record of the MCP session, once the server gave one.
    pub(crate) session: Option<Arc<session::Session>>,
    /// The server's id of the session (the client holds it sealed).
    pub(crate) session_id: Option<String>,
    pub(crate) sessions: Arc<session::Sessions>,
    pub(crate) protocol_version: Option<String>,
    /// The sandboxes of the runs made once the server answered, kept until the client's answer is
    /// written (handing one back prepares its next cell: a core for milliseconds, which must not
    /// delay the answer). Runs before the server's call hand theirs back at once: the call itself
    /// covers their recycling.
    pub(crate) held: Arc<Held>,
}

#[derive(Default)]
pub(crate) struct Held {
    pub(crate) on: std::sync::atomic::AtomicBool,
    list: std::sync::Mutex<Vec<sluice_engine::Handback>>,
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
        let Some(name) = path.strip_prefix("/mcp/") else {
            return rpc::http_error(
                StatusCode::NOT_FOUND,
                format!(
                    "no MCP server is served at {path}: the proxy serves /mcp/NAME for each --mcp-server"
                ),
            );
        };
        let Some(server) = self.servers.get(name) else {
            let names: Vec<&str> = self.servers.keys().map(String::as_str).collect();
            return rpc::http_error(
                StatusCode::NOT_FOUND,
                format!("no MCP server named {name:?} is served here (served: {names:?})"),
            );
        };
        if let CallerAuth::Unauthenticated(why) = &auth {
            return rpc::http_error(StatusCode::UNAUTHORIZED, why.clone());
        }
        let namespace = crate::http_port::header(&req, NAMESPACE_HEADER)
            .unwrap_or_else(|| crate::http_port::default_namespace(&auth));
        if let Err(e) = auth.admit(&namespace) {
            return rpc::http_error(StatusCode::FORBIDDEN, e.to_string());
        }
        // A server no chain guards in this namespace is not served unguarded.
        let registry = self.engine.registry();
        let guarded = registry.serves_target(&namespace, name)
            || GUARDED_AT.iter().any(|tp| registry.baseline(*tp).is_some());
        if !guarded {
            return rpc::http_error(
                StatusCode::NOT_FOUND,
                format!(
                    "no HookChain serves MCP server {name:?} in namespace {namespace:?} (target {name:?}), so it is not served unguarded"
                ),
            );
        }
        let owner = session::Owner {
            auth: &auth,
            namespace: &namespace,
            server: &server.name,
        };
        let sealed = crate::http_port::header(&req, SESSION_HEADER);
        let (session_id, session) = match &sealed {
            None => (None, None),
            // A session is the caller's, in the namespace and on the server it was opened in; to
            // anyone else it does not exist (as the transport says of a session that ended).
            Some(id) => match self.sessions.unseal(id, &owner) {
                Some(upstream) => (Some(upstream), Some(self.sessions.get(id))),
                None => {
                    return rpc::http_error(
                        StatusCode::NOT_FOUND,
                        format!(
                            "no MCP session {id:?} of this caller on {name:?}: initialize a new one"
                        ),
                    );
                }
            },
        };
        let call = Call {
            engine: self.engine.clone(),
            server: server.clone(),
            auth,
            namespace,
            session,
            session_id,
            sessions: self.sessions.clone(),
            protocol_version: crate::http_port::header(&req, "mcp-protocol-version"),
            held: Default::default(),
        };
        match *req.method() {
            Method::POST => self.post(call, req).await,
            Method::DELETE => {
                let answer = server.delete(&call).await;
                if let Some(id) = &sealed {
                    self.sessions.end(id);
                }
                answer
            }
            // No stream the server opens on its own: what a server sends outside a request's
            // answer (notifications, requests) has no trigger point to pass. The transport lets a
            // server answer 405 here, and clients then listen on their requests' answers only.
            Method::GET => rpc::http_error(
                StatusCode::METHOD_NOT_ALLOWED,
                "the Sluice MCP proxy opens no standalone server stream (GET): what a server sends comes in the answers to requests",
            ),
            _ => rpc::http_error(
                StatusCode::METHOD_NOT_ALLOWED,
                format!(
                    "{} is not a method of the Streamable HTTP transport",
                    req.method()
                ),
            ),
        }
    }

    /// One JSON-RPC message from the client.
    async fn post(&self, call: Call, req: Request<hyper::body::Incoming>) -> Response<Body> {
        let content_type = crate::http_port::header(&req, "content-type").unwrap_or_default();
        if !content_type
            .split(';')
            .next()
            .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
        {
            return rpc::http_error(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!("an MCP message is application/json, not {content_type:?}"),
            );
        }
        let limit = self.engine.limits().request_bytes;
        let body = match http_body_util::Limited::new(req.into_body(), limit)
            .collect()
            .await
        {
            Ok(b) => b.to_bytes(),
            Err(e) if e.is::<http_body_util::LengthLimitError>() => {
                return rpc::http_error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("the message is over the limit of {limit} bytes"),
                );
            }
            Err(e) => {
                return rpc::http_error(
                    StatusCode::BAD_REQUEST,
                    format!("the request body could not be read: {e}"),
                );
            }
        };
        let message = match Message::parse(&body) {
            Ok(m) => m,
            Err(invalid) => return invalid.into_response(),
        };
        let held = call.held.clone();
        let resp = guard::message(call, message).await;
        crate::handback::hold_until_written(resp, held)
    }
}

impl Call {
    pub(crate) fn owner(&self) -> session::Owner<'_> {
        session::Owner {
            auth: &self.auth,
            namespace: &self.namespace,
            server: &self.server.name,
        }
    }

    /// Runs `payload` through `trigger_point` of this server's chains (the tenant's, after the
    /// platform's baseline), with the MCP method in the context.
    pub(crate) async fn run(
        &self,
        trigger_point: TriggerPoint,
        method: &str,
        payload: serde_json::Value,
    ) -> Result<guard::Verdict, EngineError> {
        let input = sluice_engine::RunInput {
            namespace: self.namespace.clone(),
            target: self.server.name.clone(),
            trigger_point: trigger_point.as_str().to_string(),
            payload: Some(payload.clone()),
            context: BTreeMap::from([("mcp_method".to_string(), method.to_string())]),
            session_id: self.session_id.clone().unwrap_or_default(),
            auth: self.auth.clone(),
            via: Some(sluice_engine::Via::proxy("mcp", Some(method))),
        };
        let engine = self.engine.clone();
        // The run goes on in a task of its own: a client that goes away drops this future, never
        // the run, which is finished and audited all the same.
        let result = tokio::spawn(async move { engine.run_holding(input).await })
            .await
            .map_err(|e| {
                EngineError::Unavailable(format!("the run failed inside the gateway: {e}"))
            })?;
        match result {
            Ok((r, handback)) => {
                if self.held.on.load(std::sync::atomic::Ordering::Relaxed) {
                    self.held
                        .list
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(handback);
                }
                Ok(guard::Verdict::of(r.walk))
            }
            // No chain at this trigger point: nothing to enforce there.
            Err(EngineError::NotFound(_)) => Ok(guard::Verdict::Go(payload)),
            Err(e) => Err(e),
        }
    }

    /// Whether a chain (the tenant's or the platform's baseline) serves `tp` for this server.
    pub(crate) fn has_chain(&self, tp: sluice_crds::TriggerPoint) -> bool {
        let registry = self.engine.registry();
        let key = sluice_engine::ChainKey {
            namespace: self.namespace.clone(),
            target: self.server.name.clone(),
            trigger_point: tp,
        };
        registry.chain(&key).is_some() || registry.baseline(tp).is_some()
    }
}

/// A JSON answer.
pub(crate) fn json_response(status: StatusCode, v: &serde_json::Value) -> Response<Body> {
    let mut resp = Response::new(http_body_util::Full::new(Bytes::from(v.to_string())).boxed());
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    resp
}
