//! Each MCP message through its trigger point, and the allow-list of what passes (docs/mcp.md):
//!
//! | message | trigger point | what leaves |
//! |---|---|---|
//! | `initialize` | none | `protocolVersion`, `capabilities` `tools`/`resources`/`prompts` (`listChanged` only), `serverInfo` `name`/`version`/`title` (the server's `instructions`, text no chain reads, are dropped) |
//! | `tools/list` | `before_model` on `{model: "mcp:SERVER", messages: [], tools, ...}` | the tools the chain kept (`name`, `title`, `description`, `inputSchema`, `outputSchema`, `annotations`); the others cannot be called in the session |
//! | `tools/call` | `before_tool` on `{name, arguments}`, then `after_tool` on `{name, result, error}` for each text of the result | the rewritten call; the result's texts as the chain left them, non-text content dropped unless the server is `--mcp-pass-non-text` |
//! | `resources/read`, `prompts/get` | `output` on each text | the contents (`uri`, `mimeType`, `text`) and messages (`role`, text content) as the chain left them; binary and other content as for tool results; a prompt's description is dropped |
//! | `resources/list`, `resources/templates/list`, `prompts/list` | none | names and addresses (`name`, `uri`, `uriTemplate`, `mimeType`, `size`, arguments' `name` and `required`): descriptions and titles are dropped |
//! | `sampling/createMessage` (server → client) | `input` on each text | the request with its texts as the chain left them; a block is the server's error answer |
//! | `ping`, `notifications/initialized`, `notifications/cancelled`, `notifications/progress` (without its message), `notifications/*/list_changed` | none | as they are |
//!
//! Anything else is refused: a client's request with "method not found", a server's request with
//! an error answered to the server, a server's notification dropped.

use super::Call;
use super::rpc::{self, Message};
use super::upstream::{Answer, Events};
use crate::http_port::Body;
use bytes::Bytes;
use futures::future::join_all;
use http_body_util::BodyExt;
use hyper::{Response, StatusCode};
use serde_json::{Map, Value, json};
use sluice_crds::{Action, TriggerPoint};
use sluice_engine::{EngineError, Walk};

/// What a trigger point decided.
#[derive(Debug)]
pub(crate) enum Verdict {
    /// Go on with this payload (the one sent, or a hook's rewrite); also the answer when no chain
    /// serves the trigger point.
    Go(Value),
    Block(String),
    /// Do not call what comes next; the message stands in for its answer.
    Skip(String),
}

impl Verdict {
    pub(crate) fn of(walk: Walk) -> Self {
        match walk.action {
            Action::Block => Verdict::Block(walk.message),
            Action::Skip => Verdict::Skip(walk.message),
            Action::Pass | Action::Modify | Action::Detect => Verdict::Go(walk.payload),
        }
    }
}

/// Why a message cannot be answered as the server would: said to the client as a JSON-RPC error.
struct Refused {
    code: i64,
    message: String,
}

impl Refused {
    fn engine(e: EngineError) -> Self {
        Self {
            code: rpc::GUARD_FAILED,
            message: format!("the chains could not run: {e}"),
        }
    }

    fn upstream(message: String) -> Self {
        Self {
            code: rpc::UPSTREAM_FAILED,
            message,
        }
    }

    fn invalid(message: &str) -> Self {
        Self {
            code: rpc::INVALID_PARAMS,
            message: message.to_string(),
        }
    }

    fn blocked(message: String) -> Self {
        Self {
            code: rpc::BLOCKED,
            message,
        }
    }
}

