//! What a caller asks for, checked before anything runs: names, trigger point, context, payload. The
//! transports (gRPC, tests) hand requests over as these types and get `EngineError`s back.

use crate::chain::ChainKey;
use crate::limits::Limits;
use serde_json::Value;
use sluice_crds::TriggerPoint;
use std::collections::BTreeMap;

/// Why a request got no verdict. Each maps to one gRPC status in the server.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Unavailable(String),
    /// No verified identity where the gateway has a caller policy.
    #[error("{0}")]
    Unauthenticated(String),
    /// The caller's identity may not use the namespace it asked for.
    #[error("{0}")]
    PermissionDenied(String),
}

impl EngineError {
    /// The label of the `rejected` metric: the gRPC code's name.
    pub(crate) fn code(&self) -> &'static str {
        match self {
            EngineError::InvalidArgument(_) => "invalid_argument",
            EngineError::NotFound(_) => "not_found",
            EngineError::Unavailable(_) => "unavailable",
            EngineError::Unauthenticated(_) => "unauthenticated",
            EngineError::PermissionDenied(_) => "permission_denied",
        }
    }
}

fn invalid(msg: impl Into<String>) -> EngineError {
    EngineError::InvalidArgument(msg.into())
}

/// Who sent a request, as the transport established it (TLS session or `authorization` metadata),
/// never from the request's body or context.
#[derive(Clone, Debug, Default)]
pub enum CallerAuth {
    /// The gateway has no caller policy: whoever reaches the port may use any namespace.
    #[default]
    Unchecked,
    /// A caller of the policy, with the namespaces it may use.
    Verified(Identity),
    /// The gateway has a caller policy and the request matched none of it: why.
    Unauthenticated(String),
}

/// A caller the policy knows: its name (in the audit and in every capability's `caller`) and the
/// namespaces it may use (`*` for all).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub name: String,
    pub namespaces: Vec<String>,
}

impl Identity {
    pub fn may_use(&self, namespace: &str) -> bool {
        self.namespaces.iter().any(|n| n == "*" || n == namespace)
    }
}

impl CallerAuth {
    /// The caller's name, when it has one.
    pub fn name(&self) -> Option<&str> {
        match self {
            CallerAuth::Verified(i) => Some(&i.name),
            _ => None,
        }
    }

    /// Whether this caller may send a request for `namespace`.
    pub fn admit(&self, namespace: &str) -> Result<(), EngineError> {
        match self {
            CallerAuth::Unchecked => Ok(()),
            CallerAuth::Unauthenticated(why) => Err(EngineError::Unauthenticated(why.clone())),
            CallerAuth::Verified(i) if i.may_use(namespace) => Ok(()),
            CallerAuth::Verified(i) => Err(EngineError::PermissionDenied(format!(
                "caller {:?} may not use namespace {namespace:?}",
                i.name
            ))),
        }
    }
}

/// One request to run a payload through a trigger point, as the transport hands it over.
#[derive(Clone, Debug, Default)]
pub struct RunInput {
    pub namespace: String,
    pub target: String,
    pub trigger_point: String,
    pub payload: Option<Value>,
    pub context: BTreeMap<String, String>,
    pub session_id: String,
    pub auth: CallerAuth,
    /// Which proxy the run came through (`None`: the gRPC API), for its audit event.
    pub via: Option<Via>,
}

/// The gateway's proxy a run came through, and the protocol's method that carried its payload
/// (MCP's `tools/call`...): its audit event says so (`"via": {"proxy": "mcp", "method": ...}`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Via {
    pub proxy: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
}

impl Via {
    pub fn proxy(proxy: &'static str, method: Option<&str>) -> Self {
        Self {
            proxy,
            method: method.map(str::to_string),
        }
    }
}

/// Where a run goes: validated identity of the chain and the caller.
#[derive(Clone, Debug)]
pub(crate) struct Target {
    pub key: ChainKey,
    pub context: BTreeMap<String, String>,
    pub session_id: String,
    /// The verified caller's name, if the gateway has a caller policy.
    pub caller: Option<String>,
}

impl Target {
    /// The application's context as hooks and capabilities see it: its `caller` entry is the
    /// verified caller's name, or absent; a context key of that name never passes for one.
    pub(crate) fn caller_context(&self) -> BTreeMap<String, String> {
        let mut m = self.context.clone();
        match &self.caller {
            Some(name) => m.insert("caller".into(), name.clone()),
            None => m.remove("caller"),
        };
        m
    }

    /// Checks who sent it (identity, then the namespace it may use), then what it sent: names,
    /// trigger point, context size.
    pub(crate) fn check(
        limits: &Limits,
        auth: &CallerAuth,
        namespace: &str,
        target: &str,
        trigger_point: &str,
        context: BTreeMap<String, String>,
        session_id: String,
    ) -> Result<Target, EngineError> {
        if namespace.is_empty() || namespace.len() > 253 {
            return Err(invalid("namespace must be 1-253 characters"));
        }
        auth.admit(namespace)?;
        if target.is_empty() || target.len() > 253 {
            return Err(invalid("target must be 1-253 characters"));
        }
        let Some(tp) = TriggerPoint::parse(trigger_point) else {
            let all: Vec<&str> = TriggerPoint::ALL.iter().map(|t| t.as_str()).collect();
            return Err(invalid(format!(
                "trigger_point {trigger_point:?} is not one of {}",
                all.join(", ")
            )));
        };
        if context.len() > limits.context_entries {
            return Err(invalid(format!(
                "context has {} entries, over the limit of {}",
                context.len(),
                limits.context_entries
            )));
        }
        let context_bytes: usize = context.iter().map(|(k, v)| k.len() + v.len()).sum();
        if context_bytes > 64 * 1024 {
            return Err(invalid(format!(
                "context is {context_bytes} bytes, over the limit of 65536"
            )));
        }
        if session_id.len() > 256 {
            return Err(invalid("session_id is over 256 characters"));
        }
        Ok(Target {
            key: ChainKey {
                namespace: namespace.into(),
                target: target.into(),
                trigger_point: tp,
            },
            context,
            session_id,
            caller: auth.name().map(str::to_string),
        })
    }
}

/// Checks a payload against its trigger point: text for input/output, an object otherwise.
pub(crate) fn check_payload(
    limits: &Limits,
    tp: TriggerPoint,
    payload: &Option<Value>,
) -> Result<Value, EngineError> {
    let Some(p) = payload else {
        return Err(invalid(format!(
            "{tp} needs a payload ({})",
            if tp.carries_text() { "text" } else { "value" }
        )));
    };
    if tp.carries_text() && !p.is_string() {
        return Err(invalid(format!(
            "{tp} carries text: send the payload as text"
        )));
    }
    if !tp.carries_text() && !p.is_object() {
        return Err(invalid(format!(
            "{tp} carries a structured payload: send an object as value"
        )));
    }
    let size = serde_json::to_vec(p).map(|b| b.len()).unwrap_or(usize::MAX);
    if size > limits.payload_bytes {
        return Err(invalid(format!(
            "payload is {size} bytes, over the limit of {}",
            limits.payload_bytes
        )));
    }
    Ok(p.clone())
}
