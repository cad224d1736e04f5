//! Sluice gateway: the gRPC server and the trusted engine that runs HookChains in sandboxes.
//!
//! Reading order: `engine` (one trigger point end to end) → `supervisor` (the conversation with a
//! sandbox) → `outcome` (what the trusted side makes of it) → `pool` and `sandbox` (where sandboxes
//! come from) → `server` (gRPC).

pub mod audit;
pub mod authoring;
pub mod chain;
pub mod convert;
pub mod endpoint;
pub mod engine;
pub mod gateway;
pub mod kube_source;
pub mod kube_watch;
pub mod limits;
pub mod local_dir;
pub mod metrics;
pub mod outcome;
pub mod pipeline;
pub mod pool;
pub mod proto;
pub mod registry;
pub mod runner;
pub mod sandbox;
pub mod server;
pub mod state_vector;
pub mod stream;
pub mod supervisor;
pub mod wire;