/// What the client asked for, and so how the server's answer is read.
#[derive(Clone, Debug)]
enum Expect {
    Initialize,
    Ping,
    ToolsList {
        first_page: bool,
    },
    ToolsCall {
        name: String,
    },
    /// `resources/list`, `resources/templates/list`, `prompts/list`: the key of the list.
    Listing(&'static str),
    ResourcesRead,
    PromptsGet,
}

/// Client notifications passed on as they are.
const CLIENT_NOTIFICATIONS: &[&str] = &[
    "notifications/initialized",
    "notifications/cancelled",
    "notifications/roots/list_changed",
];

/// One message from the client, through its trigger points to the server and back.
pub(crate) async fn message(call: Call, message: Message) -> Response<Body> {
    match message {
        Message::Notification { method, params } => {
            if !CLIENT_NOTIFICATIONS.contains(&method.as_str()) {
                // A notification has no answer to carry an error: it is not passed on, and the
                // transport's 202 says nothing more.
                tracing::debug!(%method, "an MCP notification the proxy does not relay was dropped");
                return empty(StatusCode::ACCEPTED);
            }
            let mut m = json!({"jsonrpc": "2.0", "method": method});
            if let Some(p) = params {
                m["params"] = p;
            }
            relay_no_answer(&call, &m).await
        }
        // The client's answer to a server's request (its model's reply to a sampling request).
        Message::Response { body } => relay_no_answer(&call, &body).await,
        Message::Request { id, method, params } => {
            let (expect, params) = match method.as_str() {
                "initialize" => (Expect::Initialize, params.map(client_capabilities)),
                "ping" => (Expect::Ping, None),
                "tools/list" => {
                    let params = cursor_only(params);
                    let first_page = params.is_none();
                    (Expect::ToolsList { first_page }, params)
                }
                "resources/list" | "resources/templates/list" | "prompts/list" => {
                    let key = match method.as_str() {
                        "resources/list" => "resources",
                        "resources/templates/list" => "resourceTemplates",
                        _ => "prompts",
                    };
                    (Expect::Listing(key), cursor_only(params))
                }
                "resources/read" => match params.as_ref().and_then(|p| p.get("uri")) {
                    Some(uri @ Value::String(_)) => {
                        (Expect::ResourcesRead, Some(json!({"uri": uri})))
                    }
                    _ => {
                        return refused(
                            id,
                            Refused::invalid("resources/read needs params.uri, a string"),
                        );
                    }
                },
                "prompts/get" => {
                    let p = params.unwrap_or(Value::Null);
                    let Some(name) = p.get("name").filter(|n| n.is_string()) else {
                        return refused(
                            id,
                            Refused::invalid("prompts/get needs params.name, a string"),
                        );
                    };
                    let mut out = json!({"name": name});
                    if let Some(a) = p.get("arguments").filter(|a| a.is_object()) {
                        out["arguments"] = a.clone();
                    }
                    (Expect::PromptsGet, Some(out))
                }
                "tools/call" => match before_tool(&call, params).await {
                    Ok(Ok((name, params))) => (Expect::ToolsCall { name }, Some(params)),
                    Ok(Err(answer)) => {
                        return super::json_response(StatusCode::OK, &rpc::result(id, answer));
                    }
                    Err(r) => return refused(id, r),
                },
                _ => {
                    return rpc::error_response(
                        StatusCode::OK,
                        id,
                        rpc::METHOD_NOT_FOUND,
                        format!(
                            "the Sluice MCP proxy does not relay {method:?}: it serves initialize, ping, tools/list, tools/call, resources/list, resources/templates/list, resources/read, prompts/list and prompts/get (docs/mcp.md)"
                        ),
                    );
                }
            };
            let mut m = json!({"jsonrpc": "2.0", "id": id, "method": method});
            if let Some(p) = params {
                m["params"] = p;
            }
            request(call, id, expect, m).await
        }
    }
}

/// Passes on a message the server answers without a body (202).
async fn relay_no_answer(call: &Call, m: &Value) -> Response<Body> {
    match call.server.send(call, m).await {
        Ok(Answer::Empty { status, .. }) => empty(status),
        // A server may answer a notification with a body; it carries nothing for the client.
        Ok(_) => empty(StatusCode::ACCEPTED),
        Err(e) => rpc::http_error(StatusCode::BAD_GATEWAY, e),
    }
}

/// Sends a client's request and passes the server's answer back through the chains.
async fn request(mut call: Call, id: Value, expect: Expect, m: Value) -> Response<Body> {
    let answer = match call.server.send(&call, &m).await {
        Ok(a) => a,
        Err(e) => return refused(id, Refused::upstream(e)),
    };
    // The client gets the server's session sealed to it.
    let session = match &answer {
        Answer::Empty { session, .. }
        | Answer::Json { session, .. }
        | Answer::Stream { session, .. } => session.clone(),
    };
    let sealed = session
        .as_deref()
        .map(|s| call.sessions.seal(s, &call.owner()));
    if matches!(expect, Expect::Initialize) {
        opened(&mut call, session.as_deref());
    }
    let mut resp = match answer {
        Answer::Empty { status, .. } => empty(status),
        Answer::Json { message, .. } => {
            let out = match reply(&call, &expect, &id, message).await {
                Ok(v) => v,
                Err(r) => rpc::error(id, r.code, r.message),
            };
            super::json_response(StatusCode::OK, &out)
        }
        Answer::Stream { events, .. } => stream(call, expect, id, events),
    };
    if let Some(v) = sealed.and_then(|s| hyper::header::HeaderValue::from_str(&s).ok()) {
        resp.headers_mut().insert(super::SESSION_HEADER, v);
    }
    resp
}

/// Records the session the server opened (on `initialize`) for this caller.
fn opened(call: &mut Call, session: Option<&str>) {
    if let Some(id) = session {
        let sealed = call.sessions.seal(id, &call.owner());
        call.session = Some(call.sessions.get(&sealed));
        call.session_id = Some(id.to_string());
    }
}

/// An SSE answer: each of the server's messages through its trigger point, in order, the answer to
/// the request last. A client that goes away ends the stream, and with it the server's.
fn stream(call: Call, expect: Expect, id: Value, mut events: Events) -> Response<Body> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
    tokio::spawn(async move {
        loop {
            let out = match events.next().await {
                Ok(Some(message)) => match server_message(&call, &expect, &id, message).await {
                    Forward::Send(v, last) => Some((v, last)),
                    Forward::Drop => None,
                },
                Ok(None) => Some((
                    rpc::error(
                        id.clone(),
                        rpc::UPSTREAM_FAILED,
                        format!(
                            "the MCP server {:?} ended its stream without an answer",
                            call.server.name
                        ),
                    ),
                    true,
                )),
                Err(e) => Some((rpc::error(id.clone(), rpc::UPSTREAM_FAILED, e), true)),
            };
            let Some((v, last)) = out else { continue };
            let event = Bytes::from(format!("event: message\ndata: {v}\n\n"));
            if tx.send(event).await.is_err() || last {
                return;
            }
        }
    });
    let body = http_body_util::StreamBody::new(
        tokio_stream::wrappers::ReceiverStream::new(rx)
            .map(|b| Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(b))),
    )
    .boxed();
    let mut resp = Response::new(body);
    let headers = resp.headers_mut();
    headers.insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(
        hyper::header::CACHE_CONTROL,
        hyper::header::HeaderValue::from_static("no-cache"),
    );
    resp
}

