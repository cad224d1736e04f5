//! The gateway's side of one supervisor conversation: ready; then, per trigger point, a cell opened
//! ahead of the claim (`prepare`: init and its ack), chain walks with host_calls answered in the
//! middle, and the cell's end with the supervisor's cleanliness verdict. Deadlines are enforced
//! here; host_call time does not count against them.

use crate::chain::Chain;
use crate::host_calls::HostCalls;
use crate::sandbox::{Sandbox, SandboxHandle};
use crate::wire::{self, FromSupervisor, HookResult, ReadError, ToSupervisor, WireLimits};
use serde_json::Value;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncWriteExt, BufReader};
use tracing::Instrument;

/// How far past the chain's deadline the gateway waits for the supervisor's own verdict on a hook
/// that ran out of time.
const DEADLINE_GRACE: Duration = Duration::from_millis(500);

/// Why a conversation with the sandbox ended early. Each ends the sandbox's usefulness.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SandboxFailure {
    #[error("timed out after {0} ms")]
    Timeout(u64),
    #[error("the sandbox died ({0})")]
    Died(String),
    /// The connection to the sandbox broke or stopped answering (the backend ended it with
    /// `ConnectionAborted` and says why): the sandbox may live on, but it is out of reach.
    #[error("the connection to the sandbox was lost ({0})")]
    Lost(String),
    #[error("the sandbox broke the protocol ({0})")]
    Protocol(String),
    /// The sandbox spoke for a hook other than the one running: it cannot be trusted at all.
    #[error("{0}")]
    Forged(String),
}

/// What every hook of a run is told besides the payload and the state, the same in each of the
/// run's walks and in each sandbox that serves one: the `context` `execute` gets, and the moment its
/// clocks read.
#[derive(Clone, Debug)]
pub struct RunContext {
    pub context: Value,
    pub moment: crate::moment::Moment,
}

/// What a walk brought back: the hook results received (in order), and the summary unless the walk
/// ended in a failure.
#[derive(Debug, Default)]
pub struct WalkReport {
    pub hooks: Vec<HookResult>,
    pub summary: Option<(String, Option<usize>)>,
    pub failure: Option<SandboxFailure>,
    /// Time spent waiting on host_calls, excluded from the deadline.
    pub host_call_time: Duration,
}

pub struct SupervisorConn {
    pub id: String,
    stdin: Option<crate::sandbox::Writer>,
    reader: BufReader<crate::sandbox::Reader>,
    buf: Vec<u8>,
    handle: Box<dyn SandboxHandle>,
    max_line: usize,
    next_id: u64,
    broken: bool,
    /// The chain whose cell is open and loaded, waiting for (or serving) a trigger point.
    cell: Option<Arc<Chain>>,
    /// Trigger points this sandbox has served (cells ended).
    uses: u32,
    /// Since when it has waited in its pool for a claim. Tokio's clock, as the pool's timers are.
    idle_since: tokio::time::Instant,
    /// When the supervisor last said anything: proof that the stream to it was alive then.
    heard_at: tokio::time::Instant,
    /// Bytes printed before the open cell's trigger point: output is counted per trigger point.
    printed_before: u64,
    /// The sandbox's CPU throttling when it was last counted.
    throttling_counted: crate::sandbox::CpuThrottling,
}

/// How a cell ended: clean, or why the sandbox must not serve again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CellEnd {
    Clean,
    Dirty(String),
}

/// What failed while a sandbox was recycled: ending its cell, or opening the next one.
#[derive(Debug)]
pub enum EndAndPrepareError {
    End(SandboxFailure),
    Prepare(SandboxFailure),
}

impl std::fmt::Debug for SupervisorConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SupervisorConn")
            .field("id", &self.id)
            .field("broken", &self.broken)
            .finish()
    }
}

fn died(e: ReadError) -> SandboxFailure {
    match e {
        ReadError::Eof => {
            SandboxFailure::Died("killed, out of memory, or its supervisor exited".into())
        }
        ReadError::Io(e) if e.kind() == std::io::ErrorKind::ConnectionAborted => {
            SandboxFailure::Lost(e.to_string())
        }
        ReadError::Io(e) => SandboxFailure::Died(e.to_string()),
        other => SandboxFailure::Protocol(other.to_string()),
    }
}

