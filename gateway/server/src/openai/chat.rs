//! One chat completion through the trigger points, in the order of the agent-loop design:
//!
//! 1. `after_tool` on every tool result (`role: tool`) of the request;
//! 2. `input` on every user message (its text): the newest decides the request, earlier ones (the
//!    history an application resends) are rewritten or withheld. A payload whose verdict under the
//!    same chain revision is remembered (`passed`) is not walked again;
//! 3. `before_model` on `{model, messages, tools, max_tokens, usage_so_far, turn}`;
//! 4. the upstream call;
//! 5. `after_model` on `{message, usage}`, then `output` on the reply's text (streamed replies:
//!    the engine's two-path stream, `sse`), then `before_tool` on each tool call of the reply.
//!
//! Before any of it, the request is refused if it asks for what no chain can see (`logprobs`, audio
//! where a chain sees the reply; legacy functions and custom tools; `n` other than 1). The reply is
//! built anew from what `allow` lets through.
//!
//! A `block` anywhere answers as the API answers a refusal: a normal completion whose message is
//! the block message (also in `refusal`), with `finish_reason: "content_filter"` (`blocked`).

use super::allow;
use super::error::ApiError;
use super::hooks::{Hooks, Verdict};
use super::passed::Decided;
use super::upstream::Upstream;
use super::{Body, json_response};
use hyper::{Response, StatusCode};
use serde_json::{Map, Value, json};
use sluice_crds::TriggerPoint;

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
        // One choice: every other spelling of `n` (2, 2.0, "2", "1", true...) is refused, since an
        // upstream reading it leniently would answer choices the chains never see.
        match body.get("n") {
            None | Some(Value::Null) => {}
            Some(Value::Number(n)) if n.as_f64() == Some(1.0) => {}
            Some(_) => {
                return Err(ApiError::invalid_param(
                    "n",
                    "the Sluice proxy serves one choice per request: n must be 1",
                ));
            }
        }
        refuse_unguarded_tool_forms(&body, messages)?;
        Ok(Self {
            model,
            stream,
            body,
        })
    }

    /// Whether the request asks for something of the reply that no chain can see: `logprobs`
    /// (every token of the text before the output chain), or audio (the reply spoken). The request
    /// field that asks, if any.
    pub(crate) fn asks_for_unseen_reply_parts(&self) -> Option<&'static str> {
        let set = |k: &str| {
            self.body
                .get(k)
                .is_some_and(|v| !v.is_null() && *v != json!(false))
        };
        if set("logprobs") || set("top_logprobs") {
            return Some("logprobs");
        }
        let audio_modality = self
            .body
            .get("modalities")
            .and_then(Value::as_array)
            .is_some_and(|m| m.iter().any(|m| m != "text"));
        if set("audio") || audio_modality {
            return Some("audio");
        }
        None
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

/// Tool calls reach the application in one form, `tool_calls` of type `function`, which
/// `before_tool` sees (and tool results in one, `role: tool`, which `after_tool` sees). The legacy
/// `functions`/`function_call` and custom tools are refused, so that no call goes past the chains in
/// a form they do not read.
fn refuse_unguarded_tool_forms(
    body: &Map<String, Value>,
    messages: &[Value],
) -> Result<(), ApiError> {
    for legacy in ["functions", "function_call"] {
        if body.get(legacy).is_some_and(|v| !v.is_null()) {
            return Err(ApiError::invalid_param(
                legacy,
                format!(
                    "{legacy} (the legacy function calling) is not served by the Sluice proxy: use tools, whose calls go through before_tool"
                ),
            ));
        }
    }
    if let Some(tools) = body.get("tools").filter(|t| !t.is_null()) {
        let Some(tools) = tools.as_array() else {
            return Err(ApiError::invalid_param("tools", "tools must be an array"));
        };
        for (i, t) in tools.iter().enumerate() {
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(ApiError::invalid_param(
                    &format!("tools[{i}].type"),
                    "the Sluice proxy serves tools of type function only (their calls go through before_tool)",
                ));
            }
        }
    }
    for (i, m) in messages.iter().enumerate() {
        if m.get("role").and_then(Value::as_str) == Some("function") {
            return Err(ApiError::invalid_param(
                &format!("messages[{i}].role"),
                "role function (a legacy function result) is not served by the Sluice proxy: send tool results as role tool, which go through after_tool",
            ));
        }
        if m.get("function_call").is_some_and(|v| !v.is_null()) {
            return Err(ApiError::invalid_param(
                &format!("messages[{i}].function_call"),
                "function_call (the legacy function calling) is not served by the Sluice proxy: use tool_calls",
            ));
        }
    }
    Ok(())
}

