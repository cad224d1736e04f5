//! The `sluice` command's integration tests, linked as one test binary. nextest still runs every
//! test in a process of its own.

mod call_secured;
mod cli;
mod rollout_status;
mod signing;
mod walk;
