//! The MCP servers behind the proxy: one HTTP/1 client for all (HTTPS with the system's roots, or
//! plain HTTP), each message POSTed with the client's session and protocol version, every answer
//! (a JSON message, an SSE stream of them, or none) bounded by the server's timeout.

use super::Call;
use super::rpc;
use crate::http_port::Body;
use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper::{Response, StatusCode};
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use serde_json::Value;
use std::time::Duration;

pub(crate) type HttpClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

pub(crate) fn client() -> anyhow::Result<HttpClient> {
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_native_roots()
        .map_err(|e| {
            anyhow::anyhow!("loading the system's root certificates for the MCP servers: {e}")
        })?
        .https_or_http()
        .enable_http1()
        .build();
    Ok(Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(connector))
}

pub(crate) struct Server {
    pub(crate) name: String,
    pub(crate) url: String,
    pub(crate) client: HttpClient,
    pub(crate) timeout: Duration,
    pub(crate) pass_non_text: bool,
}

/// What a server answered to a message.
pub(crate) enum Answer {
    /// No body (202 Accepted for a notification or a response).
    Empty {
        status: StatusCode,
        session: Option<String>,
    },
    /// One JSON-RPC message.
    Json {
        session: Option<String>,
        message: Value,
    },
    /// An SSE stream of messages, the last of them the answer.
    Stream {
        session: Option<String>,
        events: Events,
    },
}