use tokio_stream::StreamExt as _;

enum Forward {
    /// Send this to the client; `true` when it is the answer (the stream's last).
    Send(Value, bool),
    Drop,
}

/// One message of a server's SSE answer.
async fn server_message(call: &Call, expect: &Expect, id: &Value, message: Value) -> Forward {
    let method = message
        .get("method")
        .and_then(Value::as_str)
        .map(str::to_string);
    let their_id = message.get("id").cloned();
    match (method, their_id) {
        // The answer.
        (None, Some(_)) => {
            let out = match reply(call, expect, id, message).await {
                Ok(v) => v,
                Err(r) => rpc::error(id.clone(), r.code, r.message),
            };
            Forward::Send(out, true)
        }
        // A request of the server's to the client.
        (Some(method), Some(their_id)) => match server_request(call, &method, message).await {
            Ok(v) => Forward::Send(v, false),
            Err(r) => {
                // The server waits for an answer: the proxy gives it, and the client never sees
                // the request.
                let answer = rpc::error(their_id, r.code, r.message);
                if let Err(e) = call.server.send(call, &answer).await {
                    tracing::warn!(error = %e, %method, "answering a refused server request failed");
                }
                Forward::Drop
            }
        },
        (Some(method), None) => match server_notification(&method, message) {
            Some(v) => Forward::Send(v, false),
            None => Forward::Drop,
        },
        (None, None) => Forward::Drop,
    }
}

/// A server's notification: the ones that carry no text pass; progress loses its message.
fn server_notification(method: &str, mut message: Value) -> Option<Value> {
    match method {
        "notifications/progress" => {
            if let Some(p) = message.get_mut("params").and_then(Value::as_object_mut) {
                p.retain(|k, _| matches!(k.as_str(), "progressToken" | "progress" | "total"));
            }
            Some(message)
        }
        "notifications/cancelled"
        | "notifications/tools/list_changed"
        | "notifications/resources/list_changed"
        | "notifications/prompts/list_changed" => Some(message),
        _ => None,
    }
}

