//! What a hook returned, checked before it leaves the sandbox: plain JSON within the bounds, an
//! action the hook declared. The gateway checks all of it again; these checks make a hook's error
//! the hook's, reported with a reason an author can act on.

use serde_json::{Map, Value};

pub(crate) const ACTIONS: [&str; 5] = ["pass", "modify", "block", "skip", "detect"];
pub(crate) const TERMINAL: [&str; 2] = ["block", "skip"];
const TEXT_TRIGGER_POINTS: [&str; 2] = ["input", "output"];

/// The bounds `init` carries (`limits`), with the protocol's defaults.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub(crate) payload_bytes: usize,
    pub(crate) state_bytes: usize,
    pub(crate) findings_bytes: usize,
    pub(crate) message_chars: usize,
    pub(crate) depth: usize,
    pub(crate) host_calls: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            payload_bytes: 1 << 20,
            state_bytes: 64 << 10,
            findings_bytes: 64 << 10,
            message_chars: 4096,
            depth: 32,
            host_calls: 16,
        }
    }
}

impl Limits {
    pub(crate) fn from_init(value: &Value) -> Self {
        let mut limits = Self::default();
        let get = |key: &str| value.get(key).and_then(Value::as_u64);
        if let Some(v) = get("payload_bytes") {
            limits.payload_bytes = v as usize;
        }
        if let Some(v) = get("state_bytes") {
            limits.state_bytes = v as usize;
        }
        if let Some(v) = get("findings_bytes") {
            limits.findings_bytes = v as usize;
        }
        if let Some(v) = get("message_chars") {
            limits.message_chars = v as usize;
        }
        if let Some(v) = get("depth") {
            limits.depth = v as usize;
        }
        if let Some(v) = get("host_calls") {
            limits.host_calls = v;
        }
        limits
    }
}

impl Limits {
    /// The longest answer an instance may give for one call (the JSON of what `execute` returned):
    /// room for an `outgoing`, a `state` and `findings` at their limits written as Python writes
    /// JSON (a space after every `,` and `:`, under twice the compact size), and a `message` of
    /// escaped characters. A longer answer cannot pass the checks: it is refused unread.
    pub(crate) fn answer_bytes(&self) -> usize {
        let json = self
            .payload_bytes
            .saturating_add(self.state_bytes)
            .saturating_add(self.findings_bytes);
        json.saturating_mul(2)
            .saturating_add(self.message_chars.saturating_mul(6))
            .saturating_add(64 << 10)
    }
}

/// The longest error text relayed for one hook (its exception and traceback, a refusal of its
/// code, how its instance failed): what the runner says can be forged by the hook beside it.
pub(crate) const ERROR_BYTES: usize = 8 << 10;
/// The longest capability name a `host_call` may carry: a Capability's name is a Kubernetes
/// object's name, at most 253 characters.
pub(crate) const HOST_CALL_NAME_BYTES: usize = 253;

/// `text` as the supervisor relays it: whole when it is at most `max` bytes, else its first `max`
/// bytes (at a character boundary) and how much was cut. Every text a hook or its instance can
/// make long goes out through here, so that no answer outgrows the gateway's line limit.
pub(crate) fn relayed_text(text: String, max: usize) -> String {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!(
        "{} [{} more bytes cut: at most {max} are relayed]",
        &text[..end],
        text.len() - end
    )
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct HookError(pub(crate) String);

fn depth_of(value: &Value, limit: usize) -> usize {
    let mut stack = vec![(value, 1usize)];
    let mut deepest = 0;
    while let Some((v, d)) = stack.pop() {
        deepest = deepest.max(d);
        if deepest > limit {
            return deepest;
        }
        match v {
            Value::Object(map) => stack.extend(map.values().map(|x| (x, d + 1))),
            Value::Array(items) => stack.extend(items.iter().map(|x| (x, d + 1))),
            _ => {}
        }
    }
    deepest
}

/// `value` unchanged when it is within the bounds.
pub(crate) fn bounded_json(
    value: Value,
    what: &str,
    max_bytes: usize,
    max_depth: usize,
) -> Result<Value, HookError> {
    if depth_of(&value, max_depth) > max_depth {
        return Err(HookError(format!(
            "{what} is nested deeper than {max_depth} levels"
        )));
    }
    let size = serde_json::to_vec(&value)
        .map(|v| v.len())
        .unwrap_or(usize::MAX);
    if size > max_bytes {
        return Err(HookError(format!(
            "{what} is {size} bytes, over the limit of {max_bytes}"
        )));
    }
    Ok(value)
}

/// Python's name for a JSON value's type, as an author sees it.
pub(crate) fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "None",
        Value::Bool(_) => "bool",
        Value::Number(n) if n.is_f64() => "float",
        Value::Number(_) => "int",
        Value::String(_) => "str",
        Value::Array(_) => "list",
        Value::Object(_) => "dict",
    }
}

