//! A streamed reply (server-sent events): the upstream's content deltas go into the engine's
//! two-path `output` stream, and only what it commits is sent on, as deltas of the same completion
//! (id, model, created as the upstream gave them). Tool-call deltas are held until the reply is
//! over, then go through `after_model` and `before_tool` and are sent whole; so is the model's
//! `refusal`, through `output`, once the reply is over. Every other field of a delta is dropped
//! (`allow`), and a chunk in a form no chain reads (a second choice, a legacy `function_call`, a
//! custom tool call) ends the reply with an error event. A block stops the reply with
//! `finish_reason: "content_filter"`. A client that goes away ends the upstream call (its
//! connection is dropped) and the engine's stream, which is audited as cancelled.

use super::Body;
use super::allow;
use super::chat::{BLOCKED_FINISH_REASON, tool_calls};
use super::error::ApiError;
use super::hooks::{Hooks, Verdict};
use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use http_body_util::{BodyExt, StreamBody};
use hyper::Response;
use hyper::body::Frame;
use serde_json::{Value, json};
use sluice_crds::TriggerPoint;
use sluice_engine::{ClientStreamError, EngineError, StreamError, StreamInput, StreamOutput};
use std::convert::Infallible;
use std::time::Duration;
use tokio::sync::mpsc;

type Out = mpsc::Sender<Result<Frame<Bytes>, Infallible>>;

/// An event stream of `events`, then `[DONE]` (answers the gateway makes itself).
pub(crate) fn fixed(events: &[Value]) -> Response<Body> {
    let mut text = String::new();
    for e in events {
        text.push_str(&format!("data: {e}\n\n"));
    }
    text.push_str("data: [DONE]\n\n");
    event_stream(http_body_util::Full::new(Bytes::from(text)).boxed())
}

fn event_stream(body: Body) -> Response<Body> {
    let mut resp = Response::new(body);
    let h = resp.headers_mut();
    h.insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/event-stream"),
    );
    h.insert(
        hyper::header::CACHE_CONTROL,
        hyper::header::HeaderValue::from_static("no-cache"),
    );
    resp
}

/// Relays the upstream's streamed reply through the chains; the work goes on in a task of its own,
/// which ends when the reply is over or the client has gone.
pub(crate) fn relay(
    timeout: Duration,
    hooks: Hooks,
    upstream: Response<hyper::body::Incoming>,
) -> Response<Body> {
    let (tx, rx) = mpsc::channel(16);
    let relay = Relay {
        hooks,
        tx,
        timeout,
        template: None,
        role_sent: false,
        committed: String::new(),
        fed: Some(String::new()),
        calls: Vec::new(),
        refusal: String::new(),
        finish: None,
        usage: None,
    };
    tokio::spawn(relay.run(upstream.into_body()));
    let body = StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    event_stream(BodyExt::boxed(body))
}

/// One streamed reply in flight.
struct Relay {
    hooks: Hooks,
    tx: Out,
    timeout: Duration,
    /// The upstream's first chunk, whose id, model and created every chunk sent carries.
    template: Option<Value>,
    role_sent: bool,
    /// What was sent to the client so far.
    committed: String,
    /// What was handed to the engine so far, until it is known that a chain serves `output` (sent
    /// as it is when none does).
    fed: Option<String>,
    /// The reply's tool calls, assembled from their deltas.
    calls: Vec<Value>,
    /// The model's refusal, assembled from its deltas; sent through `output` at the end.
    refusal: String,
    finish: Option<String>,
    usage: Option<Value>,
}

/// What one upstream event carried.
enum Event {
    Chunk(Value),
    Done,
}

/// The client went away: stop everything.
struct Gone;