/// A server's request to the client: sampling passes the `input` chain, ping and roots pass, the
/// rest is refused.
async fn server_request(call: &Call, method: &str, mut message: Value) -> Result<Value, Refused> {
    match method {
        "ping" | "roots/list" => Ok(message),
        "sampling/createMessage" => {
            let params = message
                .get_mut("params")
                .and_then(Value::as_object_mut)
                .ok_or_else(|| Refused {
                    code: rpc::INVALID_PARAMS,
                    message: "sampling/createMessage without params".into(),
                })?;
            params.retain(|k, _| {
                matches!(
                    k.as_str(),
                    "messages"
                        | "systemPrompt"
                        | "modelPreferences"
                        | "includeContext"
                        | "temperature"
                        | "maxTokens"
                        | "stopSequences"
                )
            });
            // Every text the server wrote for the agent's model, each through `input`.
            let pass_non_text = call.server.pass_non_text;
            if let Some(Value::Array(messages)) = params.get_mut("messages") {
                for m in messages.iter_mut() {
                    let Some(content) = m.get_mut("content") else {
                        continue;
                    };
                    if content.is_object() {
                        *content = Value::Array(vec![content.take()]);
                    }
                    if let Value::Array(items) = content {
                        items.retain(|i| pass_non_text || is_text(i));
                    }
                }
            }
            let params = &mut message["params"];
            let mut texts: Vec<(String, Value)> = Vec::new();
            if let Some(s) = params.get("systemPrompt").filter(|s| s.is_string()) {
                texts.push(("/systemPrompt".into(), s.clone()));
            }
            for (i, m) in params["messages"]
                .as_array()
                .into_iter()
                .flatten()
                .enumerate()
            {
                for (j, item) in m["content"].as_array().into_iter().flatten().enumerate() {
                    if let Some(t) = item.get("text").filter(|t| t.is_string()) {
                        texts.push((format!("/messages/{i}/content/{j}/text"), t.clone()));
                    }
                }
            }
            let runs = texts
                .iter()
                .map(|(_, t)| call.run(TriggerPoint::Input, method, t.clone()));
            let verdicts = join_all(runs).await;
            for ((pointer, _), verdict) in texts.into_iter().zip(verdicts) {
                match verdict.map_err(Refused::engine)? {
                    Verdict::Go(Value::String(s)) => {
                        if let Some(t) = params.pointer_mut(&pointer) {
                            *t = Value::String(s);
                        }
                    }
                    Verdict::Go(_) => {}
                    Verdict::Block(m) | Verdict::Skip(m) => {
                        return Err(Refused::blocked(format!(
                            "the sampling request was blocked by the gateway's chains: {m}"
                        )));
                    }
                }
            }
            Ok(message)
        }
        _ => Err(Refused {
            code: rpc::METHOD_NOT_FOUND,
            message: format!(
                "the client is behind the Sluice MCP proxy, which does not relay {method:?} to it"
            ),
        }),
    }
}

/// The server's answer to the client's request, through the chains.
async fn reply(call: &Call, expect: &Expect, id: &Value, message: Value) -> Result<Value, Refused> {
    if message.get("id") != Some(id) {
        return Err(Refused::upstream(format!(
            "the MCP server {:?} answered another request (id {})",
            call.server.name,
            message.get("id").unwrap_or(&Value::Null)
        )));
    }
    if let Some(err) = message.get("error") {
        // The server's own error: its code, and its message only when a chain could not be
        // asked about it... which is never: the message is the server's text. It is said as
        // the code and a fixed text.
        let code = err
            .get("code")
            .and_then(Value::as_i64)
            .unwrap_or(rpc::UPSTREAM_FAILED);
        let said = err
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or_default();
        return Ok(rpc::error(id.clone(), code, server_error_text(call, said)));
    }
    let result = message.get("result").cloned().unwrap_or(Value::Null);
    let out = match expect {
        Expect::Ping => json!({}),
        Expect::Initialize => initialized(result),
        Expect::ToolsList { first_page } => tools_list(call, result, *first_page).await?,
        Expect::ToolsCall { name } => tool_result(call, name, result).await?,
        Expect::Listing(key) => listing(key, result),
        Expect::ResourcesRead => resource_contents(call, result).await?,
        Expect::PromptsGet => prompt_messages(call, result).await?,
    };
    Ok(rpc::result(id.clone(), out))
}

