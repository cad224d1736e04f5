//! The `local` backend: one gVisor (runsc) container per sandbox on this machine.
//!
//! Each sandbox gets an OCI bundle whose root filesystem is an empty, read-only skeleton; the only
//! things of the host in it are bind mounts (read-only) of the supervisor binary, the shared libraries
//! it links, and the cell runtime it loads (`sluice-cell.cwasm`). No Python of the host's: hooks run
//! in the supervisor's WebAssembly instances of a pre-initialised CPython. No network, a size-limited tmpfs `/tmp`, cgroup limits from
//! the chain's resources, no capabilities, uid 65534. All state lives under one directory per gateway
//! (`state_dir`): the runsc root, the bundles and the supervisor, so leftovers of a crashed gateway
//! are found and removed at the next start.
//!
//! One file: `LocalConfig` → `LocalBackend` (bundle, OCI spec, runsc run) → `LocalHandle` (teardown).

use async_trait::async_trait;
use serde_json::json;
use sluice_crds::cpu::SandboxCpuLimit;
use sluice_sandbox::{
    CpuThrottling, Sandbox, SandboxBackend, SandboxHandle, SandboxSpec, StartError, StartFailure,
    SupervisorProgram, discard_output,
};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;
use tokio::process::{Child, Command};
use tokio::sync::Mutex;

/// Where the supervisor binary and its cell runtime are inside every sandbox.
pub const SUPERVISOR_IN_SANDBOX: &str = "/sluice/sluice-supervisor";
pub const RUNTIME_IN_SANDBOX: &str = "/sluice/sluice-cell.cwasm";

const CGROUP_PARENT: &str = "sluice";
/// The host-side pids cgroup also holds gVisor's own threads (sentry and gofer, Go runtimes of a few
/// dozen threads each), so the chain's `pids` is granted on top of this allowance.
const RUNTIME_THREADS: u64 = 256;
/// Memory of the sandbox that is not a hook's (the same allowance a pod gets).
const RUNTIME_MEMORY: u64 = sluice_crds::sandbox_pod::RUNTIME_MEMORY_BYTES;
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

#[derive(Clone, Debug)]
pub struct LocalConfig {
    /// Directory owned by this gateway: runsc root, bundles, rootfs skeleton.
    pub state_dir: PathBuf,
    pub runsc: PathBuf,
    /// The supervisor and the cell runtime mounted into each sandbox; `None`: found beside this
    /// executable ([`SupervisorProgram::locate`]).
    pub program: Option<SupervisorProgram>,
    /// gVisor platform: `ptrace`, `systrap` (or `kvm` where the host allows), or `auto`: the faster
    /// of systrap and ptrace at making a cell, measured at start.
    pub platform: String,
    /// Size of each sandbox's `/tmp`.
    pub tmp_bytes: u64,
    /// The most CPU one sandbox may use (its CFS quota), unless its spec carries its own; a
    /// sandbox's `cpu` is its `cpu.shares` (sluice_crds::cpu).
    pub cpu_limit: SandboxCpuLimit,
    /// Start sandboxes the way a warm pod starts: the supervisor listens for one attach
    /// (`--listen`) instead of serving its stdin, and callers reach it with [`LocalBackend::exec`].
    /// For the fake API server, whose pods are local sandboxes, and the bench: feature `pods`.
    #[cfg(feature = "pods")]
    pub pod_shape: bool,
}

impl LocalConfig {
    pub fn new(state_dir: impl Into<PathBuf>) -> Self {
        Self {
            state_dir: state_dir.into(),
            runsc: PathBuf::from("runsc"),
            program: None,
            platform: "auto".into(),
            tmp_bytes: 16 << 20,
            cpu_limit: SandboxCpuLimit::default(),
            #[cfg(feature = "pods")]
            pod_shape: false,
        }
    }
}

pub struct LocalBackend {
    cfg: LocalConfig,
    runsc_root: PathBuf,
    bundles: PathBuf,
    rootfs: PathBuf,
    program: SupervisorProgram,
    mounts: Vec<serde_json::Value>,
    /// Container ids start with this, so leftovers of this state dir are recognisable.
    prefix: String,
    seq: AtomicU64,
}

fn runtime(msg: impl Into<String>) -> StartFailure {
    StartFailure::Runtime(msg.into())
}

