//! The audit: one structured JSON line per run, failures included. NOT_FOUND requests (a caller
//! asking for chains that do not exist) are sampled: at most one line per 10 s, saying how many it
//! stands for (`Engine::refuse`).

use serde::Serialize;
use serde_json::Value;
use std::io::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

#[derive(Debug, Serialize)]
pub struct AuditHook {
    pub name: String,
    pub action: &'static str,
    pub latency_us: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub findings: Option<Value>,
    /// Who signed the code that answered, where the platform requires signed code: the
    /// `allowed_signers` principal and the key's fingerprint.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signed_by: Option<String>,
}

/// One host_call as the capability runner saw it.
#[derive(Clone, Debug, Serialize)]
pub struct AuditHostCall {
    pub hook: String,
    pub capability: String,
    pub gates: Vec<AuditGate>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub consumed: Option<Value>,
    pub latency_us: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// How many host_calls of a run ended one way, for one capability.
#[derive(Clone, Debug, Serialize)]
pub struct AuditHostCallCount {
    pub capability: String,
    /// `ok`, `failed` (refused or failed by the capabilities) or `over_limit` (refused by the
    /// gateway: the run's count, time or bytes were spent).
    pub result: &'static str,
    pub count: u64,
}

/// All of a run's host_calls when more were made than the audit lists one by one.
#[derive(Clone, Debug, Serialize)]
pub struct AuditHostCallSummary {
    pub total: u64,
    pub listed: usize,
    pub by: Vec<AuditHostCallCount>,
}

#[derive(Clone, Debug, Serialize)]
pub struct AuditGate {
    pub gate: String,
    pub allow: bool,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub reason: String,
}

/// The enforced baseline chain that ran before the tenant's chain.
#[derive(Clone, Debug, Serialize)]
pub struct AuditChain {
    pub chain: String,
    pub code_hash: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct AuditEvent {
    pub ts: String,
    pub run_id: String,
    pub mode: &'static str,
    /// The verified caller (its name in the caller policy), when the gateway has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub caller: Option<String>,
    pub namespace: String,
    pub target: String,
    pub trigger_point: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chain: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub code_hash: Option<String>,
    /// Set when the chain that served is the last valid version, not the newest (which fails its
    /// checks): why the newest is not served.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub superseded: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    /// The proxy the run came through (OpenAI-compatible, MCP) and its method; absent for the
    /// gRPC API.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub via: Option<crate::Via>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<String>,
    /// The platform baseline, when one ran first (its hooks are listed first, as `baseline/<hook>`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline: Option<AuditChain>,
    pub hooks: Vec<AuditHook>,
    /// The run's first host_calls (`Limits::audit_host_calls`), in order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub host_calls: Vec<AuditHostCall>,
    /// Counts of all of them, when some are not listed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_call_summary: Option<AuditHostCallSummary>,
    pub action: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub terminal_index: Option<usize>,
    pub latency_us: u64,
    /// The block or skip message the caller got (for a failure under `Closed`: the failure).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// What the failure policy did with hook errors: `blocked` (a failure ended the run under
    /// `Closed`, or the sandbox could not be trusted) or `passed_over` (`Open` went on without it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy_outcome: Option<&'static str>,
    /// The failure behind `policy_outcome`: the one that ended the run, or the first passed over.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failure_reason: Option<String>,
    /// On a sampled NOT_FOUND event: how many NOT_FOUND requests since the previous written one had
    /// no event of their own (`sluice_gateway_requests_total` counts them all).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_found_unwritten: Option<u64>,
    /// Why the run did not produce a verdict (unknown chain, no sandbox, client went away...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream: Option<Value>,
    /// When a chain of the run is being rolled out: which version answered, and what became of
    /// the shadow run (`docs/rollout.md`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rollout: Vec<AuditRollout>,
    /// On a shadow run's own event (mode `shadow`, the live run's `run_id`): how it compared with
    /// the live answer (agreed, action_differs, output_differs, error).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shadow_verdict: Option<&'static str>,
}

/// One chain of a run that is being rolled out.
#[derive(Clone, Debug, Serialize)]
pub struct AuditRollout {
    pub chain: String,
    /// Shadow or Canary.
    pub strategy: &'static str,
    /// `live` or `candidate`: which version answered.
    pub answered_by: &'static str,
    /// The revision that answered.
    pub revision: String,
    /// Shadow only: the candidate's revision and whether its run was made (`started`) or not
    /// (`dropped`); its verdict is in the shadow run's own event.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shadow_revision: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shadow: Option<&'static str>,
}

impl AuditEvent {
    /// The event of one run (`mode` "run" or "stream"), before anything is known of it but its id.
    /// Whatever happens next fills it in; exactly one is written per run.
    pub fn new(run_id: &str, mode: &'static str) -> Self {
        Self {
            ts: now_rfc3339(),
            run_id: run_id.to_string(),
            mode,
            caller: None,
            namespace: String::new(),
            target: String::new(),
            trigger_point: String::new(),
            chain: None,
            code_hash: None,
            superseded: None,
            session_id: None,
            via: None,
            sandbox: None,
            baseline: None,
            hooks: vec![],
            host_calls: vec![],
            host_call_summary: None,
            action: "none",
            terminal_index: None,
            latency_us: 0,
            message: None,
            policy_outcome: None,
            failure_reason: None,
            not_found_unwritten: None,
            error: None,
            stream: None,
            rollout: Vec::new(),
            shadow_verdict: None,
        }
    }

