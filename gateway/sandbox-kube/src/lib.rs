//! Sluice's `kube` sandbox backend. The operator keeps warm gVisor pods per HookChain; the gateway
//! claims one per trigger point by a preconditioned label PATCH and talks to its supervisor over the
//! exec API. It implements the sandbox seam (`sluice-sandbox`) and knows nothing of chains or of the
//! engine: the HookChains and Capabilities come from `sluice-source-kube`.
//!
//! Reading order: `backend` (`KubeBackend`: a `SandboxBackend`) → `claim` (which pod, and the PATCH
//! that makes it ours) → `exec` (the supervisor's pipes over the exec websocket, with its heartbeat)
//! → `client` (the API server client, on TCP connections with keepalive) → `watch` (what every
//! kube-mode watch shares, this crate's and the chain source's).

mod backend;
mod claim;
mod client;
mod exec;
pub mod watch;

pub use backend::{KubeBackend, KubeConfig};
pub use client::client;
pub use exec::{Keepalive as ExecKeepalive, KeepaliveError as ExecKeepaliveError};
/// Names shared with the operator.
pub use sluice_crds::sandbox_pod as labels;