fn unavailable(msg: impl Into<String>) -> StartFailure {
    StartFailure::Unavailable(msg.into())
}

fn resources(msg: impl Into<String>) -> StartFailure {
    StartFailure::Resources(msg.into())
}

impl LocalBackend {
    /// Prepares the state directory and the read-only root filesystem. Fails with a clear message
    /// when runsc, the supervisor or its cell runtime is missing.
    pub async fn new(cfg: LocalConfig) -> Result<Self, StartFailure> {
        let state_dir = std::path::absolute(&cfg.state_dir)?;
        let runsc_root = state_dir.join("runsc");
        let bundles = state_dir.join("bundles");
        let rootfs = state_dir.join("rootfs");
        for d in [&state_dir, &runsc_root, &bundles, &rootfs] {
            tokio::fs::create_dir_all(d).await?;
        }
        set_mode(&state_dir, 0o755)?;
        let version = Command::new(&cfg.runsc)
            .arg("--version")
            .output()
            .await
            .map_err(|e| {
                unavailable(format!(
                    "cannot run {:?} ({e}); install gVisor: apt-get install -y runsc",
                    cfg.runsc
                ))
            })?;
        if !version.status.success() {
            return Err(unavailable(format!("{:?} --version failed", cfg.runsc)));
        }
        let program = match cfg.program.clone() {
            Some(p) => p,
            None => SupervisorProgram::locate().map_err(|e| unavailable(e.to_string()))?,
        };
        for d in ["tmp", "proc", "dev", "sluice", "etc"] {
            tokio::fs::create_dir_all(rootfs.join(d)).await?;
        }
        set_mode(&rootfs, 0o755)?;
        let binary = tokio::fs::canonicalize(&program.binary)
            .await
            .map_err(|e| unavailable(format!("supervisor {:?} not found: {e}", program.binary)))?;
        let host_paths = shared_libraries(&binary).await?;
        let mut mounts = vec![
            json!({"destination": "/proc", "type": "proc", "source": "proc"}),
            json!({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
                   "options": ["nosuid", "nodev", "noexec", "mode=1777", format!("size={}", cfg.tmp_bytes)]}),
            json!({"destination": SUPERVISOR_IN_SANDBOX, "type": "bind",
                   "source": binary, "options": ["rbind", "ro"]}),
            json!({"destination": RUNTIME_IN_SANDBOX, "type": "bind",
                   "source": program.runtime, "options": ["rbind", "ro"]}),
        ];
        for p in host_paths {
            mounts.push(
                json!({"destination": p, "type": "bind", "source": p, "options": ["rbind", "ro"]}),
            );
        }
        let tag = short_hash(state_dir.to_string_lossy().as_bytes());
        let mut backend = Self {
            cfg,
            runsc_root,
            bundles,
            rootfs,
            program,
            mounts,
            prefix: format!("sluice-{tag}-{}", std::process::id()),
            seq: AtomicU64::new(0),
        };
        backend.choose_platform().await?;
        Ok(backend)
    }

    fn runsc(&self) -> Command {
        let mut c = Command::new(&self.cfg.runsc);
        c.arg("--root").arg(&self.runsc_root);
        c
    }

