//! The sandbox seam: a backend starts a sandbox running the supervisor and hands back its protocol
//! pipes and a handle that destroys it. `sluice-sandbox-local` runs runsc on this machine;
//! `sluice-sandbox-kube` claims a warm pod and reaches it over the exec API;
//! `sluice-sandbox-process` runs the supervisor as a plain child process for tests. Everything above
//! this trait is the same for all of them. Its own crate, so that a backend depends on the seam
//! and not on the engine.

mod program;

pub use program::{CELL_RUNTIME, ProgramError, SUPERVISOR_BINARY, SupervisorProgram};

use async_trait::async_trait;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};

/// One sandbox's chain and limits, as the chain's `spec.resources` gives them. Quantities stay as
/// written (`250m`, `128Mi`): they are Kubernetes quantities, checked where manifests are read
/// (`sluice_crds::validate`) and turned into numbers by the backends that need numbers
/// (`sluice_crds::quantity`), so the engine needs no Kubernetes code.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SandboxSpec {
    /// The HookChain the sandbox serves: the `kube` backend claims that chain's warm pods.
    pub namespace: String,
    pub chain: String,
    /// CPU the sandbox is guaranteed (the chain's `resources.cpu`), a Kubernetes quantity: a pod's
    /// request, a local sandbox's `cpu.shares`.
    pub cpu: String,
    /// The most CPU this sandbox may use, a Kubernetes quantity, when it has one of its own (a pod's
    /// CPU limit, which the fake kubelet passes on); `None`: the backend's setting (the platform's
    /// sandbox CPU limit).
    pub cpu_limit: Option<String>,
    /// Memory limit, a Kubernetes quantity.
    pub memory: String,
    pub pids: u32,
}

impl SandboxSpec {
    pub fn for_chain(namespace: &str, chain: &str, r: &sluice_crds::ResourceSpec) -> Self {
        Self {
            namespace: namespace.to_string(),
            chain: chain.to_string(),
            cpu: r.cpu.clone(),
            cpu_limit: None,
            memory: r.memory.clone(),
            pids: r.pids,
        }
    }
}

/// Bytes the hooks of one trigger point may print (stdout and stderr together) before a deadline
/// kill is blamed on their printing.
pub const OUTPUT_LIMIT: u64 = 8 << 20;

/// Reads a sandbox's stdout (hooks' prints) and drops it, counting the bytes in `counter` over the
/// sandbox's life. It never stops reading: what one trigger point printed must not stall the next
/// one in a recycled sandbox, and a hook that prints without end is ended by its deadline (the
/// failure then names the output limit, counted per trigger point by `SupervisorConn`). Every
/// backend drains stdout this way.
pub async fn discard_output(mut stdout: impl AsyncRead + Unpin, counter: Arc<AtomicU64>) {
    let mut buf = vec![0u8; 64 << 10];
    while let Ok(n) = stdout.read(&mut buf).await {
        if n == 0 {
            break;
        }
        counter.fetch_add(n as u64, Ordering::Relaxed);
    }
}

pub type Writer = Pin<Box<dyn AsyncWrite + Send>>;
pub type Reader = Pin<Box<dyn AsyncRead + Send>>;

/// A started sandbox whose supervisor reads requests from `stdin` and writes the protocol to
/// `protocol` (its stderr). Its stdout is already being drained and discarded by the backend.
pub struct Sandbox {
    pub id: String,
    pub stdin: Writer,
    pub protocol: Reader,
    pub handle: Box<dyn SandboxHandle>,
}

impl std::fmt::Debug for Sandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sandbox").field("id", &self.id).finish()
    }
}

#[async_trait]
pub trait SandboxHandle: Send + Sync {
    /// Ends the sandbox and removes everything it left (processes, cgroups, files). Idempotent.
    /// Without `force` the sandbox (whose stdin the caller closed) gets a moment to exit by itself.
    async fn destroy(&self, force: bool);
    /// Bytes the sandbox wrote to stdout (hooks' prints), for the audit and metrics.
    fn stdout_bytes(&self) -> u64;
    /// Whether sandboxes of another kind now serve its chain (the `kube` backend: the operator
    /// makes pods of another template, such as a new supervisor image after an upgrade). A
    /// recycled sandbox that is outdated is retired at the end of its trigger point, so an upgrade
    /// reaches pods a gateway holds without failing a run.
    fn outdated(&self) -> bool {
        false
    }
    /// The CPU throttling the sandbox met since it started, when the backend can see its cgroup
    /// (the local backend reads `cpu.stat`; a pod's is the kubelet's
    /// `container_cpu_cfs_throttled_periods_total`, so the `kube` backend says `None`).
    fn cpu_throttling(&self) -> Option<CpuThrottling> {
        None
    }
}

/// CFS throttling of one sandbox, counted from its start: the periods in which it used up its quota
/// and had to wait, and how long it waited.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuThrottling {
    pub periods: u64,
    pub time: std::time::Duration,
}

