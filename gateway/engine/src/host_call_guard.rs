//! The trusted side's hold on one chain's host_calls in one run (a Run, or a whole Stream: every
//! flush, the final pass and any walk resumed in a fresh sandbox share one guard). Whatever the
//! sandbox claims to have counted, at most `host_calls_per_run` calls reach the capabilities, they
//! take at most `host_call_time_per_run` together and move at most `host_call_bytes_per_run`
//! (payloads sent plus results received); past that a call is answered with an error, which the hook
//! sees as `HostCallError`. Every call is recorded: the audit lists the first `audit_host_calls` and
//! counts the rest per capability and result, so a flood cannot grow the audit line.

use crate::audit::{AuditHostCall, AuditHostCallCount, AuditHostCallSummary};
use crate::chain::Chain;
use crate::host_calls::{HostCallError, HostCalls};
use crate::limits::Limits;
use async_trait::async_trait;
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Longest capability name kept in the audit (a hook chooses the name; the rest is cut).
const NAME_CHARS: usize = 128;
/// Distinct (capability, result) pairs counted in a summary; further names count as `<other>`.
const DISTINCT_COUNTS: usize = 16;

/// How one host_call ended, as the audit counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Answer {
    Ok,
    /// Refused or failed by the capabilities (unknown, not allowed, schema, gate, endpoint).
    Failed,
    /// Refused by the gateway: the run's count, time or bytes were spent.
    OverLimit,
}

impl Answer {
    fn as_str(self) -> &'static str {
        match self {
            Answer::Ok => "ok",
            Answer::Failed => "failed",
            Answer::OverLimit => "over_limit",
        }
    }
}

#[derive(Default)]
struct Ledger {
    /// Calls let through to the capabilities.
    calls: u32,
    time: Duration,
    bytes: usize,
    total: u64,
    listed: Vec<AuditHostCall>,
    counts: BTreeMap<(String, Answer), u64>,
}

/// Wraps the capabilities' handler of one chain in one run; the engine answers host_calls only
/// through it.
pub(crate) struct HostCallGuard {
    inner: Arc<dyn HostCalls>,
    chain: Arc<Chain>,
    calls: u32,
    time: Duration,
    bytes: usize,
    listed: usize,
    ledger: Mutex<Ledger>,
}

fn json_size(v: &Value) -> usize {
    serde_json::to_vec(v).map(|b| b.len()).unwrap_or(usize::MAX)
}

fn cut(name: &str, chars: usize) -> String {
    match name.char_indices().nth(chars) {
        Some((at, _)) => format!("{}…", &name[..at]),
        None => name.to_string(),
    }
}

impl HostCallGuard {
    pub(crate) fn new(inner: Arc<dyn HostCalls>, chain: Arc<Chain>, limits: &Limits) -> Self {
        Self {
            inner,
            chain,
            calls: limits.host_calls_per_run,
            time: limits.host_call_time_per_run,
            bytes: limits.host_call_bytes_per_run,
            listed: limits.audit_host_calls,
            ledger: Mutex::default(),
        }
    }

    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Why the next call may not go through, if it may not; otherwise it is counted.
    fn admit(&self, payload_bytes: usize) -> Result<Duration, HostCallError> {
        let mut l = self.ledger();
        if l.calls >= self.calls {
            return Err(HostCallError::OverLimit(format!(
                "host_call limit reached: at most {} host_calls per run",
                self.calls
            )));
        }
        if l.time >= self.time {
            return Err(self.out_of_time());
        }
        if l.bytes.saturating_add(payload_bytes) > self.bytes {
            return Err(self.out_of_bytes());
        }
        l.calls += 1;
        l.bytes += payload_bytes;
        Ok(self.time - l.time)
    }

    fn out_of_time(&self) -> HostCallError {
        HostCallError::OverLimit(format!(
            "host_call limit reached: host_calls may take {} ms per run in all",
            self.time.as_millis()
        ))
    }

    fn out_of_bytes(&self) -> HostCallError {
        HostCallError::OverLimit(format!(
            "host_call limit reached: host_calls may move {} bytes per run in all (payloads and results)",
            self.bytes
        ))
    }

    fn record(&self, mut record: AuditHostCall, answer: Answer) {
        record.capability = cut(&record.capability, NAME_CHARS);
        let mut l = self.ledger();
        l.total += 1;
        let mut key = (record.capability.clone(), answer);
        if !l.counts.contains_key(&key) && l.counts.len() >= DISTINCT_COUNTS {
            key.0 = "<other>".into();
        }
        *l.counts.entry(key).or_default() += 1;
        if l.listed.len() < self.listed {
            l.listed.push(record);
        }
    }