    /// `runsc run` of the bundle at `bundle` as container `id` on `platform`, with no network and
    /// none of the gateway's environment but `PATH`: the one way a sandbox is started.
    fn runsc_run(&self, platform: &str, bundle: &Path, id: &str) -> Command {
        let mut c = self.runsc();
        c.args([
            "--platform",
            platform,
            "--network",
            "none",
            "run",
            "--bundle",
        ])
        .arg(bundle)
        .arg(id)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default());
        c
    }

    /// The prefix shared by every container of this state directory, whichever process made it.
    fn dir_prefix(&self) -> &str {
        // "sluice-<tag>-<pid>": the part before the pid.
        &self.prefix[..self.prefix.rfind('-').unwrap_or(self.prefix.len())]
    }

    /// Proves that this runsc can make cells here, and picks the platform: each candidate boots one
    /// sandbox running `sluice-supervisor --probe` (a one-hook chain through a real cell); `auto` keeps
    /// the fastest that passes. A runsc that cannot make cells (bookworm's 20221219) fails here, at
    /// start, with the supervisor's reason.
    async fn choose_platform(&mut self) -> Result<(), StartFailure> {
        let candidates: Vec<String> = if self.cfg.platform == "auto" {
            vec!["systrap".into(), "ptrace".into()]
        } else {
            vec![self.cfg.platform.clone()]
        };
        let mut best: Option<(Duration, String)> = None;
        let mut failures = Vec::new();
        for platform in candidates {
            match self.probe(&platform).await {
                Ok(took) => {
                    tracing::info!(%platform, ms = took.as_millis() as u64, "runsc makes cells on this platform");
                    if best.as_ref().is_none_or(|(b, _)| took < *b) {
                        best = Some((took, platform));
                    }
                }
                Err(e) => failures.push(format!("{platform}: {e}")),
            }
        }
        match best {
            Some((_, platform)) => {
                tracing::info!(%platform, "sandbox platform");
                self.cfg.platform = platform;
                Ok(())
            }
            None => Err(unavailable(format!(
                "{:?} cannot run the sandboxes cells need ({}); install runsc from Debian \
                 bookworm-backports (0.0~20240729 or newer): `make deps`",
                self.cfg.runsc,
                failures.join("; ")
            ))),
        }
    }

    /// Boots one sandbox on `platform` that runs the supervisor's self-test; its time to pass.
    async fn probe(&self, platform: &str) -> Result<Duration, ProbeError> {
        let id = format!(
            "{}-probe-{}",
            self.prefix,
            self.seq.fetch_add(1, Ordering::Relaxed)
        );
        let bundle = self.bundles.join(&id);
        let spec = SandboxSpec {
            namespace: "sluice".into(),
            chain: "probe".into(),
            cpu: "1".into(),
            cpu_limit: None,
            memory: "256Mi".into(),
            pids: 64,
        };
        let mut config = self.oci_spec(&id, &spec)?;
        let mut args = self.supervisor_args(&spec)?;
        args.push("--probe".into());
        config["process"]["args"] = json!(args);
        tokio::fs::create_dir_all(&bundle)
            .await
            .map_err(ProbeError::Bundle)?;
        tokio::fs::write(bundle.join("config.json"), config.to_string())
            .await
            .map_err(ProbeError::Bundle)?;
        let began = std::time::Instant::now();
        let run = self
            .runsc_run(platform, &bundle, &id)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .output();
        let outcome = match tokio::time::timeout(PROBE_TIMEOUT, run).await {
            Ok(Ok(out)) if out.status.success() => Ok(began.elapsed()),
            Ok(Ok(out)) => Err(ProbeError::Failed(
                String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or("the probe failed without a message")
                    .trim()
                    .to_string(),
            )),
            Ok(Err(source)) => Err(ProbeError::Spawn {
                runsc: self.cfg.runsc.clone(),
                source,
            }),
            Err(_) => Err(ProbeError::Hung(PROBE_TIMEOUT)),
        };
        Self::force_delete(&self.cfg.runsc, &self.runsc_root, &id).await;
        let _ = tokio::fs::remove_dir_all(&bundle).await;
        for dir in leftover_cgroups_with_prefix(&id) {
            let _ = tokio::fs::remove_dir(dir).await;
        }
        outcome
    }

    /// The platform sandboxes run on (after `auto` was resolved).
    pub fn platform(&self) -> &str {
        &self.cfg.platform
    }

    /// The environment of every process in a sandbox.
    fn env() -> Vec<String> {
        ["PATH=/usr/bin:/bin", "LANG=C.UTF-8"]
            .map(String::from)
            .to_vec()
    }

    /// A process of the sandbox user: no capabilities, no new privileges, few files, no core dumps.
    fn process(args: Vec<serde_json::Value>, env: Vec<String>) -> serde_json::Value {
        json!({
            "terminal": false,
            "user": {"uid": 65534, "gid": 65534},
            "args": args,
            "env": env,
            "cwd": "/tmp",
            "capabilities": {"bounding": [], "effective": [], "permitted": [], "inheritable": [], "ambient": []},
            "noNewPrivileges": true,
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 256, "soft": 256},
                        {"type": "RLIMIT_CORE", "hard": 0, "soft": 0}]
        })
    }

    fn oci_spec(&self, id: &str, spec: &SandboxSpec) -> Result<serde_json::Value, StartFailure> {
        let cpu = self.cpu(spec)?;
        let memory_bytes = sluice_crds::quantity::memory_bytes(&spec.memory)
            .map_err(|e| resources(e.to_string()))?;
        #[cfg_attr(not(feature = "pods"), allow(unused_mut))]
        let mut args = self.supervisor_args(spec)?;
        #[cfg(feature = "pods")]
        if self.cfg.pod_shape {
            args.push("--listen".into());
        }
        Ok(json!({
            "ociVersion": "1.0.2",
            "process": Self::process(args.into_iter().map(serde_json::Value::String).collect(), Self::env()),
            "root": {"path": self.rootfs, "readonly": true},
            "hostname": "sandbox",
            "mounts": self.mounts,
            "linux": {
                "namespaces": [{"type": "pid"}, {"type": "network"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}],
                "cgroupsPath": format!("/{CGROUP_PARENT}/{id}"),
                "resources": {
                    "memory": {"limit": memory_bytes + RUNTIME_MEMORY},
                    "pids": {"limit": spec.pids as u64 + RUNTIME_THREADS},
                    "cpu": cpu
                }
            }
        }))
    }

    /// The OCI `linux.resources.cpu` of a sandbox for `spec`, the same model as a pod's: the chain's
    /// cpu as `cpu.shares` (1024 a core, as the kubelet converts a request), the limit as a CFS
    /// quota per 100 ms period, none without one.
    fn cpu(&self, spec: &SandboxSpec) -> Result<serde_json::Value, StartFailure> {
        let millis =
            |q: &str| sluice_crds::quantity::cpu_millis(q).map_err(|e| resources(e.to_string()));
        let shares = (millis(&spec.cpu)? * 1024 / 1000).max(2);
        let limit = match &spec.cpu_limit {
            Some(q) => SandboxCpuLimit(Some(millis(q)?)),
            None => self.cfg.cpu_limit,
        };
        let period = sluice_crds::cpu::CFS_PERIOD.as_micros() as u64;
        Ok(match limit.quota() {
            // runsc's floor for a quota is 1 ms.
            Some(quota) => {
                json!({"shares": shares, "quota": (quota.as_micros() as u64).max(1000), "period": period})
            }
            None => json!({"shares": shares}),
        })
    }

    /// The supervisor's command line in a sandbox for `spec`. Settings are flags, never the
    /// environment.
    fn supervisor_args(&self, spec: &SandboxSpec) -> Result<Vec<String>, StartFailure> {
        let memory_bytes = sluice_crds::quantity::memory_bytes(&spec.memory)
            .map_err(|e| resources(e.to_string()))?;
        Ok(self
            .program
            .args(SUPERVISOR_IN_SANDBOX, RUNTIME_IN_SANDBOX, memory_bytes))
    }

    /// Starts `args` as another process of sandbox `id` (`runsc exec`, the sandbox user, the
    /// sandbox's environment), stdio piped: what a kubelet does for a pod's exec and exec probes.
    /// The supervisor is at [`SUPERVISOR_IN_SANDBOX`]. Feature `pods`.
    #[cfg(feature = "pods")]
    pub async fn exec(
        &self,
        id: &str,
        args: &[String],
    ) -> Result<tokio::process::Child, StartFailure> {
        // In the sandbox's bundle, which goes with the sandbox.
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        let file = self.bundles.join(id).join(format!("exec-{n}.json"));
        let process = Self::process(args.iter().map(|a| json!(a)).collect(), Self::env());
        tokio::fs::write(&file, process.to_string()).await?;
        self.runsc()
            .args(["--platform", &self.cfg.platform, "exec", "--process"])
            .arg(&file)
            .arg(id)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| runtime(format!("cannot start {:?} exec: {e}", self.cfg.runsc)))
    }

    async fn force_delete(runsc: &Path, root: &Path, id: &str) {
        match runsc_delete(runsc, root, id).await {
            Ok(true) => return,
            Ok(false) => {}
            Err(e) => tracing::warn!(sandbox = id, error = %e, "runsc delete failed"),
        }
        // A wedged sandbox (a fork bomb, say) can outlast `runsc delete`: kill its processes
        // directly, then let runsc forget it.
        let killed = kill_processes_of(id);
        if killed > 0 {
            tracing::warn!(
                sandbox = id,
                killed,
                "killed the processes of a sandbox runsc could not delete"
            );
            let _ = runsc_delete(runsc, root, id).await;
        }
    }
}