    /// Records what the caller asked for, as it asked (before any of it is checked).
    pub fn requested(
        &mut self,
        namespace: &str,
        target: &str,
        trigger_point: &str,
        session_id: &str,
    ) {
        self.namespace = namespace.to_string();
        self.target = target.to_string();
        self.trigger_point = trigger_point.to_string();
        self.session_id = (!session_id.is_empty()).then(|| session_id.to_string());
    }
}

/// Where audit lines go. Lines are whole: concurrent runs never interleave.
///
/// A file (or any sink given to `new`) is written in place. Standard output is a pipe that the
/// node's log collector reads (containerd, the kubelet): when it stops reading, a write in place
/// would block the run that makes it, then every run. So `to_stdout` writes from a thread of its
/// own through a queue: while more than `QUEUE_ADMITS` lines wait, new runs are refused
/// (`backlog`), so that a run's line is never dropped (runs already admitted finish and queue
/// theirs); past `QUEUE_HOLDS`, refusals' lines are dropped and counted.
#[derive(Clone)]
pub struct Audit {
    sink: Sink,
}

#[derive(Clone)]
enum Sink {
    Direct(Arc<Mutex<Box<dyn Write + Send>>>),
    Queued(Arc<Queue>),
}

/// Lines waiting past which new runs are refused.
const QUEUE_ADMITS: usize = 1024;
/// Lines waiting past which a line is dropped (and counted): runs admitted below `QUEUE_ADMITS`
/// finish within this margin, whatever the concurrency.
const QUEUE_HOLDS: usize = 64 * 1024;

struct Queue {
    tx: std::sync::mpsc::Sender<Vec<u8>>,
    waiting: Arc<AtomicUsize>,
    dropped: AtomicU64,
    admits: usize,
    holds: usize,
}

impl Audit {
    pub fn new(sink: Box<dyn Write + Send>) -> Self {
        Self {
            sink: Sink::Direct(Arc::new(Mutex::new(sink))),
        }
    }

    /// Lines to standard output, through a writer thread (see `Audit`).
    pub fn to_stdout() -> Self {
        Self::queued(Box::new(std::io::stdout()), QUEUE_ADMITS, QUEUE_HOLDS)
    }

