//! A sandbox backend for tests: the real `supervisor/supervisor.py`, run by the host's `python3` as a
//! plain child process, speaking the protocol on stdin/stderr exactly as in a runsc sandbox. No
//! gVisor: the supervisor is pid 1 of a pid namespace of its own (`unshare`, in a user namespace, so
//! no root is needed where user namespaces are allowed), which its cells nest in and which dies with
//! it, so killing a "sandbox" leaves no hook process behind. It lets the engine's every policy path
//! run in milliseconds on any machine that allows user namespaces.

#![allow(clippy::new_without_default)]

use async_trait::async_trait;
use sluice_engine::{
    SUPERVISOR_PY, Sandbox, SandboxBackend, SandboxHandle, SandboxSpec, StartError, discard_output,
};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::process::{Child, Command};

/// Starts supervisors as child processes of this one.
pub struct ProcessBackend {
    /// Holds `supervisor.py`; removed with the backend.
    dir: tempfile::TempDir,
    seq: AtomicU64,
    live: Arc<Mutex<BTreeSet<String>>>,
}

impl ProcessBackend {
    pub fn new() -> std::io::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("sluice-process-backend-")
            .tempdir()?;
        std::fs::write(dir.path().join("supervisor.py"), SUPERVISOR_PY)?;
        Ok(Self {
            dir,
            seq: AtomicU64::new(0),
            live: Arc::default(),
        })
    }

    fn supervisor(&self) -> PathBuf {
        self.dir.path().join("supervisor.py")
    }
}

#[async_trait]
impl SandboxBackend for ProcessBackend {
    async fn start(&self, spec: &SandboxSpec) -> Result<Sandbox, StartError> {
        let id = format!("process-{}", self.seq.fetch_add(1, Ordering::Relaxed));
        let memory_bytes = sluice_crds::quantity::memory_bytes(&spec.memory)
            .map_err(|e| StartError::Runtime(e.to_string()))?;
        let mut child = Command::new("unshare")
            .args([
                "--user",
                "--map-root-user",
                "--pid",
                "--fork",
                "--kill-child",
                "--mount-proc",
            ])
            .args(["python3", "-I", "-S", "-u"])
            .arg(self.supervisor())
            .arg("--memory-bytes")
            .arg(memory_bytes.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            return Err(StartError::Runtime("python3 started without pipes".into()));
        };
        // Hooks' prints land here: read and dropped, up to the same bound the local backend keeps.
        let stdout_bytes = Arc::new(AtomicU64::new(0));
        let counter = stdout_bytes.clone();
        tokio::spawn(async move {
            discard_output(stdout, counter).await;
        });
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.clone());
        Ok(Sandbox {
            id: id.clone(),
            stdin: Box::pin(stdin),
            protocol: Box::pin(stderr),
            stdout: None,
            handle: Box::new(ProcessHandle {
                id,
                child: tokio::sync::Mutex::new(Some(child)),
                stdout_bytes,
                live: self.live.clone(),
            }),
        })
    }

    async fn clean_leftovers(&self) -> usize {
        0
    }

    async fn live(&self) -> Vec<String> {
        let live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        live.iter().cloned().collect()
    }
}

struct ProcessHandle {
    id: String,
    child: tokio::sync::Mutex<Option<Child>>,
    stdout_bytes: Arc<AtomicU64>,
    live: Arc<Mutex<BTreeSet<String>>>,
}

#[async_trait]
impl SandboxHandle for ProcessHandle {
    async fn destroy(&self, force: bool) {
        let Some(mut child) = self.child.lock().await.take() else {
            return;
        };
        if !force {
            let exited =
                tokio::time::timeout(std::time::Duration::from_millis(500), child.wait()).await;
            if exited.is_err() {
                let _ = child.kill().await;
            }
        } else {
            let _ = child.kill().await;
        }
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
    }

    fn stdout_bytes(&self) -> u64 {
        self.stdout_bytes.load(Ordering::Relaxed)
    }
}
