//! The audit: one structured JSON line per run, failures included. NOT_FOUND requests (a caller
//! asking for chains that do not exist) are sampled: at most one line per 10 s, saying how many it
//! stands for (`Engine::refuse`).

use serde::Serialize;
use serde_json::Value;
use std::io::Write;
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

/// Where audit lines go. Writes are whole lines under a lock, so concurrent runs never interleave.
#[derive(Clone)]
pub struct Audit {
    sink: Arc<Mutex<Box<dyn Write + Send>>>,
}

impl Audit {
    pub fn new(sink: Box<dyn Write + Send>) -> Self {
        Self {
            sink: Arc::new(Mutex::new(sink)),
        }
    }

    pub fn to_stdout() -> Self {
        Self::new(Box::new(std::io::stdout()))
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

    pub fn write(&self, event: &AuditEvent) {
        let mut line = match serde_json::to_vec(event) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, run_id = %event.run_id, "audit event did not serialize");
                return;
            }
        };
        line.push(b'\n');
        let mut sink = self.sink.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = sink.write_all(&line).and_then(|_| sink.flush()) {
            tracing::error!(error = %e, run_id = %event.run_id, "audit write failed");
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