impl CpuThrottling {
    /// Parses a cgroup's `cpu.stat`: v1 (`nr_throttled`, `throttled_time` in ns) or v2
    /// (`nr_throttled`, `throttled_usec`).
    pub fn from_cpu_stat(text: &str) -> Option<Self> {
        let mut out = Self::default();
        let mut seen = false;
        for line in text.lines() {
            let Some((key, value)) = line.split_once(' ') else {
                continue;
            };
            let Ok(value) = value.trim().parse::<u64>() else {
                continue;
            };
            match key {
                "nr_throttled" => {
                    out.periods = value;
                    seen = true;
                }
                "throttled_time" => out.time = std::time::Duration::from_nanos(value),
                "throttled_usec" => out.time = std::time::Duration::from_micros(value),
                _ => {}
            }
        }
        seen.then_some(out)
    }

    /// What was added since `before`.
    pub fn since(self, before: Self) -> Self {
        Self {
            periods: self.periods.saturating_sub(before.periods),
            time: self.time.saturating_sub(before.time),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::CpuThrottling;
    use std::time::Duration;

    #[test]
    fn cpu_stat_of_either_cgroup_version_parses() {
        let v1 = "nr_periods 120\nnr_throttled 7\nthrottled_time 45000000\n";
        assert_eq!(
            CpuThrottling::from_cpu_stat(v1),
            Some(CpuThrottling {
                periods: 7,
                time: Duration::from_millis(45)
            })
        );
        let v2 = "usage_usec 10\nnr_periods 3\nnr_throttled 2\nthrottled_usec 1500\n";
        assert_eq!(
            CpuThrottling::from_cpu_stat(v2).map(|t| t.time),
            Some(Duration::from_micros(1500))
        );
        assert_eq!(CpuThrottling::from_cpu_stat("usage_usec 10\n"), None);
        let later = CpuThrottling {
            periods: 9,
            time: Duration::from_millis(50),
        };
        assert_eq!(
            later.since(CpuThrottling::from_cpu_stat(v1).unwrap()),
            CpuThrottling {
                periods: 2,
                time: Duration::from_millis(5)
            }
        );
    }
}

/// Why a sandbox could not be started for a chain: the chain, the sandbox once the backend had named
/// it, and what failed.
#[derive(Debug, thiserror::Error)]
#[error("cannot start a sandbox for chain {chain}{}: {failure}", in_sandbox(.sandbox))]
pub struct StartError {
    /// `namespace/name` of the HookChain the sandbox was for.
    pub chain: String,
    /// The sandbox's id (a local sandbox) or pod (kube), when it had one before it failed.
    pub sandbox: Option<String>,
    pub failure: StartFailure,
}

fn in_sandbox(sandbox: &Option<String>) -> String {
    sandbox
        .as_ref()
        .map(|s| format!(" (sandbox {s})"))
        .unwrap_or_default()
}

impl StartError {
    pub fn new(spec: &SandboxSpec, failure: impl Into<StartFailure>) -> Self {
        Self {
            chain: format!("{}/{}", spec.namespace, spec.chain),
            sandbox: None,
            failure: failure.into(),
        }
    }

    /// The same failure, of the sandbox `id`.
    pub fn of(mut self, id: impl Into<String>) -> Self {
        self.sandbox = Some(id.into());
        self
    }
}

/// What failed when a sandbox did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartFailure {
    /// The backend cannot start sandboxes here at all (no usable runsc, no supervisor binary): no
    /// chain's fault, and no retry will help until the machine changes.
    #[error("{0}")]
    Unavailable(String),
    /// The chain's `spec.resources` cannot be given to a sandbox as written.
    #[error("its resources: {0}")]
    Resources(String),
    /// The runtime failed or refused: runsc, the pod claim, the exec into the pod.
    #[error("{0}")]
    Runtime(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

#[async_trait]
pub trait SandboxBackend: Send + Sync + 'static {
    /// Starts one sandbox with the supervisor running in it. The caller waits for `ready`.
    async fn start(&self, spec: &SandboxSpec) -> Result<Sandbox, StartError>;
    /// Removes sandboxes left behind by an earlier process of this backend (after a crash).
    async fn clean_leftovers(&self) -> usize;
    /// Sandboxes of this backend that exist right now (for leak checks and metrics).
    async fn live(&self) -> Vec<String>;
    /// How many sandboxes the gateway keeps started and waiting per chain whose `pool.warm` is
    /// `chain_warm`. The local backend boots that many itself; the `kube` backend holds only as many
    /// pods claimed and attached as it was told to (`--kube-hold`), the operator keeping the rest.
    fn warm_target(&self, chain_warm: usize) -> usize {
        chain_warm
    }
    /// Whether a claimed sandbox that will come back (`reuse: Recycle`) counts toward the warm
    /// target. True where the target is what the gateway holds, serving or not (the `kube`
    /// backend's `--kube-hold`: pods kept claimed), so that one serving a trigger point is no
    /// reason to take another: that would be a claim PATCH and a pod for the operator to replace
    /// (some twenty API writes), and a pod held twice over. False where the target is what waits
    /// idle for the next claim (local sandboxes, booted by the gateway itself).
    fn claimed_count_toward_warm(&self) -> bool {
        false
    }
    /// Whether the gateway reports ready only once every chain has its warm target. True where the
    /// gateway boots them itself; the `kube` backend's held pods come from the operator's pools and
    /// only save latency.
    fn ready_needs_warm(&self) -> bool {
        true
    }
    /// Whether a sandbox whose cell ended clean may serve the chain's next trigger point
    /// (`pool.reuse: Recycle`). Where it cannot yet, every chain runs as `reuse: None`.
    fn recycles(&self) -> bool {
        true
    }
}