    /// Lines to `sink` from a thread of its own, refusing runs past `admits` lines waiting and
    /// dropping lines past `holds`.
    pub fn queued(mut sink: Box<dyn Write + Send>, admits: usize, holds: usize) -> Self {
        let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
        let waiting = Arc::new(AtomicUsize::new(0));
        let left = waiting.clone();
        let spawned = std::thread::Builder::new()
            .name("sluice-audit".into())
            .spawn(move || {
                while let Ok(line) = rx.recv() {
                    let mut result = sink.write_all(&line);
                    left.fetch_sub(1, Ordering::Relaxed);
                    // A burst is flushed once, when the queue is empty.
                    while let Ok(line) = rx.try_recv() {
                        result = result.and_then(|_| sink.write_all(&line));
                        left.fetch_sub(1, Ordering::Relaxed);
                    }
                    if let Err(e) = result.and_then(|_| sink.flush()) {
                        tracing::error!(error = %e, "audit write failed");
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "no thread for the audit writer: audit lines are written in place");
        }
        Self {
            sink: Sink::Queued(Arc::new(Queue {
                tx,
                waiting,
                dropped: AtomicU64::new(0),
                admits,
                holds,
            })),
        }
    }

    pub fn discard() -> Self {
        Self::new(Box::new(std::io::sink()))
    }

    pub fn to_file(path: &std::path::Path) -> std::io::Result<Self> {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(Self::new(Box::new(f)))
    }

    /// Lines waiting to be written, when more wait than a new run may be admitted beside.
    pub fn backlog(&self) -> Option<usize> {
        match &self.sink {
            Sink::Direct(_) => None,
            Sink::Queued(q) => {
                let waiting = q.waiting.load(Ordering::Relaxed);
                (waiting >= q.admits).then_some(waiting)
            }
        }
    }

    /// Waits (at most `within`) until every queued line is written: a gateway that exits with
    /// lines in its queue would lose them. Whether it was.
    pub fn drain(&self, within: std::time::Duration) -> bool {
        let Sink::Queued(q) = &self.sink else {
            return true;
        };
        let until = std::time::Instant::now() + within;
        while q.waiting.load(Ordering::Relaxed) > 0 {
            if std::time::Instant::now() >= until {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        true
    }

    /// Lines dropped because too many waited.
    pub fn dropped(&self) -> u64 {
        match &self.sink {
            Sink::Direct(_) => 0,
            Sink::Queued(q) => q.dropped.load(Ordering::Relaxed),
        }
    }

    pub fn write(&self, event: &AuditEvent) {
        let mut line = match serde_json::to_vec(event) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, run_id = %event.run_id, "audit event did not serialize");
                return;
            }
        };
        line.push(b'\n');
        match &self.sink {
            Sink::Direct(sink) => {
                let mut sink = sink.lock().unwrap_or_else(|p| p.into_inner());
                if let Err(e) = sink.write_all(&line).and_then(|_| sink.flush()) {
                    tracing::error!(error = %e, run_id = %event.run_id, "audit write failed");
                }
            }
            Sink::Queued(q) => {
                if q.waiting.load(Ordering::Relaxed) >= q.holds {
                    let dropped = q.dropped.fetch_add(1, Ordering::Relaxed) + 1;
                    tracing::error!(run_id = %event.run_id, dropped, waiting = q.holds, "audit line dropped: nobody reads the gateway's output");
                    return;
                }
                q.waiting.fetch_add(1, Ordering::Relaxed);
                if q.tx.send(line).is_err() {
                    q.waiting.fetch_sub(1, Ordering::Relaxed);
                    tracing::error!(run_id = %event.run_id, "audit line lost: the audit writer thread is gone");
                }
            }
        }
    }
}

/// RFC 3339 UTC timestamp with milliseconds, without a date crate.
pub(crate) fn now_rfc3339() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let secs = now.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        now.subsec_millis()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Standard output nobody reads (a stopped containerd): writing never blocks the run, new runs
    /// are refused past the backlog, no run's line is lost, and the lines arrive once it is read.
    #[test]
    fn a_pipe_nobody_reads_neither_blocks_runs_nor_loses_their_lines() {
        let (mut reader, writer) = std::io::pipe().expect("a pipe");
        let audit = Audit::queued(Box::new(writer), 8, 32);
        let event = |i: usize| AuditEvent::new(&format!("run-{i}-{}", "x".repeat(70_000)), "run");
        let began = std::time::Instant::now();
        // 70 kB lines: the pipe (64 KiB) is full with the first.
        let mut admitted = 0;
        for i in 0..30 {
            if audit.backlog().is_none() {
                admitted += 1;
            }
            audit.write(&event(i));
        }
        assert!(
            began.elapsed() < std::time::Duration::from_secs(5),
            "writes blocked for {:?}",
            began.elapsed()
        );
        assert!(
            audit.backlog().is_some_and(|n| n >= 8),
            "{:?}",
            audit.backlog()
        );
        assert!(admitted < 30, "no run was refused while the lines piled up");
        assert_eq!(audit.dropped(), 0);
        // Past `holds`, lines are dropped and counted.
        for i in 30..40 {
            audit.write(&event(i));
        }
        assert_eq!(audit.dropped(), 8, "30 + 10 lines, 32 held");
        let mut text = String::new();
        let reading = std::thread::spawn(move || {
            use std::io::Read;
            let _ = reader.read_to_string(&mut text);
            text
        });
        // Not all written yet: the reader has only just started.
        assert!(
            audit.drain(std::time::Duration::from_secs(10)),
            "the queue never drained"
        );
        drop(audit);
        let text = reading.join().expect("the reader");
        let ids: Vec<String> = text
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).expect("a whole JSON line")["run_id"]
                    .as_str()
                    .unwrap()[..6]
                    .to_string()
            })
            .collect();
        assert_eq!(ids.len(), 32, "every held line arrives once");
        assert_eq!(ids[0], "run-0-");
    }

    #[test]
    fn timestamps_are_rfc3339() {
        let ts = super::now_rfc3339();
        assert_eq!(ts.len(), 24, "{ts}");
        assert!(
            ts.starts_with("20") && ts.ends_with('Z') && &ts[10..11] == "T",
            "{ts}"
        );
    }
}