impl SupervisorConn {
    pub fn new(sandbox: Sandbox, max_line: usize) -> Self {
        Self {
            id: sandbox.id,
            stdin: Some(sandbox.stdin),
            reader: BufReader::with_capacity(64 << 10, sandbox.protocol),
            buf: Vec::with_capacity(4096),
            handle: sandbox.handle,
            max_line,
            next_id: 0,
            broken: false,
            cell: None,
            uses: 0,
            idle_since: tokio::time::Instant::now(),
            heard_at: tokio::time::Instant::now(),
            printed_before: 0,
            throttling_counted: Default::default(),
        }
    }

    /// CPU throttling the sandbox met since this was last asked (None: its backend cannot see it).
    pub fn throttling_since_counted(&mut self) -> Option<crate::sandbox::CpuThrottling> {
        let now = self.handle.cpu_throttling()?;
        let added = now.since(self.throttling_counted);
        self.throttling_counted = now;
        Some(added)
    }

    /// False once a deadline passed or the sandbox misbehaved: it must not be used again.
    pub fn healthy(&self) -> bool {
        !self.broken
    }

    /// Whether the backend says sandboxes of another kind now serve this one's chain.
    pub fn outdated(&self) -> bool {
        self.handle.outdated()
    }

    /// Whether an idle sandbox is still there, without waiting: a supervisor says nothing while its
    /// prepared cell waits for a claim, so an ended stream (the sandbox died, or the connection to it
    /// broke while it waited) or anything unasked-for means it must not be handed to a run.
    pub fn still_waiting(&mut self) -> bool {
        use futures::FutureExt;
        use tokio::io::AsyncBufReadExt;
        !self.broken && self.reader.fill_buf().now_or_never().is_none()
    }

    /// Bytes printed since the open cell was prepared (its trigger point's module code and hooks).
    pub fn stdout_bytes(&self) -> u64 {
        self.handle
            .stdout_bytes()
            .saturating_sub(self.printed_before)
    }

    async fn send(&mut self, msg: &ToSupervisor<'_>) -> Result<(), SandboxFailure> {
        let mut line =
            serde_json::to_vec(msg).map_err(|e| SandboxFailure::Protocol(e.to_string()))?;
        line.push(b'\n');
        let Some(stdin) = self.stdin.as_mut() else {
            return Err(SandboxFailure::Died("stdin already closed".into()));
        };
        let written = async {
            stdin.write_all(&line).await?;
            stdin.flush().await
        };
        written.await.map_err(|e| {
            self.broken = true;
            SandboxFailure::Died(format!("writing to it failed: {e}"))
        })
    }

    /// Reads one message within `budget`.
    async fn recv(&mut self, budget: Duration) -> Result<FromSupervisor, SandboxFailure> {
        let read = wire::read_message(&mut self.reader, &mut self.buf, self.max_line);
        match tokio::time::timeout(budget, read).await {
            Ok(Ok(msg)) => {
                self.heard_at = tokio::time::Instant::now();
                Ok(msg)
            }
            Ok(Err(e)) => {
                self.broken = true;
                Err(died(e))
            }
            Err(_) => {
                self.broken = true;
                Err(SandboxFailure::Timeout(budget.as_millis() as u64))
            }
        }
    }

    /// Waits for the supervisor's `ready`, proof that Python started inside the sandbox and that it
    /// can make cells there (otherwise its first line is an `error` saying why).
    pub async fn wait_ready(&mut self, budget: Duration) -> Result<(), SandboxFailure> {
        match self.recv(budget).await? {
            FromSupervisor::Ready { protocol } if protocol == wire::PROTOCOL_VERSION => Ok(()),
            FromSupervisor::Ready { protocol } => {
                self.broken = true;
                Err(SandboxFailure::Protocol(format!(
                    "the sandbox's supervisor speaks protocol {protocol}, this gateway speaks {}: \
                     deploy the supervisor of this gateway's release",
                    wire::PROTOCOL_VERSION
                )))
            }
            FromSupervisor::Error { message } => {
                self.broken = true;
                Err(SandboxFailure::Protocol(format!(
                    "the supervisor cannot serve here: {message}"
                )))
            }
            other => {
                self.broken = true;
                Err(SandboxFailure::Protocol(format!(
                    "expected ready, got {other:?}"
                )))
            }
        }
    }

