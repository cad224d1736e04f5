//! A fake OpenAI-compatible LLM (`POST /v1/chat/completions`, streamed and not; `GET /v1/models`),
//! the upstream of the gateway's OpenAI proxy in `make run`, its tests and its benchmark.
//!
//! It answers deterministically from the last message:
//! - a user message is echoed back (`echo: <text>`);
//! - a user message starting with `tool:` is answered with a tool call: `tool: read_file /etc/x`
//!   calls `read_file` with `{"path": "/etc/x"}`;
//! - a user message starting with `error:` is answered with HTTP 429 and an OpenAI error object;
//! - a user message starting with `break:` streams half of its echo and then closes the
//!   connection without finishing the reply (not streamed: the whole echo);
//! - a user message starting with `slow:` streams its echo slowly (one chunk per 50 ms, the text
//!   repeated 200 times), for tests of a client that goes away mid-stream;
//! - a user message starting with `contact:` is answered with contact details (phone numbers and
//!   email addresses the user never wrote), for tests of the reply's redaction;
//! - a user message starting with `side:` is answered with the contact details in `content` and
//!   again in every side field a model may fill (`refusal`, `reasoning_content`, `audio.transcript` and
//!   `audio.data`, `annotations`, and a field the API does not have, `extra_text`), streamed and not;
//! - a user message starting with `legacy:` is answered with a legacy `function_call` (`legacy:
//!   read_file /etc/x`), one starting with `custom:` with a custom tool call;
//! - a user message starting with `more:` is answered with two choices of the contact details,
//!   whatever `n` asked for;
//! - a `tool` message (a tool result) is answered with `tool said: <result>`.
//!
//! Every text reply carries `logprobs` (each word a token, with its `bytes` and `top_logprobs`) when
//! the request asks for them, and `n` choices when it asks for more than one (`n` read leniently:
//! `2`, `2.0` and `"2"` are all two).
//!
//! `GET /fake/stats` tells how many streams were finished and how many were cancelled (the reader
//! went away before the end): what the proxy's disconnect tests assert. `GET /fake/requests` is every
//! request body received, in order (also `OpenAiStats::received`): what tests search for raw text.

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::Frame;
use hyper::{Response, StatusCode};
use serde_json::{Value, json};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The model name the fake LLM reports when a request names none.
const DEFAULT_MODEL: &str = "fake-llm";

/// The answer to `contact:`: personal data spread over a reply long enough for several flushes.
pub const CONTACT_REPLY: &str = "Our support desk is open from nine to five. You can call Sam on \
    555-0123-4567 or write to sam.jones@example.com; outside office hours the on-call number is \
    020-7946-0958 and the address is oncall@example.org. Please quote your ticket number.";

/// What the fake LLM counts, for tests.
#[derive(Default, Debug)]
pub struct OpenAiStats {
    pub requests: AtomicU64,
    pub streams_finished: AtomicU64,
    pub streams_cancelled: AtomicU64,
    /// Every chat completion request's body, in order.
    pub received: std::sync::Mutex<Vec<Value>>,
}

impl OpenAiStats {
    /// The request bodies received so far.
    pub fn received(&self) -> Vec<Value> {
        self.received.lock().map(|r| r.clone()).unwrap_or_default()
    }
}

/// The fake LLM, listening.
pub struct FakeOpenAi {
    pub addr: SocketAddr,
    pub stats: Arc<OpenAiStats>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeOpenAi {
    pub async fn start(addr: SocketAddr) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let stats = Arc::new(OpenAiStats::default());
        let task = tokio::spawn(serve(listener, stats.clone()));
        Ok(Self { addr, stats, task })
    }

    pub fn stop(self) {
        self.task.abort();
    }
}

type Body = BoxBody<Bytes, Infallible>;

async fn serve(listener: tokio::net::TcpListener, stats: Arc<OpenAiStats>) {
    use hyper::service::service_fn;
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let stats = stats.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let stats = stats.clone();
                async move { Ok::<_, Infallible>(answer(req, stats).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                .await;
        });
    }
}

fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    let mut resp = Response::new(Full::new(Bytes::from(v.to_string())).boxed());
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert("content-type", "application/json".parse().expect("static"));
    resp
}

