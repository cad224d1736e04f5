//! Sluice's gateway: the `sluice.v1.Gateway` gRPC service around the engine, and the assembly of a
//! running gateway in local mode (runsc sandboxes, a directory of YAML) or kube mode (claimed pods,
//! watches), with health, reflection, metrics and graceful shutdown. The `sluice-gateway` binary is
//! `src/bin/sluice-gateway.rs`.
//!
//! Reading order: `assembly` (`start_local`, `start_kube`, `RunningGateway`) → `service` (gRPC ↔
//! engine translation) and `handback` (a Run's sandboxes go back once its answer is written) →
//! `local_dir` (local mode's chain source) → `dir_watch` (noticing its changes) → `tls` (the
//! listener's reloading TLS) and `callers` (the caller policy: who may use which namespace) →
//! `observability` (logs, and OpenTelemetry traces when the environment configures them); `openai`
//! is the optional OpenAI-compatible HTTP proxy in front of a model, running the same chains
//! (`--openai-listen`), and `mcp` the optional MCP proxy in front of MCP servers (`--mcp-listen`);
//! `http_port` is the HTTP listener both proxies share.

mod assembly;
mod callers;
mod dir_watch;
mod handback;
mod http_port;
mod local_dir;
mod mcp;
pub mod observability;
mod openai;
mod service;
mod tls;

pub use assembly::{
    ExposureError, KubeOptions, LocalOptions, RunningGateway, Security, start_kube, start_local,
};
pub use callers::PolicyError;
pub use local_dir::{LocalSource, code_checker, load, load_for};
pub use mcp::{McpOptions, McpServer};
pub use openai::{OpenAiOptions, UpstreamError};
pub use sluice_capabilities::Trust;
pub use tls::{TlsError, TlsFiles};