    /// What the audit shows of this chain's host_calls: those listed, and counts of all of them.
    pub(crate) fn report(&self) -> HostCallReport {
        let l = self.ledger();
        HostCallReport {
            listed: l.listed.clone(),
            total: l.total,
            counts: l
                .counts
                .iter()
                .map(|((capability, answer), count)| AuditHostCallCount {
                    capability: capability.clone(),
                    result: answer.as_str(),
                    count: *count,
                })
                .collect(),
        }
    }
}

#[async_trait]
impl HostCalls for HostCallGuard {
    async fn call(&self, hook: usize, name: &str, payload: Value) -> Result<Value, HostCallError> {
        let began = Instant::now();
        let Some(hook_name) = self.chain.spec.hooks.get(hook).map(|h| h.name.clone()) else {
            return Err(HostCallError::UnknownHook(hook));
        };
        let own_record = |error: Option<String>| AuditHostCall {
            hook: hook_name.clone(),
            capability: name.to_string(),
            gates: vec![],
            consumed: None,
            latency_us: began.elapsed().as_micros() as u64,
            error,
        };
        let remaining = match self.admit(json_size(&payload)) {
            Ok(remaining) => remaining,
            Err(e) => {
                self.record(own_record(Some(e.to_string())), Answer::OverLimit);
                return Err(e);
            }
        };
        let recorded_before = self.inner.audit().len();
        // Bounded by whoever answers, not cut off here: a capability's dispatch steps must still
        // run when the budget ends mid-execute.
        let answer = match self.inner.call_within(hook, name, payload, remaining).await {
            // The budget ran out mid-call: said the same way as for the calls refused after it.
            Err(HostCallError::OverLimit(_)) => Err(self.out_of_time()),
            answer => answer,
        };
        let answer = {
            let mut l = self.ledger();
            l.time += began.elapsed();
            match answer {
                Ok(result) => {
                    let size = json_size(&result);
                    if l.bytes.saturating_add(size) > self.bytes {
                        l.bytes = self.bytes;
                        Err(self.out_of_bytes())
                    } else {
                        l.bytes += size;
                        Ok(result)
                    }
                }
                Err(e) => Err(e),
            }
        };
        // The capabilities' own record (gates, consumed) when they kept one for this call.
        let mut record = match self.inner.audit() {
            records if records.len() > recorded_before => records
                .into_iter()
                .next_back()
                .unwrap_or_else(|| own_record(None)),
            _ => own_record(None),
        };
        record.latency_us = began.elapsed().as_micros() as u64;
        let kind = match &answer {
            Ok(_) => Answer::Ok,
            Err(HostCallError::OverLimit(_)) => Answer::OverLimit,
            Err(_) => Answer::Failed,
        };
        match &answer {
            Err(e) if kind == Answer::OverLimit => record.error = Some(e.to_string()),
            Err(e) => {
                record.error.get_or_insert_with(|| e.to_string());
            }
            Ok(_) => {}
        }
        self.record(record, kind);
        answer
    }

    fn audit(&self) -> Vec<AuditHostCall> {
        self.report().listed
    }
}

/// One chain's host_calls as the audit shows them.
#[derive(Debug, Default)]
pub(crate) struct HostCallReport {
    pub listed: Vec<AuditHostCall>,
    pub total: u64,
    pub counts: Vec<AuditHostCallCount>,
}

impl HostCallReport {
    /// Adds another chain's report (`prefix` on its hook names), listing at most `max` in all.
    pub(crate) fn merge(&mut self, other: HostCallReport, prefix: &str, max: usize) {
        for mut call in other.listed {
            if self.listed.len() >= max {
                break;
            }
            call.hook = format!("{prefix}{}", call.hook);
            self.listed.push(call);
        }
        self.total += other.total;
        for c in other.counts {
            match self
                .counts
                .iter_mut()
                .find(|x| x.capability == c.capability && x.result == c.result)
            {
                Some(x) => x.count += c.count,
                None => self.counts.push(c),
            }
        }
    }

    /// The listed calls, and a summary when some were not listed.
    pub(crate) fn into_audit(self) -> (Vec<AuditHostCall>, Option<AuditHostCallSummary>) {
        let summary = (self.total > self.listed.len() as u64).then_some(AuditHostCallSummary {
            total: self.total,
            listed: self.listed.len(),
            by: self.counts,
        });
        (self.listed, summary)
    }
}