fn error(status: StatusCode, message: &str, kind: &str, code: &str) -> Response<Body> {
    json_response(
        status,
        &json!({"error": {"message": message, "type": kind, "param": null, "code": code}}),
    )
}

async fn answer(
    req: hyper::Request<hyper::body::Incoming>,
    stats: Arc<OpenAiStats>,
) -> Response<Body> {
    let path = req.uri().path().to_string();
    match (req.method().as_str(), path.as_str()) {
        ("GET", "/v1/models") => json_response(
            StatusCode::OK,
            &json!({"object": "list", "data": [
                {"id": DEFAULT_MODEL, "object": "model", "created": 0, "owned_by": "sluice-examples"},
                {"id": "support-bot", "object": "model", "created": 0, "owned_by": "sluice-examples"},
            ]}),
        ),
        ("GET", "/fake/stats") => json_response(
            StatusCode::OK,
            &json!({
                "requests": stats.requests.load(Ordering::Relaxed),
                "streams_finished": stats.streams_finished.load(Ordering::Relaxed),
                "streams_cancelled": stats.streams_cancelled.load(Ordering::Relaxed),
            }),
        ),
        ("GET", "/fake/requests") => json_response(StatusCode::OK, &json!(stats.received())),
        ("POST", "/v1/chat/completions") => {
            stats.requests.fetch_add(1, Ordering::Relaxed);
            let body = match http_body_util::Limited::new(req.into_body(), 4 << 20)
                .collect()
                .await
            {
                Ok(b) => b.to_bytes(),
                Err(_) => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        "unreadable body",
                        "invalid_request_error",
                        "bad_body",
                    );
                }
            };
            let Ok(request) = serde_json::from_slice::<Value>(&body) else {
                return error(
                    StatusCode::BAD_REQUEST,
                    "the body is not JSON",
                    "invalid_request_error",
                    "bad_json",
                );
            };
            if let Ok(mut r) = stats.received.lock() {
                r.push(request.clone());
            }
            completion(&request, stats)
        }
        _ => error(
            StatusCode::NOT_FOUND,
            "no such route",
            "invalid_request_error",
            "not_found",
        ),
    }
}

/// What the fake model says to a request.
enum Reply {
    Text {
        text: String,
        slow: bool,
        /// Stop halfway and close the connection.
        broken: bool,
    },
    ToolCall {
        name: String,
        arguments: String,
    },
    /// The text in `content` and in every side field.
    Side(String),
    /// A legacy `function_call` (`legacy: NAME PATH`).
    FunctionCall {
        name: String,
        arguments: String,
    },
    /// A custom tool call (`custom: NAME INPUT`).
    Custom {
        name: String,
        input: String,
    },
    /// Two choices, whatever was asked.
    More(String),
    Error,
}

fn reply_to(request: &Value) -> Reply {
    let last = request
        .get("messages")
        .and_then(Value::as_array)
        .and_then(|m| m.last());
    let role = last
        .and_then(|m| m.get("role"))
        .and_then(Value::as_str)
        .unwrap_or_default();
    let content = last
        .and_then(|m| m.get("content"))
        .and_then(Value::as_str)
        .unwrap_or_default();
    if role == "tool" {
        return Reply::Text {
            text: format!("tool said: {content}"),
            slow: false,
            broken: false,
        };
    }
    if let Some(call) = content.strip_prefix("tool:") {
        let call = call.trim();
        let (name, path) = call.split_once(' ').unwrap_or((call, ""));
        return Reply::ToolCall {
            name: name.to_string(),
            arguments: json!({"path": path.trim()}).to_string(),
        };
    }
    if content.starts_with("side:") {
        return Reply::Side(CONTACT_REPLY.to_string());
    }
    if content.starts_with("more:") {
        return Reply::More(CONTACT_REPLY.to_string());
    }
    if let Some(call) = content.strip_prefix("legacy:") {
        let call = call.trim();
        let (name, path) = call.split_once(' ').unwrap_or((call, ""));
        return Reply::FunctionCall {
            name: name.to_string(),
            arguments: json!({"path": path.trim()}).to_string(),
        };
    }
    if let Some(call) = content.strip_prefix("custom:") {
        let call = call.trim();
        let (name, input) = call.split_once(' ').unwrap_or((call, ""));
        return Reply::Custom {
            name: name.to_string(),
            input: input.trim().to_string(),
        };
    }
    if content.starts_with("contact:") {
        return Reply::Text {
            text: CONTACT_REPLY.to_string(),
            slow: false,
            broken: false,
        };
    }
    if content.starts_with("error:") {
        return Reply::Error;
    }
    if let Some(rest) = content.strip_prefix("break:") {
        return Reply::Text {
            text: format!("echo: {rest} ").repeat(20),
            slow: false,
            broken: true,
        };
    }
    if let Some(rest) = content.strip_prefix("slow:") {
        return Reply::Text {
            text: format!("echo: {rest} ").repeat(200),
            slow: true,
            broken: false,
        };
    }
    Reply::Text {
        text: format!("echo: {content}"),
        slow: false,
        broken: false,
    }
}