/// Runs one request through the chains and the upstream.
pub(crate) async fn complete(
    upstream: &Upstream,
    hooks: Hooks,
    mut request: ChatRequest,
) -> Result<Response<Body>, ApiError> {
    let model = request.model.clone();
    let stream = request.stream;
    if hooks.reply_is_guarded()
        && let Some(param) = request.asks_for_unseen_reply_parts()
    {
        return Err(ApiError::invalid_param(
            param,
            format!(
                "{param} would show the reply before its chains: target {:?} has an after_model or output chain, so the Sluice proxy does not serve {param} for it",
                hooks.target
            ),
        ));
    }
    if hooks.has_chain(TriggerPoint::Input) {
        refuse_parts_the_input_chain_cannot_read(request.messages())?;
    }
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

/// The input chain reads text: a user message's content parts other than text (images, audio,
/// files) would go upstream unread, so they are refused where an input chain serves the target.
fn refuse_parts_the_input_chain_cannot_read(messages: &[Value]) -> Result<(), ApiError> {
    for (i, m) in messages.iter().enumerate() {
        if m.get("role").and_then(Value::as_str) != Some("user") {
            continue;
        }
        let Some(Value::Array(parts)) = m.get("content") else {
            continue;
        };
        if let Some(j) = parts
            .iter()
            .position(|p| p.get("type").and_then(Value::as_str) != Some("text"))
        {
            return Err(ApiError::invalid_param(
                &format!("messages[{i}].content[{j}]"),
                "the target's input chain reads text: content parts other than text are not served for it by the Sluice proxy",
            ));
        }
    }
    Ok(())
}

/// One payload of the request through its chain, remembered (`passed`): a payload already walked
/// under the same revision of the chains is not walked again. `newest`: the request's own message
/// (not history), which is always walked.
async fn walk_once(
    hooks: &Hooks,
    tp: TriggerPoint,
    payload: Value,
    newest: bool,
) -> Result<Decided, ApiError> {
    let revision = hooks.revision(tp);
    if !newest
        && let Some(r) = &revision
        && let Some(d) = hooks.passed.get(&hooks.scope(tp, r), &payload)
    {
        return Ok(d);
    }
    let checked = hooks.run_checked(tp, payload.clone()).await?;
    let decided = match checked.verdict {
        Verdict::Go(out) if out == payload => Decided::Same,
        Verdict::Go(out) => Decided::Rewritten(out),
        Verdict::Block { message } => Decided::Blocked(message),
        Verdict::Skip(message) => Decided::Skipped(message),
    };
    // Remembered only when every hook answered, and the chains did not change under the run.
    if checked.clean
        && let Some(r) = revision
        && hooks.revision(tp).as_deref() == Some(r.as_str())
    {
        hooks
            .passed
            .put(&hooks.scope(tp, &r), &payload, decided.clone());
    }
    Ok(decided)
}

/// `after_tool` on every tool result of the request (`role: tool`): the ones answering the last
/// assistant message, and every earlier one an application resends with the history. A blocked
/// result is replaced by a note saying it was withheld and why (the model is told, as in the agent
/// loop); a rewrite replaces the content.
async fn tool_results(hooks: &Hooks, request: &mut ChatRequest) -> Result<(), ApiError> {
    let messages = request.messages_mut();
    let last_assistant = messages
        .iter()
        .rposition(|m| m.get("role").and_then(Value::as_str) == Some("assistant"));
    // Every call of every assistant message, by id: a result's tool name.
    let names: Vec<(String, String)> = messages
        .iter()
        .filter_map(|m| m.get("tool_calls").and_then(Value::as_array))
        .flatten()
        .filter_map(|c| {
            Some((
                c.get("id")?.as_str()?.to_string(),
                c.pointer("/function/name")?.as_str()?.to_string(),
            ))
        })
        .collect();
    for (i, m) in messages.iter_mut().enumerate() {
        if m.get("role").and_then(Value::as_str) != Some("tool") {
            continue;
        }
        let id = m
            .get("tool_call_id")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let name = names
            .iter()
            .rev()
            .find(|(call, _)| call == id)
            .map(|(_, n)| n.clone())
            .unwrap_or_default();
        let result = m.get("content").cloned().unwrap_or(Value::Null);
        let payload = json!({"name": name, "result": result, "error": null});
        let newest = last_assistant.is_none_or(|a| i > a);
        let content = match walk_once(hooks, TriggerPoint::AfterTool, payload, newest).await? {
            Decided::Same => continue,
            Decided::Rewritten(p) => match p.get("result") {
                Some(Value::String(s)) => Value::String(s.clone()),
                Some(other) => Value::String(other.to_string()),
                None => result,
            },
            Decided::Blocked(message) | Decided::Skipped(message) => {
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

/// `input` on every user message: the newest decides the request (a rewrite replaces its content,
/// a block refuses the request, a skip answers it); each earlier one the application resends is
/// rewritten as its chain rewrites it, or withheld (its content replaced by a note) where its chain
/// blocks or skips it, so that nothing a chain stopped at one turn reaches the model at the next.
async fn user_input(hooks: &Hooks, request: &mut ChatRequest) -> Result<Step, ApiError> {
    let messages = request.messages_mut();
    let Some(newest) = messages
        .iter()
        .rposition(|m| m.get("role").and_then(Value::as_str) == Some("user"))
    else {
        return Ok(Step::Go);
    };
    for (i, m) in messages.iter_mut().enumerate().take(newest + 1) {
        if m.get("role").and_then(Value::as_str) != Some("user") {
            continue;
        }
        let Some(text) = m.get("content").and_then(text_of) else {
            continue;
        };
        let decided =
            walk_once(hooks, TriggerPoint::Input, Value::String(text), i == newest).await?;
        match decided {
            Decided::Same => {}
            Decided::Rewritten(Value::String(out)) => m["content"] = Value::String(out),
            // A rewrite that is not text: the text as it was is not sent either.
            Decided::Rewritten(_) if i == newest => {
                return Ok(Step::Block("the input chain's rewrite is not text".into()));
            }
            Decided::Rewritten(_) => {
                m["content"] =
                    json!("[the message was withheld: the input chain's rewrite is not text]");
            }
            Decided::Blocked(message) if i == newest => return Ok(Step::Block(message)),
            Decided::Skipped(message) if i == newest => return Ok(Step::Answer(message)),
            Decided::Blocked(message) | Decided::Skipped(message) => {
                m["content"] = json!(format!("[the message was withheld: {message}]"));
            }
        }
    }
    Ok(Step::Go)
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
    match hooks
        .run(TriggerPoint::BeforeModel, payload.clone())
        .await?
    {
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

/// A whole (non-streamed) reply through `after_model`, `output` and `before_tool`, built anew from
/// what the allow-list lets through (`allow`): nothing of the upstream's answer is passed on that a
/// chain did not see or that carries no model text.
async fn reply(hooks: &Hooks, upstream: Value) -> Result<Value, ApiError> {
    let choice = allow::only_choice(&upstream)?;
    let guarded = hooks.reply_is_guarded();
    let head = allow::head(&upstream, "chat.completion");
    let usage = allow::usage(upstream.get("usage"));
    let message = allow::message(choice.get("message"))?;
    let finish = allow::finish_reason(choice.get("finish_reason"));
    let mut message = match hooks
        .run(
            TriggerPoint::AfterModel,
            json!({"message": message, "usage": usage.clone().unwrap_or(Value::Null)}),
        )
        .await?
    {
        Verdict::Go(p) => match p.get("message") {
            // A hook's rewrite is held to the same list.
            Some(m @ Value::Object(_)) => allow::message(Some(m))?,
            _ => message,
        },
        Verdict::Block { message } => return Ok(refuse(head, usage, &message)),
        Verdict::Skip(text) => json!({"role": "assistant", "content": text}),
    };
    // The reply's text and its refusal (the model's own words too) each go through `output`.
    for field in ["content", "refusal"] {
        let Some(text) = message
            .get(field)
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty())
        else {
            continue;
        };
        match hooks
            .run(TriggerPoint::Output, Value::String(text.to_string()))
            .await?
        {
            Verdict::Go(Value::String(out)) => message[field] = Value::String(out),
            Verdict::Go(_) => {}
            Verdict::Block { message } => return Ok(refuse(head, usage, &message)),
            Verdict::Skip(text) => message[field] = Value::String(text),
        }
    }
    let blocked = tool_calls(hooks, &mut message).await?;
    let mut logprobs = Value::Null;
    if !guarded {
        // No chain sees the reply: what no chain reads shows nothing the client does not get.
        if let Some(m) = message.as_object_mut() {
            m.extend(allow::unread_message_fields(choice.get("message")));
        }
        logprobs = choice.get("logprobs").cloned().unwrap_or(Value::Null);
    }
    let mut completion = head;
    completion.insert(
        "choices".into(),
        json!([{"index": 0, "message": message, "finish_reason": blocked.or(finish).unwrap_or("stop"), "logprobs": logprobs}]),
    );
    if let Some(u) = usage {
        completion.insert("usage".into(), u);
    }
    Ok(Value::Object(completion))
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
            .run(
                TriggerPoint::BeforeTool,
                json!({"name": name, "arguments": arguments}),
            )
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
fn refuse(mut head: Map<String, Value>, usage: Option<Value>, message: &str) -> Value {
    head.insert(
        "choices".into(),
        json!([{
            "index": 0,
            "message": {"role": "assistant", "content": message, "refusal": message},
            "finish_reason": BLOCKED_FINISH_REASON,
            "logprobs": null,
        }]),
    );
    if let Some(u) = usage {
        head.insert("usage".into(), u);
    }
    Value::Object(head)
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