/// A server's error message reaches the client as JSON-RPC's standard texts only: the server's own
/// words are text no chain saw (they are in the gateway's debug log).
fn server_error_text(call: &Call, said: &str) -> String {
    tracing::debug!(server = %call.server.name, message = %said, "the MCP server answered with an error");
    format!(
        "the MCP server {:?} answered with an error",
        call.server.name
    )
}

/// The client's `initialize` params: it cannot be asked for elicitation through the proxy.
fn client_capabilities(mut params: Value) -> Value {
    if let Some(c) = params
        .pointer_mut("/capabilities")
        .and_then(Value::as_object_mut)
    {
        c.remove("elicitation");
    }
    params
}

/// A listing request's params: its cursor, if any.
fn cursor_only(params: Option<Value>) -> Option<Value> {
    params
        .as_ref()
        .and_then(|p| p.get("cursor"))
        .filter(|c| c.is_string())
        .map(|c| json!({"cursor": c}))
}

/// The fields of resources, resource templates and prompts that pass in a listing: names and
/// addresses, never descriptions or titles (text the server chose that no chain reads).
const LISTED_FIELDS: &[&str] = &[
    "name",
    "uri",
    "uriTemplate",
    "mimeType",
    "size",
    "arguments",
];

/// A `resources/list`, `resources/templates/list` or `prompts/list` page, allow-listed.
fn listing(key: &str, result: Value) -> Value {
    let items: Vec<Value> = result
        .get(key)
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_object)
        .map(|item| {
            let mut item = item.clone();
            item.retain(|k, _| LISTED_FIELDS.contains(&k.as_str()));
            // A prompt's arguments: their names and whether they are required.
            if let Some(Value::Array(args)) = item.get_mut("arguments") {
                for a in args.iter_mut() {
                    if let Some(a) = a.as_object_mut() {
                        a.retain(|k, _| k == "name" || k == "required");
                    }
                }
            }
            Value::Object(item)
        })
        .collect();
    let mut out = json!({ key: items });
    if let Some(c) = result.get("nextCursor").filter(|c| c.is_string()) {
        out["nextCursor"] = c.clone();
    }
    out
}

/// Runs each text at `pointers` of `value` through `output`, all at once, and writes back what the
/// chain left; a block (or skip) withholds the whole answer.
async fn through_output(
    call: &Call,
    method: &str,
    value: &mut Value,
    pointers: Vec<String>,
) -> Result<(), Refused> {
    let texts: Vec<Value> = pointers
        .iter()
        .filter_map(|p| value.pointer(p).cloned())
        .collect();
    let runs = texts
        .into_iter()
        .map(|t| call.run(TriggerPoint::Output, method, t));
    let verdicts = join_all(runs).await;
    for (pointer, verdict) in pointers.iter().zip(verdicts) {
        match verdict.map_err(Refused::engine)? {
            Verdict::Go(Value::String(text)) => {
                if let Some(t) = value.pointer_mut(pointer) {
                    *t = Value::String(text);
                }
            }
            Verdict::Go(_) => {}
            Verdict::Block(m) | Verdict::Skip(m) => {
                return Err(Refused::blocked(format!(
                    "the {method} answer was withheld by the gateway's chains: {m}"
                )));
            }
        }
    }
    Ok(())
}

/// A `resources/read` result: each text content through `output`; binary contents (`blob`) only
/// from a server that passes non-text content.
async fn resource_contents(call: &Call, result: Value) -> Result<Value, Refused> {
    let pass_non_text = call.server.pass_non_text;
    let contents: Vec<Value> = result
        .get("contents")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|c| {
            let mut out = json!({"uri": c.get("uri").cloned().unwrap_or(Value::Null)});
            if let Some(m) = c.get("mimeType").filter(|m| m.is_string()) {
                out["mimeType"] = m.clone();
            }
            match (c.get("text"), c.get("blob")) {
                (Some(t @ Value::String(_)), _) => out["text"] = t.clone(),
                (_, Some(b @ Value::String(_))) if pass_non_text => out["blob"] = b.clone(),
                _ => return None,
            }
            Some(out)
        })
        .collect();
    let pointers = contents
        .iter()
        .enumerate()
        .filter(|(_, c)| c.get("text").is_some())
        .map(|(i, _)| format!("/contents/{i}/text"))
        .collect();
    let mut out = json!({ "contents": contents });
    through_output(call, "resources/read", &mut out, pointers).await?;
    Ok(out)
}

