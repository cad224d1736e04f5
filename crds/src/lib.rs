//! Sluice's custom resources (`sluice.dev/v1alpha1`): the types, their semantic validation, and the
//! loader that reads them from YAML files with file and line in every error. Also what the operator
//! and the gateway both judge CRD contents with: the hook code analyser and the JSON-schema check.
//!
//! Reading order: `hookchain` and `capability` (the types) → `validate` (semantic rules, with
//! `quantity`) → `code` (hook code analysis) and `schema` (capability schemas) → `definition` (what
//! the gateway serves, without the Kubernetes envelope) → `manifest` (YAML files) → `sandbox_pod`
//! (labels and commands operator and gateway agree on) → `watch` (how both watch the API server).
//! `log_text` is how any of them writes a string someone else chose into a text log.
//!
//! Without the default `kube` feature the crate holds only what needs no Kubernetes client: the specs,
//! validation, code and schema checks and `definition`. The `HookChain`/`Capability` objects,
//! `manifest` and the CRD YAML need `kube`.

// KubeSchema copies `Endpoint` (as `EndpointValidated`, `pub`, without our attributes) to build its
// CEL rule; `unreachable_pub` flags that copy, so it is allowed for this module alone.
#[allow(unreachable_pub)]
mod capability;
pub mod code;
#[cfg(feature = "kube")]
pub mod cpu;
pub mod definition;
pub mod duration;
pub mod endpoints;
#[cfg(feature = "kube")]
pub mod fields;
mod hookchain;
pub mod library;
pub mod log_text;
#[cfg(feature = "kube")]
pub mod manifest;
#[cfg(feature = "kube")]
pub mod quantity;
pub mod rollout;
pub mod sandbox_pod;
pub mod schema;
pub mod signing;
pub mod validate;
#[cfg(feature = "kube")]
pub mod watch;

pub use capability::{Builtin, CapabilitySpec, Endpoint};
#[cfg(feature = "kube")]
pub use capability::{Capability, CapabilityStatus};
pub use hookchain::{
    ALL_TARGETS, Action, DEFAULT_PLATFORM_NAMESPACE, FailurePolicy, HookChainSpec, HookSpec,
    MAX_CHAIN_CODE_BYTES, PoolSpec, ResourceSpec, Reuse, RolloutSpec, RolloutStrategy,
    StreamingSpec, TriggerPoint,
};
#[cfg(feature = "kube")]
pub use hookchain::{HookChain, HookChainStatus};

use schemars::Schema;

/// The known name `unknown` most likely meant, if one is close enough to suggest.
pub fn did_you_mean<'a>(
    unknown: &str,
    known: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    let lower = unknown.to_ascii_lowercase();
    let mut best: Option<(f64, &str)> = None;
    for k in known {
        if k.to_ascii_lowercase() == lower {
            return Some(k);
        }
        let score = strsim::jaro_winkler(&lower, &k.to_ascii_lowercase());
        let close = strsim::levenshtein(&lower, &k.to_ascii_lowercase()) <= 2 || score >= 0.85;
        if close && best.is_none_or(|(s, _)| score > s) {
            best = Some((score, k));
        }
    }
    best.map(|(_, k)| k)
}

/// Schema of a free-form JSON object (`settings`, `schema`): kept whole by the API server.
fn free_form(_: &mut schemars::SchemaGenerator) -> Schema {
    schemars::json_schema!({
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true
    })
}

/// The CRD manifests as YAML, in the order `make crds` writes them.
#[cfg(feature = "kube")]
pub fn crd_yaml() -> Vec<(&'static str, String)> {
    let render = |crd| manifest::to_yaml(&crd).expect("a CRD always serializes to YAML");
    vec![
        ("hookchain.yaml", render(crd::hookchain())),
        ("capability.yaml", render(crd::capability())),
    ]
}

#[cfg(feature = "kube")]
pub mod crd;
