//! The API's error shape, `{"error": {"message", "type", "param", "code"}}`, for everything the
//! proxy refuses and for upstream failures that came without one.

use super::{Body, json_response};
use hyper::{Response, StatusCode};
use serde_json::json;
use sluice_engine::EngineError;

/// An answer that is an OpenAI error object.
#[derive(Debug)]
pub(crate) struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    code: &'static str,
    param: Option<String>,
    /// The upstream's own error object, its four fields passed on as they came.
    upstream_body: Option<serde_json::Value>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, code: &'static str, message: String) -> Self {
        Self {
            status,
            message,
            kind,
            code,
            param: None,
            upstream_body: None,
        }
    }

    /// The upstream's error, with its status and object as they came (`message` for the log).
    pub(crate) fn from_upstream(
        status: StatusCode,
        body: serde_json::Value,
        message: &str,
    ) -> Self {
        let mut e = Self::new(
            status,
            "upstream_error",
            "upstream_failed",
            message.to_string(),
        );
        // Its four fields only, each a string or null (the allow-list holds for errors too).
        let field = |k: &str| {
            body.pointer(&format!("/error/{k}"))
                .filter(|v| v.is_string() || v.is_number())
                .cloned()
                .unwrap_or(serde_json::Value::Null)
        };
        e.upstream_body = Some(json!({"error": {
            "message": field("message"), "type": field("type"),
            "param": field("param"), "code": field("code"),
        }}));
        e
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_request",
            message.into(),
        )
    }

    pub(crate) fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        let mut e = Self::invalid(message);
        e.param = Some(param.to_string());
        e
    }

    pub(crate) fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            format!("the request body is over the limit of {limit} bytes"),
        )
    }

    pub(crate) fn unsupported_media_type(got: &str) -> Self {
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            "unsupported_media_type",
            format!("the request body must be application/json, not {got:?}"),
        )
    }

    pub(crate) fn method_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "method_not_allowed",
            "this method is not served on this path".into(),
        )
    }

    pub(crate) fn not_found(path: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "unknown_url",
            format!(
                "unknown path {path:?}: the proxy serves POST /v1/chat/completions and GET /v1/models"
            ),
        )
    }

    /// No chain serves the request's target (404, as the API answers a model it does not have).
    pub(crate) fn target_not_found(message: String, param: Option<&str>) -> Self {
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "target_not_found",
            message,
        );
        e.param = param.map(str::to_string);
        e
    }

    pub(crate) fn unauthenticated(why: &str) -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "invalid_api_key",
            format!("the caller is not known to the gateway: {why}"),
        )
    }

    /// The upstream could not be reached, failed, or answered with something that is not the API.
    pub(crate) fn upstream(status: StatusCode, message: impl Into<String>) -> Self {
        Self::new(status, "upstream_error", "upstream_failed", message.into())
    }

    /// A hook chain could not give a verdict (no sandbox, bad request, a caller that may not use the
    /// namespace): nothing goes upstream.
    pub(crate) fn engine(e: EngineError) -> Self {
        let (status, kind, code) = match &e {
            EngineError::InvalidArgument(_) => (
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "invalid_request",
            ),
            EngineError::NotFound(_) => {
                (StatusCode::NOT_FOUND, "invalid_request_error", "not_found")
            }
            EngineError::Unavailable(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                "guardrails_unavailable",
            ),
            EngineError::Unauthenticated(_) => (
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "invalid_api_key",
            ),
            EngineError::PermissionDenied(_) => (
                StatusCode::FORBIDDEN,
                "permission_error",
                "namespace_not_allowed",
            ),
        };
        Self::new(status, kind, code, e.to_string())
    }

    pub(crate) fn message(&self) -> &str {
        &self.message
    }

    pub(crate) fn body(&self) -> serde_json::Value {
        if let Some(b) = &self.upstream_body {
            return b.clone();
        }
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }

    pub(crate) fn into_response(self) -> Response<Body> {
        json_response(self.status, &self.body())
    }
}