impl Relay {
    async fn run(mut self, mut upstream: hyper::body::Incoming) {
        let (inputs, engine_inputs) = mpsc::channel::<Result<StreamInput, ClientStreamError>>(16);
        let outputs = self
            .hooks
            .stream(tokio_stream::wrappers::ReceiverStream::new(engine_inputs));
        let mut outputs = std::pin::pin!(outputs);
        let mut inputs = Some(inputs);
        // No chain serves `output`: content goes to the client as it comes.
        let mut passthrough = false;
        let mut upstream_done = false;
        // Why the upstream's reply broke off, if it did.
        let mut broken: Option<ApiError> = None;
        let mut buffer = BytesMut::new();
        let tx = self.tx.clone();
        loop {
            let (reading, relaying, timeout) = (!upstream_done, !passthrough, self.timeout);
            let body = &mut upstream;
            let frame = async move {
                if !reading {
                    std::future::pending::<()>().await;
                }
                tokio::time::timeout(timeout, body.frame()).await
            };
            let mut chain = outputs.as_mut();
            let output = async move {
                if !relaying {
                    std::future::pending::<()>().await;
                }
                chain.next().await
            };
            tokio::select! {
                _ = tx.closed() => return,
                frame = frame => {
                    let events = match frame {
                        Ok(Some(Ok(f))) => {
                            if let Ok(data) = f.into_data() {
                                buffer.extend_from_slice(&data);
                            }
                            drain_events(&mut buffer)
                        }
                        Ok(None) => vec![Event::Done],
                        Ok(Some(Err(e))) => {
                            broken = Some(ApiError::upstream(hyper::StatusCode::BAD_GATEWAY, format!("the upstream's stream broke off: {e}")));
                            vec![Event::Done]
                        }
                        Err(_) => {
                            broken = Some(ApiError::upstream(hyper::StatusCode::GATEWAY_TIMEOUT, format!("the upstream sent nothing for {} s", self.timeout.as_secs())));
                            vec![Event::Done]
                        }
                    };
                    for event in events {
                        match event {
                            Event::Chunk(chunk) => {
                                let text = match self.take(chunk) {
                                    Ok(text) => text,
                                    Err(e) => {
                                        // Nothing more is read; the engine's stream ends unfinished.
                                        drop(inputs.take());
                                        let _ = self.send(&e.body()).await;
                                        let _ = self.done().await;
                                        return;
                                    }
                                };
                                if text.is_empty() {
                                    continue;
                                }
                                if passthrough {
                                    if self.commit(&text).await.is_err() {
                                        return;
                                    }
                                } else if let Some(i) = &inputs {
                                    if let Some(fed) = &mut self.fed {
                                        fed.push_str(&text);
                                    }
                                    if i.send(Ok(StreamInput::Chunk(text))).await.is_err() {
                                        // The engine's stream ended (its error comes as an output).
                                        inputs = None;
                                    }
                                }
                            }
                            Event::Done if !upstream_done => {
                                upstream_done = true;
                                if self.finish.is_none() && broken.is_none() {
                                    broken = Some(ApiError::upstream(hyper::StatusCode::BAD_GATEWAY, "the upstream's stream ended before its reply did"));
                                }
                                if passthrough {
                                    let _ = self.end(broken.take()).await;
                                    return;
                                }
                                // A reply that broke off follows the output chain's failure policy:
                                // Closed ends it here (the text the window holds back is never
                                // shown; the engine's stream is audited as unfinished), Open lets
                                // what came through the chain as a finished reply.
                                if let Some(e) = broken.take() {
                                    if !self.hooks.output_fails_open() {
                                        drop(inputs.take());
                                        let _ = self.send(&e.body()).await;
                                        let _ = self.done().await;
                                        return;
                                    }
                                    tracing::warn!(error = %e.message(), "the upstream's reply broke off; the output chain fails open, so it is finished as it is");
                                }
                                if let Some(i) = inputs.take() {
                                    let _ = i.send(Ok(StreamInput::Finish)).await;
                                }
                            }
                            Event::Done => {}
                        }
                    }
                }
                output = output => match output {
                    Some(Ok(StreamOutput::Commit(text))) => {
                        // A chain serves the reply: what was fed is never needed again.
                        self.fed = None;
                        if self.commit(&text).await.is_err() {
                            return;
                        }
                    }
                    Some(Ok(StreamOutput::Blocked { message, .. })) => {
                        // Nothing more is read from the upstream: dropping it ends the call.
                        let _ = self.refuse(&message).await;
                        return;
                    }
                    Some(Ok(StreamOutput::Final(_))) | None => {
                        let _ = self.end(broken.take()).await;
                        return;
                    }
                    Some(Err(StreamError::Refused(EngineError::NotFound(_)))) => {
                        passthrough = true;
                        inputs = None;
                        let fed = self.fed.take().unwrap_or_default();
                        if !fed.is_empty() && self.commit(&fed).await.is_err() {
                            return;
                        }
                        if upstream_done {
                            let _ = self.end(broken.take()).await;
                            return;
                        }
                    }
                    Some(Err(e)) => {
                        let e = match e {
                            StreamError::Refused(e) => ApiError::engine(e),
                            other => ApiError::upstream(hyper::StatusCode::SERVICE_UNAVAILABLE, format!("the reply's output chain ended: {other}")),
                        };
                        let _ = self.send(&e.body()).await;
                        let _ = self.done().await;
                        return;
                    }
                }
            }
        }
    }