/// Why the platform probe failed on one platform (its sandbox did not run the self-test).
#[derive(Debug, thiserror::Error)]
enum ProbeError {
    #[error(transparent)]
    Setup(#[from] StartFailure),
    #[error("cannot write its bundle: {0}")]
    Bundle(std::io::Error),
    /// The last line the probe's sandbox printed.
    #[error("{0}")]
    Failed(String),
    #[error("cannot start {runsc:?}: {source}")]
    Spawn {
        runsc: PathBuf,
        source: std::io::Error,
    },
    #[error("the probe hung for {} s", .0.as_secs())]
    Hung(Duration),
}

/// A runsc command that did not finish.
#[derive(Debug, thiserror::Error)]
enum RunscCommandError {
    #[error("cannot run it: {0}")]
    Spawn(#[from] std::io::Error),
    #[error("hung for {} s and was killed", .0.as_secs())]
    Hung(Duration),
}

/// `runsc delete --force ID`, bounded in time: Ok(true) when runsc reports success.
async fn runsc_delete(runsc: &Path, root: &Path, id: &str) -> Result<bool, RunscCommandError> {
    let status = Command::new(runsc)
        .arg("--root")
        .arg(root)
        .args(["delete", "--force", id])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .status();
    match tokio::time::timeout(RUNSC_COMMAND, status).await {
        Ok(Ok(s)) => Ok(s.success()),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => Err(RunscCommandError::Hung(RUNSC_COMMAND)),
    }
}

/// SIGKILLs every host process whose command line names sandbox `id` (its runsc, sandbox and gofer
/// processes). Returns how many it signalled.
fn kill_processes_of(id: &str) -> usize {
    let mut killed = 0;
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let suffix = format!("/{id}");
        if cmdline
            .split(|b| *b == 0)
            .any(|arg| arg == id.as_bytes() || arg.ends_with(suffix.as_bytes()))
        {
            // SAFETY: plain kill(2) on a pid read from /proc; at worst the pid is already gone.
            // The one unsafe call of the workspace: std has no way to signal a process it did not
            // spawn.
            #[allow(unsafe_code)]
            let sent = unsafe { libc::kill(pid, libc::SIGKILL) } == 0;
            if sent {
                killed += 1;
            }
        }
    }
    killed
}

fn set_mode(path: &Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

/// The cgroup directories, in every hierarchy, of sandboxes whose id starts with `prefix`.
fn leftover_cgroups_with_prefix(prefix: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for hierarchy in std::fs::read_dir(CGROUP_ROOT)
        .into_iter()
        .flatten()
        .flatten()
    {
        let parent = hierarchy.path().join(CGROUP_PARENT);
        for e in std::fs::read_dir(&parent).into_iter().flatten().flatten() {
            if e.file_name().to_string_lossy().starts_with(prefix) && e.path().is_dir() {
                out.push(e.path());
            }
        }
    }
    out
}

/// The cgroups, in any hierarchy, left by sandboxes of a backend whose state directory is
/// `state_dir` (for leak checks).
pub fn leftover_cgroups(state_dir: &Path) -> Vec<PathBuf> {
    let Ok(dir) = std::path::absolute(state_dir) else {
        return Vec::new();
    };
    let tag = short_hash(dir.to_string_lossy().as_bytes());
    leftover_cgroups_with_prefix(&format!("sluice-{tag}-"))
}

fn short_hash(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(&sha2::Sha256::digest(bytes)[..4])
}

/// The shared libraries `binary` loads (with the dynamic loader), as host paths.
async fn shared_libraries(binary: &Path) -> Result<BTreeSet<String>, StartFailure> {
    let ldd = Command::new("ldd")
        .arg(binary)
        .output()
        .await
        .map_err(|e| runtime(format!("cannot run ldd: {e}")))?;
    let mut paths = BTreeSet::new();
    for line in String::from_utf8_lossy(&ldd.stdout).lines() {
        // "\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or "\t/lib64/ld-linux-x86-64.so.2 (0x...)"
        let target = line.split("=>").nth(1).unwrap_or(line).trim();
        if let Some(path) = target
            .split_whitespace()
            .next()
            .filter(|p| p.starts_with('/'))
        {
            paths.insert(path.to_string());
        }
    }
    paths.retain(|p| Path::new(p).exists());
    Ok(paths)
}

impl LocalBackend {
    /// Starts sandbox `id` for `spec`.
    async fn start_as(&self, id: &str, spec: &SandboxSpec) -> Result<Sandbox, StartFailure> {
        let id = id.to_string();
        let bundle = self.bundles.join(&id);
        tokio::fs::create_dir_all(&bundle).await?;
        let config =
            serde_json::to_vec(&self.oci_spec(&id, spec)?).map_err(|e| runtime(e.to_string()))?;
        tokio::fs::write(bundle.join("config.json"), config).await?;
        let spawned = self
            .runsc_run(&self.cfg.platform, &bundle, &id)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                let _ = tokio::fs::remove_dir_all(&bundle).await;
                return Err(runtime(format!("cannot start {:?}: {e}", self.cfg.runsc)));
            }
        };
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            return Err(runtime("runsc started without pipes"));
        };
        let stdout_bytes = Arc::new(AtomicU64::new(0));
        let counter = stdout_bytes.clone();
        // Hooks' prints land here: read and dropped, so a chatty hook cannot bloat us. Past the
        // bound nothing more is read: the writer blocks until the deadline ends it, and the
        // failure names the output limit.
        tokio::spawn(async move {
            discard_output(stdout, counter).await;
        });
        let handle = LocalHandle {
            id: id.clone(),
            runsc: self.cfg.runsc.clone(),
            root: self.runsc_root.clone(),
            bundle,
            child: Mutex::new(Some(child)),
            destroyed: AtomicBool::new(false),
            stdout_bytes,
        };
        Ok(Sandbox {
            id: id.clone(),
            stdin: Box::pin(stdin),
            protocol: Box::pin(stderr),
            handle: Box::new(handle),
        })
    }
}

