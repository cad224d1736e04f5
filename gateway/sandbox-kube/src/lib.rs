//! Sluice's `kube` sandbox backend and kube-mode chain source. The operator keeps warm gVisor pods per
//! HookChain; the gateway claims one per trigger point by a preconditioned label PATCH and talks to
//! its supervisor over the exec API. HookChains and Capabilities come from watch caches.
//!
//! Reading order: `backend` (`KubeBackend`: the engine's `SandboxBackend`) → `claim` (which pod, and
//! the PATCH that makes it ours) → `exec` (the supervisor's pipes over the exec websocket, with its
//! heartbeat) → `client` (the API server client, on TCP connections with keepalive) →
//! `source` (`KubeSource`: watches → registry) → `watch` (what the watches share).

mod backend;
mod claim;
mod client;
mod exec;
mod source;
mod watch;

pub use backend::{KubeBackend, KubeConfig};
pub use client::client;
pub use exec::{Keepalive as ExecKeepalive, KeepaliveError as ExecKeepaliveError};
/// Names shared with the operator.
pub use sluice_crds::sandbox_pod as labels;
pub use source::{AnnotateRollback, KubeSource, publish_shadows};