/// How many choices a request asks for, read leniently (`2`, `2.0`, `"2"`), at most 8.
fn choices_asked(request: &Value) -> usize {
    let n = match request.get("n") {
        Some(Value::Number(n)) => n.as_f64().unwrap_or(1.0),
        Some(Value::String(s)) => s.trim().parse().unwrap_or(1.0),
        _ => 1.0,
    };
    (n.max(1.0) as usize).min(8)
}

/// The `logprobs` of `text`: each word a token, with its bytes and one alternative.
fn logprobs_of(text: &str) -> Value {
    let token = |t: &str| json!({"token": t, "bytes": t.as_bytes(), "logprob": -0.5});
    let content: Vec<Value> = text
        .split_inclusive(' ')
        .map(|t| {
            let mut v = token(t);
            v["top_logprobs"] = json!([token(t)]);
            v
        })
        .collect();
    json!({"content": content, "refusal": null})
}

fn completion(request: &Value, stats: Arc<OpenAiStats>) -> Response<Body> {
    let model = request
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or(DEFAULT_MODEL)
        .to_string();
    let stream = request
        .get("stream")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let include_usage = request
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let want_logprobs = request
        .get("logprobs")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let prompt_tokens = request
        .get("messages")
        .and_then(Value::as_array)
        .map_or(0, |m| m.len() as u64 * 10);
    let id = format!("chatcmpl-fake-{}", stats.requests.load(Ordering::Relaxed));
    let reply = reply_to(request);
    let mut choices = choices_asked(request);
    let (message, finish, completion_tokens) = match &reply {
        Reply::Error => {
            return error(
                StatusCode::TOO_MANY_REQUESTS,
                "the fake LLM was asked for an error",
                "rate_limit_error",
                "rate_limit_exceeded",
            );
        }
        Reply::Text { text, .. } => (
            json!({"role": "assistant", "content": text}),
            "stop",
            text.split_whitespace().count() as u64,
        ),
        Reply::Side(text) => (
            json!({"role": "assistant", "content": text, "refusal": text,
                   "reasoning_content": text, "extra_text": text,
                   "annotations": [{"type": "url_citation", "url_citation": {"title": text, "url": "https://docs.invalid/", "start_index": 0, "end_index": 1}}],
                   "audio": {"id": "audio_1", "data": format!("fake-audio:{text}"), "transcript": text, "expires_at": 1_700_000_000u64}}),
            "stop",
            5,
        ),
        Reply::More(text) => {
            choices = choices.max(2);
            (json!({"role": "assistant", "content": text}), "stop", 5)
        }
        Reply::ToolCall { name, arguments } => (
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}
            ]}),
            "tool_calls",
            5,
        ),
        Reply::FunctionCall { name, arguments } => (
            json!({"role": "assistant", "content": null,
                   "function_call": {"name": name, "arguments": arguments}}),
            "function_call",
            5,
        ),
        Reply::Custom { name, input } => (
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "custom", "custom": {"name": name, "input": input}}
            ]}),
            "tool_calls",
            5,
        ),
    };
    let text = message
        .get("content")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let logprobs = if want_logprobs && !text.is_empty() {
        logprobs_of(&text)
    } else {
        Value::Null
    };
    let usage = json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    });
    if !stream {
        let all: Vec<Value> = (0..choices)
            .map(|i| json!({"index": i, "message": message, "finish_reason": finish, "logprobs": logprobs}))
            .collect();
        return json_response(
            StatusCode::OK,
            &json!({
                "id": id, "object": "chat.completion", "created": 1_700_000_000u64, "model": model,
                "choices": all, "usage": usage, "system_fingerprint": "fp_fake",
            }),
        );
    }
    let chunk = move |delta: Value, finish: Option<&str>| {
        let v = json!({
            "id": id, "object": "chat.completion.chunk", "created": 1_700_000_000u64, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null}],
        });
        v
    };
    let mut events: Vec<Value> = vec![chunk(json!({"role": "assistant", "content": ""}), None)];
    let slow = matches!(reply, Reply::Text { slow: true, .. });
    let broken = matches!(reply, Reply::Text { broken: true, .. });
    // Small chunks, cut anywhere (inside words and numbers), as real models send them; each with
    // its logprobs when they were asked for, and on every choice asked for.
    let pieces = |text: &str| -> Vec<String> {
        let chars: Vec<char> = text.chars().collect();
        chars.chunks(5).map(|p| p.iter().collect()).collect()
    };
    match &reply {
        Reply::Text { text, .. } | Reply::More(text) => {
            for piece in pieces(text) {
                for i in 0..choices {
                    let mut c = chunk(json!({"content": piece}), None);
                    c["choices"][0]["index"] = json!(i);
                    if want_logprobs {
                        c["choices"][0]["logprobs"] = logprobs_of(&piece);
                    }
                    events.push(c);
                }
            }
        }
        Reply::Side(text) => {
            for piece in pieces(text) {
                let mut c = chunk(
                    json!({"content": piece, "refusal": piece, "reasoning_content": piece,
                           "extra_text": piece, "audio": {"id": "audio_1", "transcript": piece, "data": format!("fake-audio:{piece}")}}),
                    None,
                );
                if want_logprobs {
                    c["choices"][0]["logprobs"] = logprobs_of(&piece);
                }
                events.push(c);
            }
        }
        Reply::ToolCall { name, arguments } => {
            events.push(chunk(
                json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": name, "arguments": ""}}]}),
                None,
            ));
            let (a, b) = arguments.split_at(arguments.len() / 2);
            for part in [a, b] {
                events.push(chunk(
                    json!({"tool_calls": [{"index": 0, "function": {"arguments": part}}]}),
                    None,
                ));
            }
        }
        Reply::FunctionCall { name, arguments } => {
            events.push(chunk(
                json!({"function_call": {"name": name, "arguments": ""}}),
                None,
            ));
            events.push(chunk(
                json!({"function_call": {"arguments": arguments}}),
                None,
            ));
        }
        Reply::Custom { name, input } => {
            events.push(chunk(
                json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "custom", "custom": {"name": name, "input": input}}]}),
                None,
            ));
        }
        Reply::Error => {}
    }
    if broken {
        // Half the reply, then the connection closes: no finish, no [DONE].
        events.truncate(events.len() / 2);
    } else {
        events.push(chunk(json!({}), Some(finish)));
    }
    if include_usage {
        let mut last = chunk(json!({}), None);
        last["choices"] = json!([]);
        last["usage"] = usage;
        events.push(last);
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Infallible>>(4);
    tokio::spawn(async move {
        for e in events {
            if slow {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            if tx
                .send(Ok(Frame::data(Bytes::from(format!("data: {e}\n\n")))))
                .await
                .is_err()
            {
                stats.streams_cancelled.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
        if tx
            .send(Ok(Frame::data(Bytes::from_static(b"data: [DONE]\n\n"))))
            .await
            .is_err()
        {
            stats.streams_cancelled.fetch_add(1, Ordering::Relaxed);
            return;
        }
        stats.streams_finished.fetch_add(1, Ordering::Relaxed);
    });
    let body = StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    let mut resp = Response::new(BodyExt::boxed(body));
    resp.headers_mut()
        .insert("content-type", "text/event-stream".parse().expect("static"));
    resp
}