#[async_trait]
impl SandboxBackend for LocalBackend {
    async fn start(&self, spec: &SandboxSpec) -> Result<Sandbox, StartError> {
        // Fixed width: runsc resolves an id by prefix, so "…-1" would be ambiguous beside "…-10".
        let id = format!(
            "{}-{:012}",
            self.prefix,
            self.seq.fetch_add(1, Ordering::Relaxed)
        );
        self.start_as(&id, spec)
            .await
            .map_err(|failure| StartError::new(spec, failure).of(id))
    }

    async fn clean_leftovers(&self) -> usize {
        let leftovers: Vec<String> = self.live().await;
        for id in &leftovers {
            tracing::info!(sandbox = %id, "removing sandbox left by an earlier gateway");
            Self::force_delete(&self.cfg.runsc, &self.runsc_root, id).await;
        }
        // Bundles and cgroups whose container is gone.
        if let Ok(mut rd) = tokio::fs::read_dir(&self.bundles).await {
            while let Ok(Some(e)) = rd.next_entry().await {
                let _ = tokio::fs::remove_dir_all(e.path()).await;
            }
        }
        for dir in leftover_cgroups_with_prefix(self.dir_prefix()) {
            let _ = tokio::fs::remove_dir(dir).await;
        }
        leftovers.len()
    }

