//! One chat completion through the trigger points, in the order of the agent-loop design:
//!
//! 1. `after_tool` on each tool result (`role: tool`) answering the last assistant message's calls;
//! 2. `input` on the newest user message (its text);
//! 3. `before_model` on `{model, messages, tools, max_tokens, usage_so_far, turn}`;
//! 4. the upstream call;
//! 5. `after_model` on `{message, usage}`, then `output` on the reply's text (streamed replies:
//!    the engine's two-path stream, `sse`), then `before_tool` on each tool call of the reply.
//!
//! A `block` anywhere answers as the API answers a refusal: a normal completion whose message is
//! the block message (also in `refusal`), with `finish_reason: "content_filter"` (`blocked`).

use super::error::ApiError;
use super::hooks::{Hooks, Verdict};
use super::upstream::Upstream;
use super::{Body, json_response};
use hyper::{Response, StatusCode};
use serde_json::{Map, Value, json};

/// The `finish_reason` of a reply a hook blocked.
pub(crate) const BLOCKED_FINISH_REASON: &str = "content_filter";

/// The top-level fields of a Chat Completions request the proxy knows; any other is refused, as the
/// API refuses it.
const KNOWN_FIELDS: &[&str] = &[
    "model",
    "messages",
    "stream",
    "stream_options",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "user",
    "seed",
    "response_format",
    "metadata",
    "store",
    "service_tier",
    "modalities",
    "reasoning_effort",
    "prediction",
    "audio",
    "web_search_options",
    "verbosity",
    "prompt_cache_key",
    "safety_identifier",
];

/// A checked request.
#[derive(Debug)]
pub(crate) struct ChatRequest {
    pub(crate) model: String,
    pub(crate) stream: bool,
    body: Map<String, Value>,
}

impl ChatRequest {
    pub(crate) fn parse(bytes: &[u8]) -> Result<Self, ApiError> {
        let value: Value = serde_json::from_slice(bytes)
            .map_err(|e| ApiError::invalid(format!("the request body is not valid JSON: {e}")))?;
        let Value::Object(body) = value else {
            return Err(ApiError::invalid("the request body must be a JSON object"));
        };
        if let Some(unknown) = body.keys().find(|k| !KNOWN_FIELDS.contains(&k.as_str())) {
            return Err(ApiError::invalid_param(
                unknown,
                format!("Unrecognized request argument supplied: {unknown}"),
            ));
        }
        let model = match body.get("model") {
            Some(Value::String(m)) if !m.is_empty() => m.clone(),
            _ => {
                return Err(ApiError::invalid_param(
                    "model",
                    "model must be a non-empty string",
                ));
            }
        };
        let messages = match body.get("messages") {
            Some(Value::Array(m)) if !m.is_empty() => m,
            _ => {
                return Err(ApiError::invalid_param(
                    "messages",
                    "messages must be a non-empty array",
                ));
            }
        };
        for (i, m) in messages.iter().enumerate() {
            if !m.get("role").is_some_and(Value::is_string) {
                return Err(ApiError::invalid_param(
                    &format!("messages[{i}].role"),
                    format!("messages[{i}] must be an object with a string role"),
                ));
            }
        }
        let stream = match body.get("stream") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => {
                return Err(ApiError::invalid_param(
                    "stream",
                    "stream must be a boolean",
                ));
            }
        };
        if body
            .get("n")
            .and_then(Value::as_u64)
            .is_some_and(|n| n != 1)
        {
            return Err(ApiError::invalid_param(
                "n",
                "the Sluice proxy serves one choice per request (n = 1)",
            ));
        }
        Ok(Self {
            model,
            stream,
            body,
        })
    }

    fn messages_mut(&mut self) -> &mut Vec<Value> {
        match self.body.get_mut("messages") {
            Some(Value::Array(m)) => m,
            // `parse` made sure of it.
            _ => unreachable!("a checked request has messages"),
        }
    }

    fn messages(&self) -> &[Value] {
        self.body
            .get("messages")
            .and_then(Value::as_array)
            .map_or(&[], Vec::as_slice)
    }
}

