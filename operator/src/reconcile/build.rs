//! Stage 3, build: the objects the chain should have, from the chain and the operator's settings
//! alone (pure; the builders themselves are `crate::build`, unit-tested with plain asserts).

use crate::build::{self, Settings};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::networking::v1::NetworkPolicy;
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
        template: build::template_hash(chain, settings),
        pod: build::pod(chain, settings),
        policy: build::network_policy(chain, settings),
    }
}
