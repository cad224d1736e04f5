//! Sluice's trusted engine: runs HookChains in sandboxes for one trigger point at a time. No gRPC, no
//! Kubernetes, no runsc: sandboxes come from a `SandboxBackend`, host_calls go to `Capabilities`, and
//! both are given by whoever assembles a gateway (`sluice-gateway`) or a test.
//!
//! Reading order:
//! 1. `run` (`Engine::run`: one trigger point end to end) and `stream` (`Engine::stream`: an agent
//!    reply on two paths, through `window`);
//! 2. `pipeline` (baseline first, then the tenant's chain: `chains`) and `claimed_chain` (one chain in
//!    one claimed sandbox, resumed in a fresh one under `Open`);
//! 3. `supervisor` and `wire` (the conversation with a sandbox, `supervisor/PROTOCOL.md`) →
//!    `outcome` (what the trusted side makes of it) → `state_vector`; `run_id` and `moment` (what
//!    hooks are told of a run's id and of time);
//! 4. `sandbox` (the backend trait) and `pool` (warm sandboxes per chain: the set of pools, one
//!    chain's pool, the gateway-wide boot scheduler, why a sandbox is retired);
//! 5. `host_calls` (the trait the capability runner implements) and `host_call_guard` (the limits the
//!    gateway keeps on them), `registry` and `chain` (what is
//!    served), `request` (checking what callers send), `engine` (what runs share: audit, metrics,
//!    limits), `coverage` (the lines hooks ran, for authoring tools).

mod audit;
mod chain;
mod chains;
mod claimed_chain;
mod coverage;
mod engine;
mod host_call_guard;
mod host_calls;
mod limits;
/// The escaping of text others chose in log lines: one rule, kept in `sluice-crds` so the operator
/// shares it.
mod log_text {
    pub(crate) use sluice_crds::log_text::Escaped;
}
mod metrics;
mod moment;
mod outcome;
mod pipeline;
mod pool;
mod registry;
mod request;
mod rollout;
mod run;
mod run_id;
/// The sandbox seam, its own crate: the paths inside the engine stay `crate::sandbox::…`.
mod sandbox {
    pub(crate) use sluice_sandbox::*;
}
mod state_vector;
mod stream;
mod supervisor;
mod window;
mod wire;

pub use audit::{
    Audit, AuditGate, AuditHostCall, AuditHostCallCount, AuditHostCallSummary, AuditRollout,
};
pub use chain::{Chain, ChainError, ChainKey};
pub use coverage::HookCoverage;
pub use engine::Engine;
pub use host_calls::{Caller, Capabilities, HostCallCode, HostCallError, HostCalls, NoHostCalls};
pub use limits::Limits;
pub use metrics::Metrics;
pub use moment::Moment;
pub use outcome::{HookOutcome, Layer, Walk};
pub use pool::{ClaimError, Pools, WarmProgress};
pub use registry::{CapabilityEntry, Registry};
pub use request::{CallerAuth, EngineError, Identity, RunInput, Via};
pub use rollout::{
    RevisionStatus, Role, RolloutSink, RolloutStatus, ShadowHook, ShadowSummary, Tally,
};
pub use run::{Handback, RunResult};
pub use sluice_crds::log_text::Escaped;
/// What a backend implements, for callers that assemble an engine; the rest of the seam is
/// `sluice-sandbox`'s.
pub use sluice_sandbox::{
    Sandbox, SandboxBackend, SandboxHandle, SandboxSpec, StartError, StartFailure,
    SupervisorProgram,
};
pub use state_vector::StateVector;
pub use stream::{ClientStreamError, StreamError, StreamInput, StreamOpen, StreamOutput};
pub use supervisor::{
    CellEnd, EndAndPrepareError, RunContext, SandboxFailure, SupervisorConn, WalkReport,
};
pub use window::chunk_at;