    /// The chain whose cell is open in this sandbox, if any.
    pub fn cell(&self) -> Option<&Arc<Chain>> {
        self.cell.as_ref()
    }

    /// Trigger points served so far.
    pub fn uses(&self) -> u32 {
        self.uses
    }

    /// Notes that it starts waiting in its pool now.
    pub fn mark_idle(&mut self) {
        self.idle_since = tokio::time::Instant::now();
    }

    /// How long it has waited in its pool.
    pub fn idle_for(&self) -> Duration {
        self.idle_since.elapsed()
    }

    /// How long since the supervisor last said anything.
    pub fn silent_for(&self) -> Duration {
        self.heard_at.elapsed()
    }

    /// A keepalive over the idle stream: `ping`, and its `pong` within `budget`. An error (no
    /// answer in time: a half-open connection; the stream ended; anything else said) leaves the
    /// sandbox unhealthy.
    pub async fn ping(&mut self, budget: Duration) -> Result<(), SandboxFailure> {
        self.send(&ToSupervisor::Ping).await?;
        match self.recv(budget).await? {
            FromSupervisor::Pong => Ok(()),
            other => {
                self.broken = true;
                Err(SandboxFailure::Protocol(format!(
                    "expected pong, got {other:?}"
                )))
            }
        }
    }

    /// Opens a cell for `chain`'s next trigger point: every hook's process started and its code
    /// loaded (`init`, then its `ack`). Done ahead of the claim, so no fork and no code loading is on
    /// a trigger point's path. A hook whose code does not load is reported as that hook's error when
    /// a walk reaches it.
    pub async fn prepare(
        &mut self,
        chain: &Arc<Chain>,
        limits: &WireLimits,
        budget: Duration,
    ) -> Result<(), SandboxFailure> {
        self.send_init(chain, limits).await?;
        self.recv_ack(chain, budget).await
    }

    async fn send_init(
        &mut self,
        chain: &Arc<Chain>,
        limits: &WireLimits,
    ) -> Result<(), SandboxFailure> {
        self.printed_before = self.handle.stdout_bytes();
        let hooks = chain
            .spec
            .hooks
            .iter()
            .zip(&chain.settings)
            .map(|(h, settings)| wire::InitHook {
                name: &h.name,
                action: h.action.as_str(),
                settings,
                code: &h.code,
            })
            .collect();
        let policy = match chain.spec.failure_policy {
            sluice_crds::FailurePolicy::Closed => "Closed",
            sluice_crds::FailurePolicy::Open => "Open",
        };
        self.send(&ToSupervisor::Init {
            trigger_point: chain.spec.trigger_point.as_str(),
            failure_policy: policy,
            timeout_ms: chain.spec.timeout_ms as u64,
            hooks,
            limits,
        })
        .await
    }

    async fn recv_ack(
        &mut self,
        chain: &Arc<Chain>,
        budget: Duration,
    ) -> Result<(), SandboxFailure> {
        let expected = chain.spec.hooks.len();
        match self.recv(budget).await? {
            FromSupervisor::Ack { hooks } if hooks.len() == expected => {
                self.cell = Some(chain.clone());
                Ok(())
            }
            other => {
                self.broken = true;
                Err(SandboxFailure::Protocol(format!(
                    "expected an ack for {expected} hooks, got {other:?}"
                )))
            }
        }
    }

    /// Closes the open cell (every hook process killed and reaped) and returns the supervisor's
    /// verdict on the sandbox.
    pub async fn end(&mut self, budget: Duration) -> Result<CellEnd, SandboxFailure> {
        if !self.send_end().await? {
            return Ok(CellEnd::Clean);
        }
        self.recv_ended(budget).await
    }

