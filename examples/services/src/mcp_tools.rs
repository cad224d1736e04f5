//! A small MCP server (Streamable HTTP at `POST /mcp`, JSON answers, sessions) with the support
//! bot's tools: the upstream of the gateway's MCP proxy in `make run` and its benchmark. The proxy's
//! tests run against a server made with the official MCP SDK instead (clients/python/tests).
//!
//! Tools:
//! - `read_file {path}`: a file's (made-up) contents; under `/srv/support/` they include a line
//!   with a password, for the example `after_tool` chain to mask;
//! - `search {query}`: one line naming the query.

use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::Bytes;
use hyper::{Response, StatusCode};
use serde_json::{Value, json};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// What the server saw, for tests and benchmarks.
#[derive(Debug, Default)]
pub struct McpStats {
    pub tool_calls: AtomicU64,
}

pub struct FakeMcp {
    pub addr: SocketAddr,
    pub stats: Arc<McpStats>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeMcp {
    pub async fn start(addr: SocketAddr) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let stats = Arc::new(McpStats::default());
        let task = tokio::spawn(serve(listener, stats.clone()));
        Ok(Self { addr, stats, task })
    }

    pub fn stop(self) {
        self.task.abort();
    }
}

type Body = BoxBody<Bytes, Infallible>;

async fn serve(listener: tokio::net::TcpListener, stats: Arc<McpStats>) {
    use hyper::service::service_fn;
    let sessions = Arc::new(AtomicU64::new(0));
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (stats, sessions) = (stats.clone(), sessions.clone());
        tokio::spawn(async move {
            let svc = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let (stats, sessions) = (stats.clone(), sessions.clone());
                async move { Ok::<_, Infallible>(answer(req, &stats, &sessions).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                .await;
        });
    }
}

fn response(status: StatusCode, body: Option<&Value>) -> Response<Body> {
    let bytes = body.map(|v| Bytes::from(v.to_string())).unwrap_or_default();
    let mut resp = Response::new(Full::new(bytes).boxed());
    *resp.status_mut() = status;
    if body.is_some() {
        resp.headers_mut()
            .insert("content-type", "application/json".parse().expect("static"));
    }
    resp
}

async fn answer(
    req: hyper::Request<hyper::body::Incoming>,
    stats: &McpStats,
    sessions: &AtomicU64,
) -> Response<Body> {
    if req.uri().path() != "/mcp" {
        return response(StatusCode::NOT_FOUND, None);
    }
    match req.method().as_str() {
        "POST" => {}
        "DELETE" => return response(StatusCode::OK, None),
        _ => return response(StatusCode::METHOD_NOT_ALLOWED, None),
    }
    let Ok(body) = req.into_body().collect().await else {
        return response(StatusCode::BAD_REQUEST, None);
    };
    let Ok(message) = serde_json::from_slice::<Value>(&body.to_bytes()) else {
        return response(
            StatusCode::BAD_REQUEST,
            Some(
                &json!({"jsonrpc": "2.0", "id": null, "error": {"code": -32700, "message": "not JSON"}}),
            ),
        );
    };
    let Some(id) = message.get("id").cloned() else {
        // A notification or a response: nothing to answer.
        return response(StatusCode::ACCEPTED, None);
    };
    let method = message["method"].as_str().unwrap_or_default();
    let params = &message["params"];
    let result = match method {
        "initialize" => {
            let session = sessions.fetch_add(1, Ordering::Relaxed) + 1;
            let mut resp = response(
                StatusCode::OK,
                Some(&json!({"jsonrpc": "2.0", "id": id, "result": {
                    "protocolVersion": params["protocolVersion"].as_str().unwrap_or("2025-06-18"),
                    "capabilities": {"tools": {"listChanged": false}},
                    "serverInfo": {"name": "support-tools", "version": "1.0.0"},
                }})),
            );
            resp.headers_mut().insert(
                "mcp-session-id",
                format!("support-{session}").parse().expect("ascii"),
            );
            return resp;
        }
        "ping" => json!({}),
        "tools/list" => json!({"tools": [
            {"name": "read_file", "description": "Read a file of the support knowledge base.",
             "inputSchema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
            {"name": "search", "description": "Search the support knowledge base.",
             "inputSchema": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}},
        ]}),
        "tools/call" => {
            stats.tool_calls.fetch_add(1, Ordering::Relaxed);
            let args = &params["arguments"];
            let text = match params["name"].as_str().unwrap_or_default() {
                "read_file" => {
                    let path = args["path"].as_str().unwrap_or_default();
                    format!(
                        "# {path}\nReset a customer's password from the admin page.\nadmin login: password=hunter2\n"
                    )
                }
                "search" => format!(
                    "1 result for {:?}: /srv/support/faq.md",
                    args["query"].as_str().unwrap_or_default()
                ),
                other => {
                    return response(
                        StatusCode::OK,
                        Some(&json!({"jsonrpc": "2.0", "id": id, "result": {
                            "content": [{"type": "text", "text": format!("Unknown tool: {other}")}],
                            "isError": true,
                        }})),
                    );
                }
            };
            json!({"content": [{"type": "text", "text": text}], "isError": false})
        }
        _ => {
            return response(
                StatusCode::OK,
                Some(
                    &json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32601, "message": "Method not found"}}),
                ),
            );
        }
    };
    response(
        StatusCode::OK,
        Some(&json!({"jsonrpc": "2.0", "id": id, "result": result})),
    )
}
