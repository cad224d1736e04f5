//! JSON-RPC 2.0 as MCP uses it: one message per POST (batches were removed from the protocol in
//! 2025-06-18 and are refused), the proxy's own error answers, and the HTTP errors of the transport.

use super::json_response;
use crate::http_port::Body;
use hyper::{Response, StatusCode};
use serde_json::{Value, json};

/// JSON-RPC's codes the proxy answers with.
pub(crate) const PARSE_ERROR: i64 = -32700;
pub(crate) const INVALID_REQUEST: i64 = -32600;
pub(crate) const METHOD_NOT_FOUND: i64 = -32601;
pub(crate) const INVALID_PARAMS: i64 = -32602;
/// The chains could not run (no sandbox, the namespace refused...): the message says why.
pub(crate) const GUARD_FAILED: i64 = -32000;
/// The upstream MCP server failed or did not answer in time.
pub(crate) const UPSTREAM_FAILED: i64 = -32001;
/// A chain blocked the request (a tool call's answer carries a block as a tool error instead).
pub(crate) const BLOCKED: i64 = -32003;

/// A message from the client.
#[derive(Debug)]
pub(crate) enum Message {
    Request {
        id: Value,
        method: String,
        params: Option<Value>,
    },
    Notification {
        method: String,
        params: Option<Value>,
    },
    /// The client's answer to a request of the server's (e.g. its model's reply to a sampling
    /// request): `result` or `error`, as a whole.
    Response { body: Value },
}

/// A body that is not one JSON-RPC message, and the answer that says so.
#[derive(Debug)]
pub(crate) struct Invalid {
    id: Value,
    code: i64,
    message: String,
}

impl Invalid {
    pub(crate) fn into_response(self) -> Response<Body> {
        error_response(StatusCode::BAD_REQUEST, self.id, self.code, self.message)
    }
}

impl Message {
    /// The message of a POST's body.
    pub(crate) fn parse(body: &[u8]) -> Result<Message, Invalid> {
        let invalid = |id: Option<Value>, code, message: &str| Invalid {
            id: id.unwrap_or(Value::Null),
            code,
            message: message.to_string(),
        };
        let v: Value = serde_json::from_slice(body)
            .map_err(|e| invalid(None, PARSE_ERROR, &format!("the body is not JSON: {e}")))?;
        let Value::Object(m) = v else {
            let why = if v.is_array() {
                "a batch (a JSON array) is not served: MCP sends one message per request since 2025-06-18"
            } else {
                "a JSON-RPC message is an object"
            };
            return Err(invalid(None, INVALID_REQUEST, why));
        };
        let id = m.get("id").cloned();
        let id_ok = |id: &Value| id.is_string() || id.is_i64() || id.is_u64();
        if m.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
            return Err(invalid(
                id,
                INVALID_REQUEST,
                "the message is not JSON-RPC 2.0 (\"jsonrpc\": \"2.0\")",
            ));
        }
        match (m.get("method"), id) {
            (Some(Value::String(method)), Some(id)) if id_ok(&id) => Ok(Message::Request {
                id,
                method: method.clone(),
                params: m.get("params").cloned(),
            }),
            (Some(Value::String(method)), None) => Ok(Message::Notification {
                method: method.clone(),
                params: m.get("params").cloned(),
            }),
            (None, Some(id))
                if id_ok(&id) && (m.contains_key("result") || m.contains_key("error")) =>
            {
                Ok(Message::Response {
                    body: Value::Object(m),
                })
            }
            (_, id) => Err(invalid(
                id,
                INVALID_REQUEST,
                "the message is neither a request (method, id), a notification (method) nor a response (id, result or error)",
            )),
        }
    }
}

/// A JSON-RPC error object.
pub(crate) fn error(id: Value, code: i64, message: impl Into<String>) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message.into()}})
}

/// A JSON-RPC result.
pub(crate) fn result(id: Value, result: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "result": result})
}

/// A JSON-RPC error as the answer to a POST.
pub(crate) fn error_response(
    status: StatusCode,
    id: Value,
    code: i64,
    message: String,
) -> Response<Body> {
    json_response(status, &error(id, code, message))
}

/// An error of the transport (no server of that name, a session that is not the caller's...),
/// said as a JSON-RPC error without an id, as MCP servers do.
pub(crate) fn http_error(status: StatusCode, message: impl Into<String>) -> Response<Body> {
    error_response(status, Value::Null, INVALID_REQUEST, message.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(body: &str) -> Result<Message, StatusCode> {
        Message::parse(body.as_bytes()).map_err(|r| r.into_response().status())
    }

    #[test]
    fn each_kind_of_message_is_told_apart_and_the_rest_refused() {
        assert!(matches!(
            parsed(r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#),
            Ok(Message::Request { method, .. }) if method == "tools/list"
        ));
        assert!(matches!(
            parsed(r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#),
            Ok(Message::Notification { .. })
        ));
        assert!(matches!(
            parsed(r#"{"jsonrpc":"2.0","id":"s-1","result":{}}"#),
            Ok(Message::Response { .. })
        ));
        for bad in [
            "not json",
            r#"[{"jsonrpc":"2.0","id":1,"method":"ping"}]"#,
            r#"{"id":1,"method":"ping"}"#,
            r#"{"jsonrpc":"2.0","id":{"x":1},"method":"ping"}"#,
            r#"{"jsonrpc":"2.0","id":1}"#,
            r#""ping""#,
        ] {
            assert_eq!(parsed(bad).err(), Some(StatusCode::BAD_REQUEST), "{bad}");
        }
    }
}
