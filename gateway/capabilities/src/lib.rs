//! Sluice's capability runner: the engine's `Capabilities`, answering every hook's `host_call` by
//! resolve → schema → gates → execute → dispatch, with execute going to a gRPC
//! (`sluice.v1.CapabilityService`), HTTP or built-in endpoint.
//!
//! Reading order: `runner` (the steps of one host_call) → `trust` (where capabilities may point,
//! what the gateway presents to them) → `endpoint` (where execute goes) → `propagation` (the trace
//! context a request carries on).

mod endpoint;
mod propagation;
mod runner;
mod trust;

pub use runner::{CallError, Runner};
pub use trust::Trust;