/// Checks what a hook's `execute` returned; the fields of its `hook_result`.
pub(crate) fn check_result(
    declared: &str,
    trigger_point: &str,
    limits: &Limits,
    ret: Value,
) -> Result<Map<String, Value>, HookError> {
    let Value::Object(mut ret) = ret else {
        return Err(HookError(format!(
            "execute returned {}, not a dict with an 'action'",
            json_type(&ret)
        )));
    };
    let action = match ret.get("action") {
        Some(Value::String(a)) if ACTIONS.contains(&a.as_str()) => a.clone(),
        other => {
            let shown = other
                .map(|v| v.to_string())
                .unwrap_or_else(|| "None".into());
            return Err(HookError(format!(
                "returned action {shown} is not one of {}",
                ACTIONS.join(", ")
            )));
        }
    };
    if action != "pass" && action != declared {
        return Err(HookError(format!(
            "returned action '{action}' but declared '{declared}' (a hook may return only its declared action or pass)"
        )));
    }
    let mut out = Map::new();
    out.insert("action".into(), Value::String(action.clone()));
    if action == "modify" {
        let Some(outgoing) = ret.remove("outgoing") else {
            return Err(HookError("returned modify without 'outgoing'".into()));
        };
        if TEXT_TRIGGER_POINTS.contains(&trigger_point) {
            if !outgoing.is_string() {
                return Err(HookError(format!(
                    "returned outgoing of type {}; {trigger_point} carries text (str)",
                    json_type(&outgoing)
                )));
            }
        } else if !outgoing.is_object() {
            return Err(HookError(format!(
                "returned outgoing of type {}; {trigger_point} carries an object (dict)",
                json_type(&outgoing)
            )));
        }
        out.insert(
            "outgoing".into(),
            bounded_json(outgoing, "outgoing", limits.payload_bytes, limits.depth)?,
        );
    }
    match ret.remove("message") {
        None | Some(Value::Null) => {}
        Some(Value::String(message)) => {
            let chars = message.chars().count();
            if chars > limits.message_chars {
                return Err(HookError(format!(
                    "message is {chars} characters, over the limit of {}",
                    limits.message_chars
                )));
            }
            out.insert("message".into(), Value::String(message));
        }
        Some(other) => {
            return Err(HookError(format!(
                "returned message of type {}, not str",
                json_type(&other)
            )));
        }
    }
    match ret.remove("findings") {
        None | Some(Value::Null) => {}
        Some(findings) => {
            out.insert(
                "findings".into(),
                bounded_json(findings, "findings", limits.findings_bytes, limits.depth)?,
            );
        }
    }
    if let Some(state) = ret.remove("state") {
        out.insert(
            "state".into(),
            bounded_json(state, "state", limits.state_bytes, limits.depth)?,
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_hook_may_return_only_its_declared_action_or_pass() {
        let limits = Limits::default();
        assert!(check_result("modify", "input", &limits, json!({"action": "pass"})).is_ok());
        let err = check_result("detect", "input", &limits, json!({"action": "block"})).unwrap_err();
        assert!(err.0.contains("declared 'detect'"), "{err}");
        let err = check_result("modify", "input", &limits, json!(null)).unwrap_err();
        assert_eq!(err.0, "execute returned None, not a dict with an 'action'");
    }

    #[test]
    fn modify_carries_the_trigger_points_payload_type() {
        let limits = Limits::default();
        let err = check_result(
            "modify",
            "input",
            &limits,
            json!({"action": "modify", "outgoing": {"a": 1}}),
        )
        .unwrap_err();
        assert!(err.0.contains("carries text"), "{err}");
        let ok = check_result(
            "modify",
            "before_tool",
            &limits,
            json!({"action": "modify", "outgoing": {"a": 1}}),
        )
        .unwrap();
        assert_eq!(ok["outgoing"], json!({"a": 1}));
    }

    #[test]
    fn relayed_text_is_cut_at_a_character_boundary_and_says_so() {
        assert_eq!(relayed_text("short".into(), 10), "short");
        let cut = relayed_text("ééééé".into(), 3);
        assert_eq!(cut, "é [8 more bytes cut: at most 3 are relayed]");
    }

    #[test]
    fn sizes_and_depths_are_bounded() {
        let limits = Limits {
            state_bytes: 10,
            depth: 3,
            ..Limits::default()
        };
        let err = check_result(
            "detect",
            "input",
            &limits,
            json!({"action": "pass", "state": "x".repeat(20)}),
        )
        .unwrap_err();
        assert!(err.0.contains("over the limit of 10"), "{err}");
        let err = check_result(
            "detect",
            "input",
            &limits,
            json!({"action": "detect", "findings": [[[[1]]]]}),
        )
        .unwrap_err();
        assert!(err.0.contains("nested deeper than 3"), "{err}");
        let err = check_result(
            "block",
            "input",
            &Limits {
                message_chars: 3,
                ..limits
            },
            json!({"action": "block", "message": "four"}),
        )
        .unwrap_err();
        assert!(err.0.contains("4 characters"), "{err}");
    }
}