    /// Takes what an upstream chunk carries (template, tool-call deltas, refusal, finish, usage)
    /// and returns its content delta; a chunk in a form no chain reads is an error.
    fn take(&mut self, chunk: Value) -> Result<String, ApiError> {
        if self.template.is_none() {
            self.template = Some(Value::Object(allow::head(&chunk, "chat.completion.chunk")));
        }
        if let Some(u) = allow::usage(chunk.get("usage")) {
            self.usage = Some(u);
        }
        let choices = chunk
            .get("choices")
            .and_then(Value::as_array)
            .map_or(&[][..], Vec::as_slice);
        let choice = match choices {
            [] => return Ok(String::new()),
            [one] if allow::choice_index_is_zero(one) => one,
            _ => {
                return Err(allow::unguarded(
                    "a chunk of another choice, more choices than the one asked for",
                ));
            }
        };
        if let Some(f) = allow::finish_reason(choice.get("finish_reason")) {
            self.finish = Some(f.to_string());
        }
        let delta = choice.get("delta").cloned().unwrap_or(Value::Null);
        if delta.get("function_call").is_some_and(|f| !f.is_null()) {
            return Err(allow::unguarded("a legacy function_call"));
        }
        if let Some(r) = delta.get("refusal").and_then(Value::as_str) {
            self.refusal.push_str(r);
        }
        for d in delta
            .get("tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let kind = d.get("type").and_then(Value::as_str).unwrap_or("function");
            if kind != "function" || d.get("custom").is_some() {
                return Err(allow::unguarded(format!("a tool call of type {kind:?}")));
            }
            let index = d.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
            // At most 128 calls in one reply; a larger index is the upstream's mistake.
            if index >= 128 {
                continue;
            }
            while self.calls.len() <= index {
                self.calls.push(json!({"id": "", "type": "function", "function": {"name": "", "arguments": ""}}));
            }
            let call = &mut self.calls[index];
            if let Some(v) = d.get("id").and_then(Value::as_str) {
                call["id"] = json!(v);
            }
            if let Some(n) = d.pointer("/function/name").and_then(Value::as_str) {
                let name = format!(
                    "{}{n}",
                    call["function"]["name"].as_str().unwrap_or_default()
                );
                call["function"]["name"] = json!(name);
            }
            if let Some(a) = d.pointer("/function/arguments").and_then(Value::as_str) {
                let args = format!(
                    "{}{a}",
                    call["function"]["arguments"].as_str().unwrap_or_default()
                );
                call["function"]["arguments"] = json!(args);
            }
        }
        Ok(delta
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string())
    }

