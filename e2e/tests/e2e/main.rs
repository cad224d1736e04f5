//! The local and fake-cluster end-to-end suites (real runsc sandboxes; `kube_*` against
//! e2e/fake-apiserver), one module per suite, linked as one test binary: a binary per suite cost a
//! link of ~110 MiB each. nextest still runs every test in a process of its own, and
//! .config/nextest.toml names suites by module (`test(/^local_hostile::/)`). The cluster suite
//! (`tests/cluster/`) stays a binary of its own: `make test-cluster` runs it alone.

mod kube_backend;
mod kube_operator;
mod kube_rbac;
mod kube_rollout;
mod local_agent_loop;
mod local_baseline;
mod local_capabilities;
mod local_cells;
mod local_core;
mod local_hostile;
mod local_openai;
mod local_rollout;
mod local_signing;
mod local_stream;
mod local_tenants;
mod local_trust;
mod webhook;
