//! A sandbox backend for tests: the real `sluice-supervisor`, run as a plain child process, speaking
//! the protocol on stdin/stderr exactly as in a runsc sandbox. No gVisor: hook code is walled in by
//! the supervisor's WebAssembly instances alone (no system calls, no files), which is what an
//! author's machine without gVisor gets too. It lets the engine's every policy path run in
//! milliseconds on any machine.

#![allow(clippy::new_without_default)]

use async_trait::async_trait;
use sluice_sandbox::{
    ProgramError, Sandbox, SandboxBackend, SandboxHandle, SandboxSpec, StartError, StartFailure,
    SupervisorProgram, discard_output,
};
use std::collections::BTreeSet;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::process::{Child, Command};

/// Starts supervisors as child processes of this one.
pub struct ProcessBackend {
    program: SupervisorProgram,
    seq: AtomicU64,
    live: Arc<Mutex<BTreeSet<String>>>,
}

impl ProcessBackend {
    /// With the supervisor and cell runtime beside this executable (see
    /// [`SupervisorProgram::locate`]).
    pub fn new() -> Result<Self, ProgramError> {
        Ok(Self::with_program(SupervisorProgram::locate()?))
    }

    pub fn with_program(program: SupervisorProgram) -> Self {
        Self {
            program,
            seq: AtomicU64::new(0),
            live: Arc::default(),
        }
    }
}

#[async_trait]
impl SandboxBackend for ProcessBackend {
    async fn start(&self, spec: &SandboxSpec) -> Result<Sandbox, StartError> {
        let id = format!("process-{}", self.seq.fetch_add(1, Ordering::Relaxed));
        let memory_bytes = sluice_crds::quantity::memory_bytes(&spec.memory)
            .map_err(|e| StartError::new(spec, StartFailure::Resources(e.to_string())))?;
        let args = self.program.args(
            &self.program.binary.to_string_lossy(),
            &self.program.runtime.to_string_lossy(),
            memory_bytes,
        );
        let mut child = Command::new(&args[0])
            .args(&args[1..])
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| StartError::new(spec, e).of(&id))?;
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            let failure = StartFailure::Runtime("the supervisor started without pipes".into());
            return Err(StartError::new(spec, failure).of(&id));
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
