//! The engine's integration tests, one module per concern, linked as one test binary (a binary per
//! file cost a link each). nextest still runs every test in a process of its own.

mod baseline;
mod callers;
mod clocks;
mod common;
mod coverage;
mod host_calls;
mod integrity;
mod logs;
mod observability;
mod pools;
mod recycle;
mod rollout;
mod run;
mod scheduling;
mod signing;
mod stream;
mod stream_window;