    async fn live(&self) -> Vec<String> {
        let list = self
            .runsc()
            .arg("list")
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output();
        let Ok(Ok(out)) = tokio::time::timeout(RUNSC_COMMAND, list).await else {
            return Vec::new();
        };
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .skip(1)
            .filter_map(|l| l.split_whitespace().next())
            .filter(|id| id.starts_with(self.dir_prefix()))
            .map(str::to_string)
            .collect()
    }
}

impl LocalBackend {
    /// `clean_leftovers` for where no runtime can be awaited (a `Drop` during a panic): every
    /// sandbox of this state directory is force-deleted (its processes killed if runsc cannot),
    /// with its bundle and cgroups. Blocks, at most `RUNSC_COMMAND` per runsc command.
    pub fn clean_leftovers_blocking(&self) -> usize {
        let run = |args: &[&str]| {
            let mut c = std::process::Command::new(&self.cfg.runsc);
            c.arg("--root")
                .arg(&self.runsc_root)
                .args(args)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::null());
            let mut child = c.spawn().ok()?;
            let until = std::time::Instant::now() + RUNSC_COMMAND;
            loop {
                match child.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if std::time::Instant::now() < until => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    _ => {
                        let _ = child.kill();
                        let _ = child.wait();
                        return None;
                    }
                }
            }
            let mut out = String::new();
            use std::io::Read;
            child.stdout.take()?.read_to_string(&mut out).ok()?;
            Some(out)
        };
        let ids: Vec<String> = run(&["list"])
            .unwrap_or_default()
            .lines()
            .skip(1)
            .filter_map(|l| l.split_whitespace().next())
            .filter(|id| id.starts_with(self.dir_prefix()))
            .map(str::to_string)
            .collect();
        for id in &ids {
            let _ = run(&["delete", "--force", id]);
            // What runsc could not stop (a wedged sandbox), and the `runsc run` and `runsc exec`
            // processes that served it.
            if kill_processes_of(id) > 0 {
                let _ = run(&["delete", "--force", id]);
            }
        }
        for e in std::fs::read_dir(&self.bundles)
            .into_iter()
            .flatten()
            .flatten()
        {
            let _ = std::fs::remove_dir_all(e.path());
        }
        for dir in leftover_cgroups_with_prefix(self.dir_prefix()) {
            let _ = std::fs::remove_dir(dir);
        }
        ids.len()
    }

    /// The supervisor and cell runtime the sandboxes run.
    pub fn program(&self) -> &SupervisorProgram {
        &self.program
    }
}

