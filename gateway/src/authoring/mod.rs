//! Tools for hook authors behind the `sluice` CLI: `check` (static, no cluster, no hook code run on
//! the host) and `test`/`run` (the chain in real local sandboxes).

pub mod check;
pub mod hooktest;
