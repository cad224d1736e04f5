//! The gateway's integration tests, one module per concern, linked as one test binary (a binary per
//! file cost a link each). nextest still runs every test in a process of its own.

mod bind_first;
mod chain_dir;
mod common;
mod local_mode;
mod metrics;
mod security;
mod signing;
mod tracing;