/// A `prompts/get` result: each message's text through `output` (the prompt's description, text
/// no chain reads, is dropped); other content only from a server that passes non-text content.
async fn prompt_messages(call: &Call, result: Value) -> Result<Value, Refused> {
    let pass_non_text = call.server.pass_non_text;
    let messages: Vec<Value> = result
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|m| {
            let role = m.get("role").filter(|r| r.is_string())?.clone();
            let content = m.get("content")?;
            let content = match content.get("text") {
                Some(t @ Value::String(_)) if is_text(content) => {
                    json!({"type": "text", "text": t})
                }
                _ if pass_non_text => content.clone(),
                _ => return None,
            };
            Some(json!({"role": role, "content": content}))
        })
        .collect();
    let pointers = messages
        .iter()
        .enumerate()
        .filter(|(_, m)| is_text(&m["content"]))
        .map(|(i, _)| format!("/messages/{i}/content/text"))
        .collect();
    let mut out = json!({ "messages": messages });
    through_output(call, "prompts/get", &mut out, pointers).await?;
    Ok(out)
}

/// The server's `initialize` result, allow-listed: the capabilities the proxy serves.
fn initialized(result: Value) -> Value {
    let mut out = Map::new();
    if let Some(v) = result.get("protocolVersion") {
        out.insert("protocolVersion".into(), v.clone());
    }
    let mut caps = Map::new();
    for key in ["tools", "resources", "prompts"] {
        if let Some(Value::Object(c)) = result.pointer(&format!("/capabilities/{key}")) {
            // Subscriptions are not served: nothing a server sends outside an answer is relayed.
            let kept = c
                .iter()
                .filter(|(k, v)| k.as_str() == "listChanged" && v.is_boolean())
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            caps.insert(key.into(), Value::Object(kept));
        }
    }
    out.insert("capabilities".into(), Value::Object(caps));
    let info = result.get("serverInfo").and_then(Value::as_object);
    let mut server_info = Map::new();
    for k in ["name", "version", "title"] {
        if let Some(v) = info.and_then(|i| i.get(k)).filter(|v| v.is_string()) {
            server_info.insert(k.into(), v.clone());
        }
    }
    out.insert("serverInfo".into(), Value::Object(server_info));
    Value::Object(out)
}

/// The fields of a tool the proxy passes on.
const TOOL_FIELDS: &[&str] = &[
    "name",
    "title",
    "description",
    "inputSchema",
    "outputSchema",
    "annotations",
];

/// A `tools/list` page through `before_model`: the tools the chain keeps are the session's.
async fn tools_list(call: &Call, result: Value, first_page: bool) -> Result<Value, Refused> {
    let tools: Vec<Value> = result
        .get("tools")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|t| t.get("name").is_some_and(Value::is_string))
        .map(|t| {
            let mut t = t.as_object().cloned().unwrap_or_default();
            t.retain(|k, _| TOOL_FIELDS.contains(&k.as_str()));
            Value::Object(t)
        })
        .collect();
    let offered: std::collections::HashSet<String> = tools
        .iter()
        .filter_map(|t| t["name"].as_str().map(str::to_string))
        .collect();
    let kept = if call.has_chain(TriggerPoint::BeforeModel) {
        let payload = json!({
            "model": format!("mcp:{}", call.server.name),
            "messages": [],
            "tools": tools,
            "max_tokens": null,
            "usage_so_far": {},
            "turn": 0,
        });
        match call
            .run(TriggerPoint::BeforeModel, "tools/list", payload)
            .await
            .map_err(Refused::engine)?
        {
            Verdict::Go(out) => out
                .get("tools")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                // A chain hides and rewrites tools; it cannot add one the server does not have.
                .filter(|t| {
                    t.get("name")
                        .and_then(Value::as_str)
                        .is_some_and(|n| offered.contains(n))
                })
                .map(|t| {
                    let mut t = t.as_object().cloned().unwrap_or_default();
                    t.retain(|k, _| TOOL_FIELDS.contains(&k.as_str()));
                    Value::Object(t)
                })
                .collect(),
            Verdict::Block(m) | Verdict::Skip(m) => {
                return Err(Refused::blocked(format!(
                    "the tool list was blocked by the gateway's chains: {m}"
                )));
            }
        }
    } else {
        tools
    };
    if let Some(s) = &call.session {
        s.saw_tools(
            first_page,
            kept.iter()
                .filter_map(|t| t["name"].as_str().map(str::to_string)),
        );
    }
    let mut out = json!({"tools": kept});
    if let Some(c) = result.get("nextCursor").filter(|c| c.is_string()) {
        out["nextCursor"] = c.clone();
    }
    Ok(out)
}

