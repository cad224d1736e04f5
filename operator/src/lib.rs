//! Sluice operator: keeps a warm pool of gVisor sandbox pods for every HookChain, judges hook code
//! before the pool grows, and reports what it sees in status, Events and metrics.
//!
//! Reading order: `build` (the objects, pure) → `pool` (the backfill decision, pure) →
//! `expectations` (what the cache does not show yet) → `validate` and `status` (the verdict and the
//! conditions, pure) → `reconcile` (its stages, one module each: read → validate → build → decide →
//! apply → status) → `controller` (the watches) → `leader` (one active replica) → `metrics`,
//! `render`, `webhook` (the validating admission webhook every replica serves) and `certs` (the
//! certificates it makes for the gateway and the webhook when no one else does).

pub mod certs;
pub mod controller;
pub mod expectations;
pub mod leader;
pub mod metrics;
pub mod reconcile;
pub mod render;
pub mod webhook;