/// Runs one request through the chains and the upstream.
pub(crate) async fn complete(
    upstream: &Upstream,
    hooks: Hooks,
    mut request: ChatRequest,
) -> Result<Response<Body>, ApiError> {
    let model = request.model.clone();
    let stream = request.stream;
    let refusal = |message: String| Ok(blocked(&model, stream, &message));
    tool_results(&hooks, &mut request).await?;
    match user_input(&hooks, &mut request).await? {
        Step::Go => {}
        Step::Block(message) => return refusal(message),
        Step::Answer(text) => return Ok(answered(&model, stream, &text)),
    }
    match before_model(&hooks, &mut request).await? {
        Step::Go => {}
        Step::Block(message) => return refusal(message),
        Step::Answer(text) => return Ok(answered(&model, stream, &text)),
    }
    let body = Value::Object(request.body);
    let resp = upstream.chat(&body).await?;
    if stream {
        return Ok(super::sse::relay(upstream.timeout, hooks, resp));
    }
    let bytes = upstream.read(resp).await?;
    let completion: Value = serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::upstream(
            StatusCode::BAD_GATEWAY,
            format!("the upstream's answer is not JSON: {e}"),
        )
    })?;
    let completion = reply(&hooks, completion).await?;
    Ok(json_response(StatusCode::OK, &completion))
}

/// What a trigger point before the model lets happen.
enum Step {
    Go,
    Block(String),
    /// A hook skipped the model; its message is the answer.
    Answer(String),
}

/// `after_tool` on the tool results that answer the last assistant message. A blocked result is
/// replaced by a note saying it was withheld and why (the model is told, as in the agent loop);
/// a rewrite replaces the content.
async fn tool_results(hooks: &Hooks, request: &mut ChatRequest) -> Result<(), ApiError> {
    let messages = request.messages_mut();
    let Some(last_assistant) = messages
        .iter()
        .rposition(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))
    else {
        return Ok(());
    };
    let names: Vec<(String, String)> = messages[last_assistant]
        .get("tool_calls")
        .and_then(Value::as_array)
        .map(|calls| {
            calls
                .iter()
                .filter_map(|c| {
                    Some((
                        c.get("id")?.as_str()?.to_string(),
                        c.pointer("/function/name")?.as_str()?.to_string(),
                    ))
                })
                .collect()
        })
        .unwrap_or_default();
    for m in messages.iter_mut().skip(last_assistant + 1) {
        if m.get("role").and_then(Value::as_str) != Some("tool") {
            continue;
        }
        let id = m
            .get("tool_call_id")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let name = names
            .iter()
            .find(|(call, _)| call == id)
            .map(|(_, n)| n.clone())
            .unwrap_or_default();
        let result = m.get("content").cloned().unwrap_or(Value::Null);
        let payload = json!({"name": name, "result": result, "error": null});
        let content = match hooks.run("after_tool", payload).await? {
            Verdict::Go(p) => match p.get("result") {
                Some(Value::String(s)) => Value::String(s.clone()),
                Some(other) => Value::String(other.to_string()),
                None => result,
            },
            Verdict::Block { message } | Verdict::Skip(message) => {
                Value::String(format!("[the tool result was withheld: {message}]"))
            }
        };
        m["content"] = content;
    }
    Ok(())
}

/// The text of a message's content: a string, or the text parts of an array.
fn text_of(content: &Value) -> Option<String> {
    match content {
        Value::String(s) => Some(s.clone()),
        Value::Array(parts) => Some(
            parts
                .iter()
                .filter(|p| p.get("type").and_then(Value::as_str) == Some("text"))
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n"),
        ),
        _ => None,
    }
}

/// `input` on the newest user message; a rewrite replaces its content with the rewritten text.
async fn user_input(hooks: &Hooks, request: &mut ChatRequest) -> Result<Step, ApiError> {
    let messages = request.messages_mut();
    let Some(user) = messages
        .iter_mut()
        .rev()
        .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
    else {
        return Ok(Step::Go);
    };
    let Some(text) = user.get("content").and_then(text_of) else {
        return Ok(Step::Go);
    };
    Ok(
        match hooks.run("input", Value::String(text.clone())).await? {
            Verdict::Go(Value::String(out)) => {
                if out != text {
                    user["content"] = Value::String(out);
                }
                Step::Go
            }
            Verdict::Go(_) => Step::Go,
            Verdict::Block { message } => Step::Block(message),
            Verdict::Skip(message) => Step::Answer(message),
        },
    )
}