    /// A chunk of this completion with `delta` and `finish_reason`.
    fn chunk(&self, delta: Value, finish: Value) -> Value {
        let t = self.template.as_ref();
        let field = |k: &str| t.and_then(|t| t.get(k)).cloned().unwrap_or(Value::Null);
        json!({
            "id": field("id"), "object": "chat.completion.chunk", "created": field("created"),
            "model": field("model"),
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null}],
        })
    }

    async fn send(&self, event: &Value) -> Result<(), Gone> {
        self.tx
            .send(Ok(Frame::data(Bytes::from(format!("data: {event}\n\n")))))
            .await
            .map_err(|_| Gone)
    }

    async fn done(&self) -> Result<(), Gone> {
        self.tx
            .send(Ok(Frame::data(Bytes::from_static(b"data: [DONE]\n\n"))))
            .await
            .map_err(|_| Gone)
    }

    /// Sends text the chain let through.
    async fn commit(&mut self, text: &str) -> Result<(), Gone> {
        let mut delta = json!({"content": text});
        if !self.role_sent {
            delta["role"] = json!("assistant");
            self.role_sent = true;
        }
        self.committed.push_str(text);
        self.send(&self.chunk(delta, Value::Null)).await
    }

    /// Ends the reply with a refusal: `message` as content and `refusal`, `content_filter`.
    async fn refuse(&mut self, message: &str) -> Result<(), Gone> {
        let mut delta = json!({"content": message, "refusal": message});
        if !self.role_sent {
            delta["role"] = json!("assistant");
            self.role_sent = true;
        }
        self.send(&self.chunk(delta, Value::Null)).await?;
        self.send(&self.chunk(json!({}), json!(BLOCKED_FINISH_REASON)))
            .await?;
        self.usage().await?;
        self.done().await
    }

    async fn usage(&self) -> Result<(), Gone> {
        // `take` kept only the token counts.
        if let Some(u) = &self.usage {
            let mut last = self.chunk(json!({}), Value::Null);
            last["choices"] = json!([]);
            last["usage"] = u.clone();
            self.send(&last).await?;
        }
        Ok(())
    }

    /// The reply's text is over: `after_model` on the whole message, `before_tool` on its calls,
    /// then the calls that may run, the finish and the usage. `broken`: the upstream's stream broke
    /// off, which the client hears as an error event instead of a finish.
    async fn end(&mut self, broken: Option<ApiError>) -> Result<(), Gone> {
        if let Some(e) = broken {
            self.send(&e.body()).await?;
            return self.done().await;
        }
        let mut message = json!({"role": "assistant", "content": self.committed});
        if !self.refusal.is_empty() {
            message["refusal"] = json!(self.refusal);
        }
        if !self.calls.is_empty() {
            message["tool_calls"] = Value::Array(self.calls.clone());
        }
        let usage = self.usage.clone().unwrap_or(Value::Null);
        let after = self
            .hooks
            .run(
                TriggerPoint::AfterModel,
                json!({"message": message, "usage": usage}),
            )
            .await;
        match after {
            Err(e) => {
                self.send(&e.body()).await?;
                return self.done().await;
            }
            Ok(Verdict::Block { message }) => return self.refuse(&message).await,
            Ok(Verdict::Skip(_)) => {}
            // Text already sent cannot be taken back: a rewrite counts for the tool calls.
            Ok(Verdict::Go(p)) => {
                if let Some(calls) = p.pointer("/message/tool_calls") {
                    // A hook's rewrite is held to the same list.
                    let calls: Result<Vec<Value>, ApiError> = calls
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(allow::tool_call)
                        .collect();
                    match calls {
                        Ok(calls) => message["tool_calls"] = Value::Array(calls),
                        Err(e) => {
                            self.send(&e.body()).await?;
                            return self.done().await;
                        }
                    }
                }
                if let Some(r) = p.pointer("/message/refusal") {
                    message["refusal"] = r.clone();
                }
            }
        }
        // The model's refusal goes through `output` whole, as a reply that was not streamed.
        if let Some(text) = message
            .get("refusal")
            .and_then(Value::as_str)
            .filter(|r| !r.is_empty())
            .map(str::to_string)
        {
            match self
                .hooks
                .run(TriggerPoint::Output, Value::String(text))
                .await
            {
                Err(e) => {
                    self.send(&e.body()).await?;
                    return self.done().await;
                }
                Ok(Verdict::Block { message }) => return self.refuse(&message).await,
                Ok(Verdict::Go(Value::String(out)) | Verdict::Skip(out)) => {
                    let mut delta = json!({"refusal": out});
                    if !self.role_sent {
                        delta["role"] = json!("assistant");
                        self.role_sent = true;
                    }
                    self.send(&self.chunk(delta, Value::Null)).await?;
                }
                Ok(Verdict::Go(_)) => {}
            }
            // Sent (or not); what follows reads only the notes of blocked calls from it.
            if let Some(m) = message.as_object_mut() {
                m.remove("refusal");
            }
        }
        let before = message["content"].clone();
        let finish = match tool_calls(&self.hooks, &mut message).await {
            Ok(f) => f,
            Err(e) => {
                self.send(&e.body()).await?;
                return self.done().await;
            }
        };
        if message["content"] != before {
            // Blocked calls: their messages follow the text sent.
            let note = message
                .get("refusal")
                .and_then(Value::as_str)
                .map(str::to_string)
                .unwrap_or_else(|| {
                    let all = message["content"].as_str().unwrap_or_default();
                    all.strip_prefix(self.committed.as_str())
                        .unwrap_or(all)
                        .trim_start()
                        .to_string()
                });
            let mut delta = json!({"content": note, "refusal": note});
            if !self.role_sent {
                delta["role"] = json!("assistant");
                self.role_sent = true;
            }
            self.send(&self.chunk(delta, Value::Null)).await?;
        }
        if let Some(Value::Array(calls)) = message.get("tool_calls") {
            let indexed: Vec<Value> = calls
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    let mut c = c.clone();
                    c["index"] = json!(i);
                    c
                })
                .collect();
            let mut delta = json!({"tool_calls": indexed});
            if !self.role_sent {
                delta["role"] = json!("assistant");
                self.role_sent = true;
            }
            self.send(&self.chunk(delta, Value::Null)).await?;
        }
        let finish = finish
            .map(str::to_string)
            .or_else(|| self.finish.clone())
            .unwrap_or_else(|| "stop".into());
        self.send(&self.chunk(json!({}), json!(finish))).await?;
        self.usage().await?;
        self.done().await
    }
}