    /// Ends the open cell and opens the next one, of `chain`, in one exchange: `end` and `init` go
    /// out together and their answers are read after, so that recycling a sandbox costs one round
    /// trip to it, not two (through the exec path of a cluster each is a trip through the API
    /// server, the kubelet, containerd and the runc shim). The supervisor answers them in order;
    /// a dirty `ended` still retires the sandbox, with the cell it opened.
    pub async fn end_and_prepare(
        &mut self,
        chain: &Arc<Chain>,
        limits: &WireLimits,
        end_budget: Duration,
        prepare_budget: Duration,
    ) -> Result<CellEnd, EndAndPrepareError> {
        let ending = self.send_end().await.map_err(EndAndPrepareError::End)?;
        self.send_init(chain, limits)
            .await
            .map_err(EndAndPrepareError::Prepare)?;
        let verdict = if ending {
            self.recv_ended(end_budget)
                .await
                .map_err(EndAndPrepareError::End)?
        } else {
            CellEnd::Clean
        };
        if let CellEnd::Dirty(_) = verdict {
            return Ok(verdict);
        }
        self.recv_ack(chain, prepare_budget)
            .await
            .map_err(EndAndPrepareError::Prepare)?;
        Ok(verdict)
    }

    /// Sends `end` for the open cell; false when none was open (nothing to answer).
    async fn send_end(&mut self) -> Result<bool, SandboxFailure> {
        if self.cell.take().is_none() {
            return Ok(false);
        }
        self.uses = self.uses.saturating_add(1);
        self.send(&ToSupervisor::End).await?;
        Ok(true)
    }

    async fn recv_ended(&mut self, budget: Duration) -> Result<CellEnd, SandboxFailure> {
        match self.recv(budget).await? {
            FromSupervisor::Ended { clean: true, .. } => Ok(CellEnd::Clean),
            FromSupervisor::Ended {
                clean: false,
                reason,
            } => Ok(CellEnd::Dirty(
                reason.unwrap_or_else(|| "no reason given".into()),
            )),
            other => {
                self.broken = true;
                Err(SandboxFailure::Protocol(format!(
                    "expected ended, got {other:?}"
                )))
            }
        }
    }