/// `before_model` on the whole request, as the agent-loop design shapes it. `turn` is the model
/// call this request makes (assistant messages so far + 1); `usage_so_far` is not known to a proxy
/// and is sent empty.
async fn before_model(hooks: &Hooks, request: &mut ChatRequest) -> Result<Step, ApiError> {
    let messages = request.messages().to_vec();
    let turn = messages
        .iter()
        .filter(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))
        .count()
        + 1;
    let tools = request.body.get("tools").cloned().unwrap_or(json!([]));
    let max_tokens = request
        .body
        .get("max_completion_tokens")
        .or_else(|| request.body.get("max_tokens"))
        .cloned()
        .unwrap_or(Value::Null);
    let payload = json!({
        "model": request.model,
        "messages": messages,
        "tools": tools,
        "max_tokens": max_tokens,
        "usage_so_far": {},
        "turn": turn,
    });
    match hooks.run("before_model", payload.clone()).await? {
        Verdict::Block { message } => Ok(Step::Block(message)),
        Verdict::Skip(message) => Ok(Step::Answer(message)),
        Verdict::Go(out) if out == payload => Ok(Step::Go),
        Verdict::Go(out) => {
            if let Some(Value::Array(m)) = out.get("messages") {
                request
                    .body
                    .insert("messages".into(), Value::Array(m.clone()));
            }
            match out.get("tools") {
                Some(Value::Array(t)) if t.is_empty() => {
                    request.body.remove("tools");
                    request.body.remove("tool_choice");
                }
                Some(Value::Array(t)) => {
                    request.body.insert("tools".into(), Value::Array(t.clone()));
                }
                _ => {}
            }
            if let Some(n) = out.get("max_tokens").filter(|n| n.is_u64()) {
                let key = if request.body.contains_key("max_completion_tokens") {
                    "max_completion_tokens"
                } else {
                    "max_tokens"
                };
                request.body.insert(key.into(), n.clone());
            }
            Ok(Step::Go)
        }
    }
}

/// A whole (non-streamed) reply through `after_model`, `output` and `before_tool`.
async fn reply(hooks: &Hooks, mut completion: Value) -> Result<Value, ApiError> {
    let Some(choice) = completion.pointer_mut("/choices/0") else {
        return Err(ApiError::upstream(
            StatusCode::BAD_GATEWAY,
            "the upstream's answer has no choices",
        ));
    };
    let message = choice.get("message").cloned().unwrap_or(json!({}));
    let usage = completion.get("usage").cloned().unwrap_or(Value::Null);
    let mut message = match hooks
        .run("after_model", json!({"message": message, "usage": usage}))
        .await?
    {
        Verdict::Go(p) => match p.get("message") {
            Some(m @ Value::Object(_)) => m.clone(),
            _ => message,
        },
        Verdict::Block { message } => return Ok(refuse(completion, &message)),
        Verdict::Skip(text) => json!({"role": "assistant", "content": text}),
    };
    if let Some(text) = message
        .get("content")
        .and_then(Value::as_str)
        .filter(|t| !t.is_empty())
    {
        match hooks.run("output", Value::String(text.to_string())).await? {
            Verdict::Go(Value::String(out)) => message["content"] = Value::String(out),
            Verdict::Go(_) => {}
            Verdict::Block { message } => return Ok(refuse(completion, &message)),
            Verdict::Skip(text) => message["content"] = Value::String(text),
        }
    }
    let finish = tool_calls(hooks, &mut message).await?;
    let choice = completion.pointer_mut("/choices/0").expect("checked above");
    choice["message"] = message;
    if let Some(finish) = finish {
        choice["finish_reason"] = json!(finish);
    }
    Ok(completion)
}