/// The complete events in `buffer` (taken out of it); a partial event stays for the next frame.
fn drain_events(buffer: &mut BytesMut) -> Vec<Event> {
    let mut events = Vec::new();
    loop {
        let Some(end) = find_event_end(buffer) else {
            return events;
        };
        let raw = buffer.split_to(end.0);
        let _ = buffer.split_to(end.1);
        let text = String::from_utf8_lossy(&raw);
        let data: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(str::trim_start)
            .collect();
        if data.is_empty() {
            continue;
        }
        let data = data.join("\n");
        if data.trim() == "[DONE]" {
            events.push(Event::Done);
        } else if let Ok(v) = serde_json::from_str::<Value>(&data) {
            events.push(Event::Chunk(v));
        }
    }
}

/// Where the first event in `buffer` ends: (its length, the separator's length).
pub(crate) fn find_event_end(buffer: &[u8]) -> Option<(usize, usize)> {
    let lf = buffer.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2));
    let crlf = buffer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_across_frames_are_put_back_together() {
        let mut b = BytesMut::from(&b"data: {\"a\":1}\n\ndata: {\"a\""[..]);
        let first = drain_events(&mut b);
        assert!(matches!(&first[..], [Event::Chunk(v)] if v["a"] == 1));
        b.extend_from_slice(b":2}\r\n\r\ndata: [DONE]\n\n");
        let rest = drain_events(&mut b);
        assert!(matches!(&rest[..], [Event::Chunk(v), Event::Done] if v["a"] == 2));
        assert!(b.is_empty());
    }
}
