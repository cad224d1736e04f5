//! Stage 3, build: the objects the chain should have, from the chain and the operator's settings
//! alone. Pure: the builders are in `objects` (also what `sluice-operator render` prints), unit-tested
//! with plain asserts.

pub mod objects;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::networking::v1::NetworkPolicy;
pub use objects::*;
use sluice_crds::HookChain;

/// What the chain should have.
pub(crate) struct Desired {
    /// Hash of the pod template: pods of another template are rolled.
    pub template: String,
    pub pod: Pod,
    pub policy: NetworkPolicy,
}

pub(crate) fn build(chain: &HookChain, settings: &Settings) -> Desired {
    Desired {
        template: objects::template_hash(chain, settings),
        pod: objects::pod(chain, settings),
        policy: objects::network_policy(chain, settings),
    }
}