/// `before_tool` on each tool call of `message`: a blocked call is taken out (its message added to
/// the content), a rewrite replaces its name and arguments. When every call was blocked the reply
/// ends with `content_filter` (returned) instead of `tool_calls`.
pub(crate) async fn tool_calls(
    hooks: &Hooks,
    message: &mut Value,
) -> Result<Option<&'static str>, ApiError> {
    let Some(Value::Array(calls)) = message.get("tool_calls").cloned() else {
        return Ok(None);
    };
    if calls.is_empty() {
        return Ok(None);
    }
    let mut kept = Vec::new();
    let mut refusals = Vec::new();
    for mut call in calls {
        let name = call
            .pointer("/function/name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let raw = call
            .pointer("/function/arguments")
            .cloned()
            .unwrap_or(json!("{}"));
        // Hooks see the arguments as an object when they are JSON, as the agent loop sends them.
        let arguments = raw
            .as_str()
            .and_then(|s| serde_json::from_str::<Value>(s).ok())
            .unwrap_or(raw.clone());
        match hooks
            .run("before_tool", json!({"name": name, "arguments": arguments}))
            .await?
        {
            Verdict::Go(p) => {
                if let Some(n) = p.get("name").and_then(Value::as_str) {
                    call["function"]["name"] = json!(n);
                }
                if let Some(a) = p.get("arguments").filter(|a| **a != arguments) {
                    let a = match a {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    };
                    call["function"]["arguments"] = json!(a);
                }
                kept.push(call);
            }
            Verdict::Block { message } | Verdict::Skip(message) => refusals.push(message),
        }
    }
    if refusals.is_empty() {
        return Ok(None);
    }
    let note = refusals.join("\n");
    let content = match message
        .get("content")
        .and_then(Value::as_str)
        .filter(|c| !c.is_empty())
    {
        Some(c) => format!("{c}\n{note}"),
        None => note.clone(),
    };
    message["content"] = json!(content);
    if kept.is_empty() {
        if let Some(m) = message.as_object_mut() {
            m.remove("tool_calls");
        }
        message["refusal"] = json!(note);
        return Ok(Some(BLOCKED_FINISH_REASON));
    }
    message["tool_calls"] = Value::Array(kept);
    Ok(None)
}

/// The upstream's completion, its reply replaced by a refusal (id, model and usage kept).
fn refuse(mut completion: Value, message: &str) -> Value {
    completion["choices"] = json!([{
        "index": 0,
        "message": {"role": "assistant", "content": message, "refusal": message},
        "finish_reason": BLOCKED_FINISH_REASON,
        "logprobs": null,
    }]);
    completion
}

/// A completion the gateway made itself, never sent upstream (`x-sluice-answered-by: gateway`).
fn made_here(model: &str, stream: bool, message: Value, finish: &str) -> Response<Body> {
    let id = format!("chatcmpl-sluice-{}", ulid::Ulid::new());
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let usage = json!({"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0});
    let mut resp = if stream {
        let content = message.get("content").cloned().unwrap_or(Value::Null);
        let mut delta = json!({"role": "assistant", "content": content});
        if let Some(r) = message.get("refusal") {
            delta["refusal"] = r.clone();
        }
        let chunk = |delta: Value, finish: Value| {
            json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null}]})
        };
        super::sse::fixed(&[chunk(delta, Value::Null), chunk(json!({}), json!(finish))])
    } else {
        json_response(
            StatusCode::OK,
            &json!({"id": id, "object": "chat.completion", "created": created, "model": model,
                    "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": null}],
                    "usage": usage}),
        )
    };
    resp.headers_mut().insert(
        "x-sluice-answered-by",
        hyper::header::HeaderValue::from_static("gateway"),
    );
    resp
}

/// The answer to a request a hook blocked before the model.
fn blocked(model: &str, stream: bool, message: &str) -> Response<Body> {
    made_here(
        model,
        stream,
        json!({"role": "assistant", "content": message, "refusal": message}),
        BLOCKED_FINISH_REASON,
    )
}

/// The answer to a request a hook answered itself (`skip` before the model).
fn answered(model: &str, stream: bool, text: &str) -> Response<Body> {
    made_here(
        model,
        stream,
        json!({"role": "assistant", "content": text}),
        "stop",
    )
}
