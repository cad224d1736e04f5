//! What of the upstream's answer may reach the client: an allow-list. A field is passed on only if
//! it went through a chain (the message's `content` and `refusal` through `after_model` and
//! `output`, each tool call through `before_tool`) or carries no model text (ids, the model's name,
//! timestamps, finish reasons, token counts); every other field, known or not, is dropped. Fields the
//! chains cannot read (`logprobs`, `audio`, `annotations`) pass only where no chain sees the reply
//! (no `after_model` and no `output` chain), since there the client gets the model's text as it
//! came anyway; where one does, a request asking for `logprobs` or audio is refused before it goes
//! upstream (`chat`). An answer in a form no chain can guard (more than one choice, a legacy
//! `function_call`, a custom tool call) is an upstream error, never passed on.
//!
//! The table of fields is in `docs/openai-proxy.md` ("What of the reply reaches the client"); this
//! file is the one place the rule is applied, for whole completions and for streamed chunks.

use super::error::ApiError;
use hyper::StatusCode;
use serde_json::{Map, Value, json};

/// Top-level fields of a completion or chunk that carry no model text, copied when they are a
/// string or a number.
const HEAD_FIELDS: [&str; 5] = [
    "id",
    "created",
    "model",
    "system_fingerprint",
    "service_tier",
];

/// The finish reasons passed on; any other becomes `stop`.
const FINISH_REASONS: [&str; 4] = ["stop", "length", "tool_calls", "content_filter"];

/// The head of a completion (`object` given) from the upstream's answer or first chunk.
pub(crate) fn head(upstream: &Value, object: &str) -> Map<String, Value> {
    let mut head = Map::new();
    for k in HEAD_FIELDS {
        if let Some(v) = upstream.get(k).filter(|v| v.is_string() || v.is_number()) {
            head.insert(k.to_string(), v.clone());
        }
    }
    head.insert("object".into(), json!(object));
    head
}

/// The token counts of `usage`: numbers, and objects of numbers (`prompt_tokens_details`), nothing
/// else.
pub(crate) fn usage(upstream: Option<&Value>) -> Option<Value> {
    fn numbers(v: &Value, depth: usize) -> Option<Value> {
        match v {
            Value::Number(_) => Some(v.clone()),
            Value::Object(m) if depth < 3 => Some(Value::Object(
                m.iter()
                    .filter_map(|(k, v)| Some((k.clone(), numbers(v, depth + 1)?)))
                    .collect(),
            )),
            _ => None,
        }
    }
    upstream
        .filter(|u| u.is_object())
        .and_then(|u| numbers(u, 0))
}

/// A finish reason the API has, as `&'static str`.
pub(crate) fn finish_reason(upstream: Option<&Value>) -> Option<&'static str> {
    let f = upstream?.as_str()?;
    Some(
        FINISH_REASONS
            .into_iter()
            .find(|known| *known == f)
            .unwrap_or("stop"),
    )
}

/// The upstream answered in a form the chains cannot guard.
pub(crate) fn unguarded(what: impl std::fmt::Display) -> ApiError {
    ApiError::upstream(
        StatusCode::BAD_GATEWAY,
        format!(
            "the upstream answered {what}, which the Sluice proxy's chains cannot guard; nothing of the reply is passed on"
        ),
    )
}

/// The one choice of a whole completion: exactly one was asked for (`n` is refused otherwise).
pub(crate) fn only_choice(completion: &Value) -> Result<&Value, ApiError> {
    let choices = completion
        .get("choices")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    match choices {
        [] => Err(ApiError::upstream(
            StatusCode::BAD_GATEWAY,
            "the upstream's answer has no choices",
        )),
        [one] if choice_index_is_zero(one) => Ok(one),
        _ => Err(unguarded(format!(
            "{} choices, more choices than the one asked for",
            choices.len()
        ))),
    }
}

/// Whether a choice (or a chunk's choice) is the first, the only one asked for.
pub(crate) fn choice_index_is_zero(choice: &Value) -> bool {
    match choice.get("index") {
        None | Some(Value::Null) => true,
        Some(i) => i.as_f64() == Some(0.0),
    }
}

