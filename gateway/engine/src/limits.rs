//! Bounds on everything that crosses the gateway: requests from callers and results from sandboxes.

use crate::wire::WireLimits;
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct Limits {
    /// Largest gRPC message accepted (the whole encoded request).
    pub request_bytes: usize,
    /// Largest payload (text or JSON) accepted from a caller or returned by a hook.
    pub payload_bytes: usize,
    pub state_bytes: usize,
    pub findings_bytes: usize,
    pub message_chars: usize,
    /// Deepest nesting of a JSON value returned by a hook.
    pub depth: usize,
    /// host_calls one chain may make in one run (a Run, or a whole Stream: every flush and the
    /// final pass, and walks resumed in a fresh sandbox, together). Counted by the gateway; the one
    /// past it is answered with an error the hook sees as `HostCallError`.
    pub host_calls_per_run: u32,
    /// Time one chain's host_calls may take in one run, all together. A call still running when it
    /// is spent is cut off (by the capability runner, whose dispatch steps still run, so a gate's
    /// reservation is settled); later ones are refused.
    pub host_call_time_per_run: Duration,
    /// Bytes one chain's host_calls may move in one run: payloads sent plus results received (JSON).
    pub host_call_bytes_per_run: usize,
    /// host_calls listed one by one in a run's audit event; the rest are counted per capability and
    /// result (`host_call_summary`), so a flood cannot grow the audit line.
    pub audit_host_calls: usize,
    /// Entries in a request's context map.
    pub context_entries: usize,
    /// Warm sandboxes (booted or booting ahead of demand) across all chains of the gateway. Chains
    /// take turns up to it; a boot for a request that is waiting is never held back by it.
    pub warm_sandboxes: usize,
    /// How long a request waits for a sandbox before UNAVAILABLE.
    pub claim_timeout: Duration,
    /// How long a new sandbox may take to start Python and say ready.
    pub boot_timeout: Duration,
    /// Largest assembled reply of one stream.
    pub stream_bytes: usize,
    /// Longest a stream may stay silent before it is closed (and its sandbox handed back).
    pub stream_idle: Duration,
    /// How long a sandbox past its pool's warm target may wait unclaimed before it is retired (in
    /// a cluster: its pod deleted), so a pool that grew with demand shrinks again.
    pub idle_retire: Duration,
    /// Bytes of what each hook printed (stdout and stderr, the end of it) a Run's answer carries.
    /// 0, the default, carries none: what a hook prints is the author's debugging, not the
    /// application's business. `sluice test` and `sluice run` show it.
    pub hook_output_bytes: usize,
    /// A warm sandbox whose supervisor has said nothing for this long is pinged (`ping`, answered
    /// `pong` within `keepalive_deadline`) and retired if the answer is late: in a cluster the
    /// kubelet cuts an exec stream idle for 4 h, and a half-open connection is noticed only so.
    /// None: never (local sandboxes are pipes of this process).
    pub keepalive: Option<Duration>,
    pub keepalive_deadline: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            request_bytes: 4 << 20,
            payload_bytes: 1 << 20,
            state_bytes: 64 << 10,
            findings_bytes: 64 << 10,
            message_chars: 4096,
            depth: 32,
            host_calls_per_run: 16,
            host_call_time_per_run: Duration::from_secs(30),
            host_call_bytes_per_run: 4 << 20,
            audit_host_calls: 32,
            context_entries: 64,
            warm_sandboxes: 64,
            claim_timeout: Duration::from_secs(5),
            boot_timeout: Duration::from_secs(20),
            stream_bytes: 4 << 20,
            stream_idle: Duration::from_secs(60),
            idle_retire: Duration::from_secs(60),
            hook_output_bytes: 0,
            keepalive: None,
            keepalive_deadline: Duration::from_secs(10),
        }
    }
}

impl Limits {
    pub fn wire(&self) -> WireLimits {
        WireLimits {
            payload_bytes: self.payload_bytes,
            state_bytes: self.state_bytes,
            findings_bytes: self.findings_bytes,
            message_chars: self.message_chars,
            depth: self.depth,
            host_calls: self.host_calls_per_run,
        }
    }

    /// Longest protocol line a sandbox may send: the largest payload plus state, findings and framing.
    pub fn max_line(&self) -> usize {
        self.payload_bytes * 2 + self.state_bytes + self.findings_bytes + 64 * 1024
    }
}
