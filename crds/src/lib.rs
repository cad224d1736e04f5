//! Sluice's custom resources (`sluice.dev/v1alpha1`): the types, their semantic validation, and the
//! loader that reads them from YAML files with file and line in every error.

mod capability;
pub mod duration;
mod hookchain;
pub mod manifest;
pub mod quantity;
pub mod sandbox_pod;
pub mod validate;

pub use capability::{Builtin, Capability, CapabilitySpec, Endpoint};
pub use hookchain::{
    ALL_TARGETS, Action, DEFAULT_PLATFORM_NAMESPACE, FailurePolicy, HookChain, HookChainSpec,
    HookChainStatus, HookSpec, PoolSpec, ResourceSpec, Reuse, StreamingSpec, TriggerPoint,
};

use schemars::Schema;

/// Schema of a free-form JSON object (`settings`, `schema`): kept whole by the API server.
fn free_form(_: &mut schemars::SchemaGenerator) -> Schema {
    schemars::json_schema!({
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true
    })
}

/// The CRD manifests as YAML, in the order `make crds` writes them.
pub fn crd_yaml() -> Vec<(&'static str, String)> {
    use kube::CustomResourceExt;
    let render = |crd| manifest::to_yaml(&crd).expect("a CRD always serializes to YAML");
    vec![
        ("hookchain.yaml", render(HookChain::crd())),
        ("capability.yaml", render(Capability::crd())),
    ]
}