/// A tool call as the chains see it: `{id, type: "function", function: {name, arguments}}`.
pub(crate) fn tool_call(call: &Value) -> Result<Value, ApiError> {
    let kind = call
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("function");
    if kind != "function" || call.get("custom").is_some() {
        return Err(unguarded(format!("a tool call of type {kind:?}")));
    }
    let text = |pointer: &str| {
        call.pointer(pointer)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    Ok(json!({
        "id": text("/id"),
        "type": "function",
        "function": {"name": text("/function/name"), "arguments": text("/function/arguments")},
    }))
}

/// A reply message as the chains see it: `role`, `content` and `refusal` (text or null) and the
/// tool calls. Refused: a legacy `function_call`, a tool call of another type, content that is not
/// text.
pub(crate) fn message(upstream: Option<&Value>) -> Result<Value, ApiError> {
    let empty = json!({});
    let m = upstream.unwrap_or(&empty);
    if m.get("function_call").is_some_and(|f| !f.is_null()) {
        return Err(unguarded("a legacy function_call"));
    }
    let text = |k: &str| -> Result<Value, ApiError> {
        match m.get(k) {
            None | Some(Value::Null) => Ok(Value::Null),
            Some(s @ Value::String(_)) => Ok(s.clone()),
            Some(_) => Err(unguarded(format!("a message {k} that is not text"))),
        }
    };
    let mut out = json!({"role": "assistant", "content": text("content")?});
    let refusal = text("refusal")?;
    if !refusal.is_null() {
        out["refusal"] = refusal;
    }
    if let Some(calls) = m.get("tool_calls").filter(|c| !c.is_null()) {
        let calls = calls
            .as_array()
            .ok_or_else(|| unguarded("tool_calls that are not a list"))?;
        if !calls.is_empty() {
            out["tool_calls"] =
                Value::Array(calls.iter().map(tool_call).collect::<Result<Vec<_>, _>>()?);
        }
    }
    Ok(out)
}

/// The fields of a reply message no chain reads (`audio`, `annotations`), passed on only where no
/// chain sees the reply.
pub(crate) fn unread_message_fields(upstream: Option<&Value>) -> Map<String, Value> {
    let mut out = Map::new();
    for k in ["audio", "annotations"] {
        if let Some(v) = upstream.and_then(|m| m.get(k)).filter(|v| !v.is_null()) {
            out.insert(k.to_string(), v.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_keeps_only_what_the_chains_read() {
        let m = json!({"role": "assistant", "content": "hi", "refusal": "no", "reasoning_content": "raw",
                       "extra_text": "raw", "audio": {"transcript": "raw"},
                       "tool_calls": [{"id": "c1", "type": "function", "extra": "raw",
                                       "function": {"name": "f", "arguments": "{}", "extra": "raw"}}]});
        let clean = message(Some(&m)).unwrap();
        assert!(!clean.to_string().contains("raw"), "{clean}");
        assert_eq!(clean["refusal"], "no");
        assert_eq!(clean["tool_calls"][0]["function"]["name"], "f");
    }

    #[test]
    fn forms_no_chain_reads_are_refused() {
        for m in [
            json!({"function_call": {"name": "f", "arguments": "{}"}}),
            json!({"tool_calls": [{"id": "c", "type": "custom", "custom": {"name": "f", "input": "x"}}]}),
            json!({"content": [{"type": "text", "text": "x"}]}),
        ] {
            assert!(message(Some(&m)).is_err(), "{m}");
        }
        let two = json!({"choices": [{"index": 0}, {"index": 1}]});
        assert!(only_choice(&two).is_err());
        assert!(only_choice(&json!({"choices": [{"index": 1}]})).is_err());
    }

    #[test]
    fn usage_keeps_numbers_only() {
        let u = json!({"total_tokens": 3, "note": "raw", "details": {"cached_tokens": 1, "x": "raw"}, "list": ["raw"]});
        assert_eq!(
            usage(Some(&u)),
            Some(json!({"total_tokens": 3, "details": {"cached_tokens": 1}}))
        );
    }
}