/// A `tools/call`'s params through `before_tool`: `Ok(Ok((name, params)))` to send them on,
/// `Ok(Err(result))` to answer the client with a tool result of the proxy's instead (blocked,
/// hidden).
async fn before_tool(
    call: &Call,
    params: Option<Value>,
) -> Result<Result<(String, Value), Value>, Refused> {
    let params = params.unwrap_or(Value::Null);
    let Some(name) = params
        .get("name")
        .and_then(Value::as_str)
        .map(str::to_string)
    else {
        return Err(Refused {
            code: rpc::INVALID_PARAMS,
            message: "tools/call needs params.name, a string".into(),
        });
    };
    let arguments = match params.get("arguments") {
        None | Some(Value::Null) => json!({}),
        Some(a @ Value::Object(_)) => a.clone(),
        Some(_) => {
            return Err(Refused {
                code: rpc::INVALID_PARAMS,
                message: "tools/call params.arguments must be an object".into(),
            });
        }
    };
    if !visible(call, &name).await? {
        return Ok(Err(tool_error(format!(
            "The tool {name:?} is not available."
        ))));
    }
    let payload = json!({"name": name, "arguments": arguments});
    let (name, arguments) = match call
        .run(TriggerPoint::BeforeTool, "tools/call", payload)
        .await
        .map_err(Refused::engine)?
    {
        Verdict::Go(out) => (
            out.get("name")
                .and_then(Value::as_str)
                .map(str::to_string)
                .unwrap_or(name),
            out.get("arguments")
                .filter(|a| a.is_object())
                .cloned()
                .unwrap_or(arguments),
        ),
        Verdict::Block(m) => return Ok(Err(tool_error(m))),
        Verdict::Skip(m) => {
            return Ok(Err(
                json!({"content": [{"type": "text", "text": m}], "isError": false}),
            ));
        }
    };
    // A rewrite cannot reach a tool the session may not see either.
    if !visible(call, &name).await? {
        return Ok(Err(tool_error(format!(
            "The tool {name:?} is not available."
        ))));
    }
    let mut out = json!({"name": name, "arguments": arguments});
    if let Some(token) = params
        .pointer("/_meta/progressToken")
        .filter(|t| t.is_string() || t.is_number())
    {
        out["_meta"] = json!({"progressToken": token});
    }
    Ok(Ok((name, out)))
}

