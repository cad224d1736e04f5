//! The authoring side of Sluice, behind the `sluice` command (`src/bin/sluice.rs`): `check` (what can
//! be known of HookChain and Capability files without running a hook), `hooktest` (`*.test.yaml`
//! cases run against a local gateway with stubbed capabilities; `coverage`, the lines they ran), and `rollout` (a local gateway's
//! rollouts, read as `kubectl rollout status` reads a Deployment's).
//!
//! Reading order: `bin/sluice.rs` (the commands) → `check` → `hooktest` → `coverage` → `rollout`.

mod check;
pub mod coverage;
pub mod doctor;
mod hooktest;
pub mod rollout;
pub mod sign;

pub use check::{Finding, Report, check, expand};
pub use hooktest::{
    Case, CaseError, CaseReport, Expect, FileReport, Local, RunOptions, Stub, TestFile,
    TestFileError, compare, junit, response_json, run_file,
};
