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

/// What judges hook code, in the webhook and the reconciler alike: set once at start
/// (`--python`), else the sandboxes' own CPython beside the binary, else python3.
static CODE_CHECKER: std::sync::OnceLock<sluice_crds::code::Interpreter> =
    std::sync::OnceLock::new();

/// Judge hook code with `python` from now on (at start, before anything is judged).
pub fn set_code_checker(python: sluice_crds::code::Interpreter) {
    let _ = CODE_CHECKER.set(python);
}

/// The platform's signing policy (`--trusted-signers`), set once at start: the webhook refuses and
/// the reconciler marks invalid what it does not let serve.
static SIGNING: std::sync::OnceLock<std::sync::Arc<sluice_crds::signing::PolicyFile>> =
    std::sync::OnceLock::new();

pub fn set_signing(signing: std::sync::Arc<sluice_crds::signing::PolicyFile>) {
    let _ = SIGNING.set(signing);
}

pub fn signing() -> Option<std::sync::Arc<sluice_crds::signing::PolicyFile>> {
    SIGNING.get().cloned()
}

pub fn code_checker() -> sluice_crds::code::Interpreter {
    CODE_CHECKER
        .get_or_init(|| sluice_crds::code::Interpreter::cell_or("python3"))
        .clone()
}
