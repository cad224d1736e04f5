//! The operator's integration tests, one module per concern, linked as one test binary (a binary per
//! file cost a link each). nextest still runs every test in a process of its own.

mod common;
mod controller;
mod finalizer;
mod leader;
mod reconcile;
mod render;