    /// Runs the chain from hook `start` on `outgoing` with the given state vector, for the run
    /// `run`. Never fails as a whole: a failure is recorded in the report next to the hook results
    /// that came before it.
    pub async fn walk(
        &mut self,
        start: usize,
        outgoing: &Value,
        state: &[Value],
        run: &RunContext,
        budget: Duration,
        host: &dyn HostCalls,
    ) -> WalkReport {
        self.next_id += 1;
        let id = self.next_id;
        let mut report = WalkReport::default();
        if self.cell.is_none() {
            report.failure = Some(SandboxFailure::Protocol(
                "a walk in a sandbox with no cell open".into(),
            ));
            return report;
        }
        // This side's clock starts before the chunk goes out: the supervisor's cannot start earlier.
        let mut began = Instant::now();
        if let Err(f) = self
            .send(&ToSupervisor::Chunk {
                id,
                start,
                outgoing,
                state,
                context: &run.context,
                moment_ms: run.moment,
            })
            .await
        {
            report.failure = Some(f);
            return report;
        }
        // One deadline model on both sides (supervisor/PROTOCOL.md, "Deadlines"): the walk's hooks
        // share `budget`, host_call time not counted; a hook that runs out of it has failed, and
        // the hooks after it share a fresh one. The supervisor stops a hook at that deadline itself,
        // reports it as that hook's error (the sandbox stays usable) and says that it ran out
        // (`ran_out`): a fresh deadline starts on both sides then, whatever this side counted. This
        // side counts the same on its own clock, from before the chunk went out, and waits for each
        // message what is left plus `DEADLINE_GRACE`: the backstop for a supervisor that does not
        // stop a hook, which ends the sandbox. It also starts afresh when its own count ran out
        // (which only ever makes it wait longer).
        let mut left = budget;
        // One span per hook, from when it can start (the chunk was sent, the previous hook
        // answered) to its result; a hook's host_calls are its children.
        let hook_names: Vec<String> = self.cell.as_ref().map_or_else(Vec::new, |c| {
            c.spec.hooks.iter().map(|h| h.name.clone()).collect()
        });
        let hook_span = |i: usize| match hook_names.get(i) {
            Some(name) => tracing::info_span!(
                "hook",
                hook = %name,
                index = i,
                action = tracing::field::Empty,
                error = tracing::field::Empty,
            ),
            None => tracing::Span::none(),
        };
        let mut current = hook_span(start);
        loop {
            let msg = match self.recv(left + DEADLINE_GRACE).await {
                Ok(m) => m,
                Err(SandboxFailure::Timeout(_)) => {
                    let printed = self.stdout_bytes();
                    report.failure = Some(if printed > crate::sandbox::OUTPUT_LIMIT {
                        SandboxFailure::Died(format!(
                            "the hook printed more than {} bytes to stdout/stderr and was stopped at its {} ms deadline",
                            crate::sandbox::OUTPUT_LIMIT,
                            budget.as_millis()
                        ))
                    } else {
                        SandboxFailure::Timeout(budget.as_millis() as u64)
                    });
                    return report;
                }
                Err(f) => {
                    report.failure = Some(f);
                    return report;
                }
            };
            let now = Instant::now();
            left = left.saturating_sub(now - began);
            began = now;
            match msg {
                FromSupervisor::HookResult(h) if h.id == id => {
                    if h.ran_out || left.is_zero() {
                        // The hook ran out of the walk's deadline: the next one starts afresh.
                        left = budget;
                    }
                    // What the sandbox says is untrusted text: escaped, as in every log line.
                    current.record(
                        "action",
                        tracing::field::display(crate::log_text::Escaped(&h.action)),
                    );
                    if let Some(e) = &h.error {
                        current.record(
                            "error",
                            tracing::field::display(crate::log_text::Escaped(e)),
                        );
                    }
                    // The walk goes on after a non-terminal result, and after a failed hook under
                    // `Open`; a span for a hook that then does not run would be a lie.
                    let open = self
                        .cell
                        .as_ref()
                        .is_some_and(|c| c.spec.failure_policy == sluice_crds::FailurePolicy::Open);
                    let goes_on = sluice_crds::Action::parse(&h.action)
                        .is_some_and(|a| !a.is_terminal())
                        && (h.error.is_none() || open);
                    current = if goes_on {
                        hook_span(h.index + 1)
                    } else {
                        tracing::Span::none()
                    };
                    report.hooks.push(h);
                }
                FromSupervisor::HostCall {
                    id: call,
                    hook,
                    name,
                    payload,
                } => {
                    // Only the hook the walk is at can be waiting on a host_call: it has not
                    // returned yet, and every hook before it has.
                    let running = start + report.hooks.len();
                    let hooks = self.cell.as_ref().map_or(0, |c| c.spec.hooks.len());
                    if hook != running || running >= hooks {
                        self.broken = true;
                        report.failure = Some(SandboxFailure::Forged(format!(
                            "a host_call for hook #{hook} while hook #{running} was running"
                        )));
                        return report;
                    }
                    let waited = Instant::now();
                    let span = tracing::info_span!(
                        parent: &current,
                        "host_call",
                        capability = %crate::log_text::Escaped(&name),
                        hook = hook_names.get(hook).map_or("", |n| n.as_str()),
                    );
                    let answer = host.call(hook, &name, payload).instrument(span).await;
                    report.host_call_time += waited.elapsed();
                    let (ok, result, error, code) = match answer {
                        Ok(v) => (true, Some(v), None, None),
                        Err(e) => (false, None, Some(e.to_string()), Some(e.code().as_str())),
                    };
                    if let Err(f) = self
                        .send(&ToSupervisor::HostResult {
                            id: call,
                            ok,
                            result,
                            error,
                            code,
                        })
                        .await
                    {
                        report.failure = Some(f);
                        return report;
                    }
                    // The time waiting for the host_result is not the hook's.
                    began = Instant::now();
                }
                FromSupervisor::Result {
                    id: rid,
                    action,
                    terminal_index,
                } if rid == id => {
                    report.summary = Some((action, terminal_index));
                    return report;
                }
                FromSupervisor::Error { message } => {
                    self.broken = true;
                    report.failure = Some(SandboxFailure::Protocol(format!(
                        "supervisor error: {message}"
                    )));
                    return report;
                }
                other => {
                    self.broken = true;
                    report.failure = Some(SandboxFailure::Protocol(format!(
                        "unexpected message {other:?}"
                    )));
                    return report;
                }
            }
        }
    }

    /// Ends the conversation and destroys the sandbox. A healthy supervisor sees stdin close and
    /// exits by itself; a broken one is killed at once.
    pub async fn close(mut self) {
        let force = self.broken;
        if !force {
            let _ = self.send(&ToSupervisor::Shutdown).await;
        }
        if let Some(mut stdin) = self.stdin.take() {
            let _ = stdin.shutdown().await;
        }
        self.handle.destroy(force).await;
    }
}
