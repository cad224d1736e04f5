//! Which target's chains guard a request. The `x-sluice-target` header names it, or else the
//! request's `model`. A target no tenant chain serves is refused (an application that sends its
//! real model name would otherwise be served by the platform's baseline alone, and nothing would
//! tell it), unless the platform said otherwise: `--openai-default-target` guards every model no
//! chain serves with that target's chains, and `--openai-unguarded-model` lets a named model
//! through with the baseline alone. Every answer names the target in `x-sluice-target` (and
//! `x-sluice-unguarded: baseline-only` for a model let through).

use super::OpenAiOptions;
use super::error::ApiError;
use sluice_engine::Registry;

/// Header naming the target whose chains guarded an answer.
pub(crate) const TARGET_HEADER: &str = "x-sluice-target";
/// Header on the answers to a model the platform lets through with the baseline alone.
pub(crate) const UNGUARDED_HEADER: &str = "x-sluice-unguarded";

/// How a request is guarded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Guard {
    /// By the tenant chains of this target.
    Chains(String),
    /// By the baseline alone: a model the platform lets through (`--openai-unguarded-model`).
    BaselineOnly(String),
}

impl Guard {
    pub(crate) fn target(&self) -> &str {
        match self {
            Guard::Chains(t) | Guard::BaselineOnly(t) => t,
        }
    }

    /// The headers that say so on the answer.
    pub(crate) fn mark<B>(&self, resp: &mut hyper::Response<B>) {
        let headers = resp.headers_mut();
        if let Ok(v) = hyper::header::HeaderValue::from_str(self.target()) {
            headers.insert(TARGET_HEADER, v);
        }
        if matches!(self, Guard::BaselineOnly(_)) {
            headers.insert(
                UNGUARDED_HEADER,
                hyper::header::HeaderValue::from_static("baseline-only"),
            );
        }
    }
}

/// The guard of a request in `namespace`: `header` is `x-sluice-target`, `model` the request's.
pub(crate) fn resolve(
    registry: &Registry,
    opts: &OpenAiOptions,
    namespace: &str,
    header: Option<&str>,
    model: &str,
) -> Result<Guard, ApiError> {
    let named = header.unwrap_or(model);
    if registry.serves_target(namespace, named) {
        return Ok(Guard::Chains(named.to_string()));
    }
    if opts.unguarded_models.iter().any(|m| m == named) {
        return Ok(Guard::BaselineOnly(named.to_string()));
    }
    // An explicit target is what the application meant: never replaced by the default.
    if header.is_none()
        && let Some(default) = &opts.default_target
    {
        if registry.serves_target(namespace, default) {
            return Ok(Guard::Chains(default.clone()));
        }
        return Err(ApiError::target_not_found(
            format!(
                "no HookChain serves model {model:?} in namespace {namespace:?}, nor the gateway's default target {default:?} (--openai-default-target)"
            ),
            None,
        ));
    }
    let (what, param) = match header {
        Some(t) => (format!("target {t:?} (x-sluice-target)"), None),
        None => (format!("model {model:?}"), Some("model")),
    };
    Err(ApiError::target_not_found(
        format!(
            "no HookChain serves {what} in namespace {namespace:?}, so the request is not sent unguarded: name a target with chains in x-sluice-target, or the platform can set --openai-default-target or --openai-unguarded-model"
        ),
        param,
    ))
}