/// Whether the session may call `name`: where a `before_model` chain serves the server, only a tool
/// it let through a listing may be called (listed now when the session has not listed yet).
async fn visible(call: &Call, name: &str) -> Result<bool, Refused> {
    if !call.has_chain(TriggerPoint::BeforeModel) {
        return Ok(true);
    }
    if let Some(set) = call.session.as_ref().and_then(|s| s.visible()) {
        return Ok(set.contains(name));
    }
    let id = json!(format!("sluice-tools-{}", ulid::Ulid::new()));
    let m = json!({"jsonrpc": "2.0", "id": id, "method": "tools/list"});
    let message = match call
        .server
        .send(call, &m)
        .await
        .map_err(Refused::upstream)?
    {
        Answer::Json { message, .. } => message,
        Answer::Stream { mut events, .. } => loop {
            match events.next().await.map_err(Refused::upstream)? {
                Some(m) if m.get("id") == Some(&id) => break m,
                Some(_) => continue,
                None => {
                    return Err(Refused::upstream(
                        "the tool list ended without an answer".into(),
                    ));
                }
            }
        },
        Answer::Empty { status, .. } => {
            return Err(Refused::upstream(format!(
                "the tool list was answered HTTP {status} without a body"
            )));
        }
    };
    let result = message.get("result").cloned().unwrap_or(Value::Null);
    let listed = tools_list(call, result, true).await?;
    Ok(listed["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|t| t["name"] == name))
}

/// A tool result of the proxy's: an error the agent's model reads.
fn tool_error(message: String) -> Value {
    json!({"content": [{"type": "text", "text": message}], "isError": true})
}

/// A text of a tool result the chain sees, and where it goes back.
enum Slot {
    /// `content[i].text`
    Text(usize),
    /// `content[i].resource.text`
    Resource(usize),
    Structured,
}

/// A `tools/call` result through `after_tool`: every text of it (content texts, embedded text
/// resources, `structuredContent` as JSON text) is one run on `{name, result, error}`, all at once;
/// what no chain reads is dropped unless the server passes non-text content.
async fn tool_result(call: &Call, name: &str, result: Value) -> Result<Value, Refused> {
    let is_error = result
        .get("isError")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let pass_non_text = call.server.pass_non_text;
    let mut content: Vec<Value> = Vec::new();
    let mut slots: Vec<(Slot, String)> = Vec::new();
    for item in result
        .get("content")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let kind = item.get("type").and_then(Value::as_str).unwrap_or_default();
        match (
            kind,
            item.get("text").and_then(Value::as_str),
            item.pointer("/resource/text").and_then(Value::as_str),
        ) {
            ("text", Some(t), _) => {
                slots.push((Slot::Text(content.len()), t.to_string()));
                content.push(json!({"type": "text", "text": t}));
            }
            ("resource", _, Some(t)) => {
                let r = &item["resource"];
                let mut resource =
                    json!({"uri": r.get("uri").cloned().unwrap_or(Value::Null), "text": t});
                if let Some(m) = r.get("mimeType").filter(|m| m.is_string()) {
                    resource["mimeType"] = m.clone();
                }
                slots.push((Slot::Resource(content.len()), t.to_string()));
                content.push(json!({"type": "resource", "resource": resource}));
            }
            _ if pass_non_text => content.push(item.clone()),
            _ => {}
        }
    }
    let mut structured = result
        .get("structuredContent")
        .filter(|s| s.is_object())
        .cloned();
    if let Some(s) = &structured {
        slots.push((Slot::Structured, s.to_string()));
    }
    let runs = slots.iter().map(|(_, text)| {
        let payload = if is_error {
            json!({"name": name, "result": null, "error": text})
        } else {
            json!({"name": name, "result": text, "error": null})
        };
        call.run(TriggerPoint::AfterTool, "tools/call", payload)
    });
    let verdicts = join_all(runs).await;
    for ((slot, _), verdict) in slots.into_iter().zip(verdicts) {
        let out = match verdict.map_err(Refused::engine)? {
            Verdict::Go(out) => out,
            Verdict::Block(m) => {
                return Ok(tool_error(format!("[the tool result was withheld: {m}]")));
            }
            Verdict::Skip(m) => {
                return Ok(json!({"content": [{"type": "text", "text": m}], "isError": is_error}));
            }
        };
        let key = if is_error { "error" } else { "result" };
        let text = match out.get(key) {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Null) | None => String::new(),
            Some(other) => other.to_string(),
        };
        match slot {
            Slot::Text(i) => content[i]["text"] = Value::String(text),
            Slot::Resource(i) => content[i]["resource"]["text"] = Value::String(text),
            // What the chain left must still be an object, or none of it leaves.
            Slot::Structured => {
                structured = serde_json::from_str::<Value>(&text)
                    .ok()
                    .filter(Value::is_object);
            }
        }
    }
    let mut out = json!({"content": content, "isError": is_error});
    if let Some(s) = structured {
        out["structuredContent"] = s;
    }
    Ok(out)
}

fn is_text(item: &Value) -> bool {
    item.get("type").and_then(Value::as_str) == Some("text")
}

fn refused(id: Value, r: Refused) -> Response<Body> {
    rpc::error_response(StatusCode::OK, id, r.code, r.message)
}

fn empty(status: StatusCode) -> Response<Body> {
    let mut resp = Response::new(http_body_util::Full::new(Bytes::new()).boxed());
    *resp.status_mut() = status;
    resp
}