impl Server {
    /// POSTs one message to the server, in the call's session.
    pub(crate) async fn send(&self, call: &Call, message: &Value) -> Result<Answer, String> {
        let resp = self
            .request(call, hyper::Method::POST, Some(message.to_string()))
            .await?;
        let status = resp.status();
        let session = resp
            .headers()
            .get(super::SESSION_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let content_type = resp
            .headers()
            .get(hyper::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_ascii_lowercase();
        if status == StatusCode::NOT_FOUND && call.session_id.is_some() {
            // The server ended the session: the client must open a new one, as the transport says.
            return Ok(Answer::Empty { status, session });
        }
        if !status.is_success() {
            let body = self.read(resp).await.unwrap_or_default();
            let said = serde_json::from_slice::<Value>(&body).ok().and_then(|v| {
                v.pointer("/error/message")
                    .and_then(Value::as_str)
                    .map(str::to_string)
            });
            return Err(match said {
                Some(m) => format!("the MCP server {:?} answered HTTP {status}: {m}", self.name),
                None => format!("the MCP server {:?} answered HTTP {status}", self.name),
            });
        }
        if content_type.starts_with("text/event-stream") {
            return Ok(Answer::Stream {
                session,
                events: Events {
                    body: resp.into_body(),
                    buffer: BytesMut::new(),
                    timeout: self.timeout,
                    server: self.name.clone(),
                },
            });
        }
        let body = self.read(resp).await?;
        if body.iter().all(u8::is_ascii_whitespace) {
            return Ok(Answer::Empty { status, session });
        }
        let message = serde_json::from_slice(&body).map_err(|e| {
            format!(
                "the MCP server {:?} answered with a body that is not JSON: {e}",
                self.name
            )
        })?;
        Ok(Answer::Json { session, message })
    }

    /// Ends the call's session on the server (`DELETE`), answering as it did.
    pub(crate) async fn delete(&self, call: &Call) -> Response<Body> {
        match self.request(call, hyper::Method::DELETE, None).await {
            Ok(resp) => {
                let status = resp.status();
                let mut out = Response::new(Full::new(Bytes::new()).boxed());
                *out.status_mut() = status;
                out
            }
            Err(e) => rpc::http_error(StatusCode::BAD_GATEWAY, e),
        }
    }

    async fn request(
        &self,
        call: &Call,
        method: hyper::Method,
        body: Option<String>,
    ) -> Result<Response<hyper::body::Incoming>, String> {
        let mut req = hyper::Request::builder()
            .method(method)
            .uri(&self.url)
            .header(hyper::header::ACCEPT, "application/json, text/event-stream");
        if body.is_some() {
            req = req.header(hyper::header::CONTENT_TYPE, "application/json");
        }
        if let Some(id) = &call.session_id {
            req = req.header(super::SESSION_HEADER, id);
        }
        if let Some(v) = &call.protocol_version {
            req = req.header("mcp-protocol-version", v);
        }
        let req = req
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| {
                format!(
                    "building the request to the MCP server {:?}: {e}",
                    self.name
                )
            })?;
        match tokio::time::timeout(self.timeout, self.client.request(req)).await {
            Err(_) => Err(format!(
                "the MCP server {:?} did not answer within {} s",
                self.name,
                self.timeout.as_secs()
            )),
            Ok(Err(e)) => Err(format!(
                "the MCP server {:?} cannot be reached: {e}",
                self.name
            )),
            Ok(Ok(resp)) => Ok(resp),
        }
    }

    /// Reads a whole answer, within the timeout.
    async fn read(&self, resp: Response<hyper::body::Incoming>) -> Result<Bytes, String> {
        let body = http_body_util::Limited::new(resp.into_body(), MAX_EVENT_BYTES);
        match tokio::time::timeout(self.timeout, body.collect()).await {
            Ok(Ok(b)) => Ok(b.to_bytes()),
            Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => Err(format!(
                "the MCP server {:?} answered with over {MAX_EVENT_BYTES} bytes",
                self.name
            )),
            Ok(Err(e)) => Err(format!(
                "the MCP server {:?}'s answer broke off: {e}",
                self.name
            )),
            Err(_) => Err(format!(
                "the MCP server {:?}'s answer did not finish within {} s",
                self.name,
                self.timeout.as_secs()
            )),
        }
    }
}

/// The messages of a server's SSE answer, one at a time.
pub(crate) struct Events {
    body: hyper::body::Incoming,
    buffer: BytesMut,
    timeout: Duration,
    server: String,
}

impl Events {
    /// The next message; `None` at the stream's end. Waiting longer than the timeout for one, a
    /// broken stream or an event that is not JSON is an error.
    pub(crate) async fn next(&mut self) -> Result<Option<Value>, String> {
        loop {
            if let Some(data) = self.take_event() {
                let Some(data) = data else { continue };
                return serde_json::from_str(&data).map(Some).map_err(|e| {
                    format!(
                        "the MCP server {:?} sent an event that is not JSON: {e}",
                        self.server
                    )
                });
            }
            let frame = match tokio::time::timeout(self.timeout, self.body.frame()).await {
                Err(_) => {
                    return Err(format!(
                        "the MCP server {:?} sent nothing for {} s",
                        self.server,
                        self.timeout.as_secs()
                    ));
                }
                Ok(None) => return Ok(None),
                Ok(Some(Err(e))) => {
                    return Err(format!(
                        "the MCP server {:?}'s stream broke off: {e}",
                        self.server
                    ));
                }
                Ok(Some(Ok(frame))) => frame,
            };
            if let Ok(data) = frame.into_data() {
                self.buffer.extend_from_slice(&data);
                if self.buffer.len() > MAX_EVENT_BYTES {
                    return Err(format!(
                        "the MCP server {:?} sent an event over {MAX_EVENT_BYTES} bytes",
                        self.server
                    ));
                }
            }
        }
    }

    /// The next whole event in the buffer: `Some(Some(data))`, `Some(None)` for an event without
    /// data (a comment, a keep-alive, an id alone), `None` when no event is whole yet.
    fn take_event(&mut self) -> Option<Option<String>> {
        let (end, sep) = crate::openai::sse::find_event_end(&self.buffer)?;
        let raw = self.buffer.split_to(end);
        let _ = self.buffer.split_to(sep);
        let text = String::from_utf8_lossy(&raw);
        let data: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(|d| d.strip_prefix(' ').unwrap_or(d))
            .collect();
        Some((!data.is_empty()).then(|| data.join("\n")))
    }
}

/// A server's answer (a JSON body, or one SSE event) is at most this large.
const MAX_EVENT_BYTES: usize = 16 * 1024 * 1024;