struct LocalHandle {
    id: String,
    runsc: PathBuf,
    root: PathBuf,
    bundle: PathBuf,
    child: Mutex<Option<Child>>,
    destroyed: AtomicBool,
    stdout_bytes: Arc<AtomicU64>,
}

/// Longest a runsc management command (delete, list) may take before it is killed.
const RUNSC_COMMAND: Duration = Duration::from_secs(10);
/// Longest the platform probe's sandbox may take to boot and pass its self-test.
const PROBE_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a sandbox whose stdin was closed gets to exit on its own before it is force-deleted.
const GRACE: Duration = Duration::from_secs(2);

#[async_trait]
impl SandboxHandle for LocalHandle {
    async fn destroy(&self, force: bool) {
        if self.destroyed.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Some(mut c) = self.child.lock().await.take() {
            // A healthy supervisor whose stdin was closed exits by itself and `runsc run` cleans up
            // after it, which is cheaper than a `runsc delete`; anything else is killed.
            // `runsc run` exiting with success means it deleted the container itself; any other end
            // (killed, failed teardown) may leave a stopped container behind.
            let clean = !force
                && matches!(tokio::time::timeout(GRACE, c.wait()).await, Ok(Ok(status)) if status.success());
            if !clean {
                LocalBackend::force_delete(&self.runsc, &self.root, &self.id).await;
                if tokio::time::timeout(GRACE, c.wait()).await.is_err() {
                    let _ = c.kill().await;
                }
            }
        }
        if self.state_file_exists().await {
            LocalBackend::force_delete(&self.runsc, &self.root, &self.id).await;
        }
        let _ = tokio::fs::remove_dir_all(&self.bundle).await;
        // runsc removes the cgroups it limits (memory, pids, cpu) but leaves its empty directory in
        // every other hierarchy (blkio, cpuset, devices, freezer, systemd, ...).
        for dir in leftover_cgroups_with_prefix(&self.id) {
            let _ = tokio::fs::remove_dir(dir).await;
        }
    }

    fn stdout_bytes(&self) -> u64 {
        self.stdout_bytes.load(Ordering::Relaxed)
    }

    fn cpu_throttling(&self) -> Option<CpuThrottling> {
        // cgroup v1 mounts the cpu controller as `cpu` (or `cpu,cpuacct`); v2 has one hierarchy.
        ["cpu", "cpu,cpuacct", ""].iter().find_map(|hierarchy| {
            let path = Path::new(CGROUP_ROOT)
                .join(hierarchy)
                .join(CGROUP_PARENT)
                .join(&self.id)
                .join("cpu.stat");
            CpuThrottling::from_cpu_stat(&std::fs::read_to_string(path).ok()?)
        })
    }
}

impl LocalHandle {
    async fn state_file_exists(&self) -> bool {
        let Ok(mut rd) = tokio::fs::read_dir(&self.root).await else {
            return false;
        };
        while let Ok(Some(e)) = rd.next_entry().await {
            if e.file_name().to_string_lossy().contains(&self.id) {
                return true;
            }
        }
        false
    }
}
