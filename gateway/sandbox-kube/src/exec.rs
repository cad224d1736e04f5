//! Reaching the supervisor in a claimed pod through the exec API (websocket, `v5.channel.k8s.io`
//! with a fallback to v4, `tty=false`). The exec runs the attach relay, which hands the exec's own
//! pipes to the pod's waiting supervisor: requests go to stdin, the protocol comes back on stderr,
//! and stdout (empty unless something goes wrong) is drained and discarded here with a bound.

use crate::labels;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, AttachParams, AttachedProcess};
use sluice_engine::discard_output;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use tokio::io::AsyncWriteExt;

/// Buffers between the websocket and the supervisor conversation: large enough that a protocol line
/// of a big payload does not crawl through the default 1 KiB pipe.
const BUFFER: usize = 256 << 10;

pub(crate) struct Exec {
    pub process: AttachedProcess,
    pub stdin: tokio::io::WriteHalf<tokio::io::SimplexStream>,
    pub stderr: tokio::io::ReadHalf<tokio::io::SimplexStream>,
    pub stdout_bytes: Arc<AtomicU64>,
    /// Set by the owner before it drops the exec on purpose, so an exit without a status is expected.
    pub closing: Arc<AtomicBool>,
}

/// Attaches to the supervisor waiting in `pod` and starts draining stdout.
pub(crate) async fn start(api: &Api<Pod>, pod: &str) -> Result<Exec, String> {
    let params = AttachParams::default()
        .container(labels::CONTAINER)
        .stdin(true)
        .stdout(true)
        .stderr(true)
        .tty(false)
        .max_stdin_buf_size(BUFFER)
        .max_stdout_buf_size(BUFFER)
        .max_stderr_buf_size(BUFFER);
    let mut process = api
        .exec(pod, labels::attach_command(), &params)
        .await
        .map_err(|e| e.to_string())?;
    let (Some(stdin), Some(stdout), Some(mut stderr), Some(status)) = (
        process.stdin(),
        process.stdout(),
        process.stderr(),
        process.take_status(),
    ) else {
        // AttachParams asked for all three, so kube always hands them out once.
        unreachable!("exec streams requested but not provided");
    };
    let stdout_bytes = Arc::new(AtomicU64::new(0));
    let counter = stdout_bytes.clone();
    // Read and dropped. Past the bound nothing more is read, so the exec stream stalls and the hook
    // that keeps printing meets its deadline, exactly as in local mode.
    let drain = tokio::spawn(async move {
        discard_output(stdout, counter).await;
    });
    // kube ends its output streams only when the exec ends cleanly; when the connection breaks
    // (pod gone, API server restarted) they would stay open forever. The protocol is therefore read
    // through a pipe of our own that is ended as soon as the exec is over, however it ended, so the
    // supervisor conversation sees the sandbox die at once instead of at its deadline.
    let (protocol, mut pipe) = tokio::io::simplex(BUFFER);
    let key = format!("{}/{pod}", api.namespace().unwrap_or_default());
    let closing = Arc::new(AtomicBool::new(false));
    let closed_by_us = closing.clone();
    tokio::spawn(async move {
        let ended = {
            let copy = tokio::io::copy(&mut stderr, &mut pipe);
            tokio::pin!(copy);
            tokio::select! {
                _ = &mut copy => None,
                status = status => {
                    // Over: what it sent is buffered already; take that, then end.
                    let _ = tokio::time::timeout(EXIT_DRAIN, &mut copy).await;
                    Some(status)
                }
            }
        };
        let _ = pipe.shutdown().await;
        drain.abort();
        match ended {
            Some(Some(s)) if s.status.as_deref() != Some("Success") => {
                tracing::warn!(pod = %key, message = ?s.message, reason = ?s.reason, "supervisor exited with an error")
            }
            Some(None) if !closed_by_us.load(Ordering::SeqCst) => {
                tracing::warn!(pod = %key, "the exec connection ended without an exit status")
            }
            _ => {}
        }
    });
    Ok(Exec {
        process,
        stdin,
        stderr: protocol,
        stdout_bytes,
        closing,
    })
}

/// How long the protocol already received may take to be handed on once the exec has ended.
const EXIT_DRAIN: std::time::Duration = std::time::Duration::from_millis(200);
