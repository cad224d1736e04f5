//! `Engine::stream`: an agent reply through the chain on two paths, transport-free. The caller hands
//! over a stream of `StreamInput`s (open, chunks, finish) and reads `StreamOutput`s (commits, a block,
//! the final); the gRPC server only translates.
//!
//! Stream path: chunks go through the `Window`; the chain runs on each batch with the state vector
//! threaded across flushes, and what the window lets go is committed. Final path: the same sandbox
//! runs the chain once more, with a fresh state vector, on the raw reply the engine assembled itself;
//! that result is the one to persist. A terminal action on the stream path stops commits at once and
//! is the final.

use crate::audit::AuditEvent;
use crate::chains::Chains;
use crate::engine::Engine;
use crate::log_text::Escaped;
use crate::metrics::ChainLabels;
use crate::outcome::Walk;
use crate::pipeline::Pipeline;
use crate::request::{CallerAuth, EngineError, Target};
use crate::rollout::Selection;
use crate::run::RunResult;
use crate::run_id::RunId;
use crate::window::Window;
use futures::{Stream, StreamExt};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;
use tracing::Instrument;

/// Most bytes gathered into one flush when the client is ahead of the chain.
const COALESCE_BYTES: usize = 64 * 1024;

/// What a stream's caller sends: `Open` once, first; then chunks; then `Finish`.
#[derive(Clone, Debug)]
pub enum StreamInput {
    Open(StreamOpen),
    Chunk(String),
    Finish,
}

/// Where a stream goes, as the caller sent it.
#[derive(Clone, Debug, Default)]
pub struct StreamOpen {
    pub namespace: String,
    pub target: String,
    pub trigger_point: String,
    pub context: BTreeMap<String, String>,
    pub session_id: String,
    /// Flush as each chunk fills the window, never taking chunks already received in one batch,
    /// as if each came long after the one before (for tests of patterns split across chunks).
    pub chunk_by_chunk: bool,
    pub auth: CallerAuth,
}

/// What a stream answers: commits, then either `Final` or a `Blocked` followed by `Final`.
#[derive(Debug)]
pub enum StreamOutput {
    /// Text safe to show now.
    Commit(String),
    /// A terminal action on the stream path: nothing more is committed.
    Blocked { message: String, hook: String },
    /// The final path's verdict (or the stream path's terminal walk): the one to persist.
    Final(RunResult),
}

/// The caller's side of the stream failed (a transport error), with its message.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{0}")]
pub struct ClientStreamError(pub String);

/// Why a stream ended without its final.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// Refused at open (bad request, no chain, no sandbox), or a second open.
    #[error(transparent)]
    Refused(#[from] EngineError),
    #[error("the gateway is shutting down; the stream was ended before its final")]
    ShuttingDown,
    #[error("no stream message for {0} s; the stream is closed")]
    Idle(u64),
    /// The client went away, closed without finish, or its stream failed.
    #[error("{0}")]
    Cancelled(String),
    #[error("the reply is over the limit of {0} bytes")]
    TooLarge(usize),
}

impl StreamError {
    /// The gRPC code it is answered with, as metrics label it.
    pub(crate) fn code(&self) -> &'static str {
        match self {
            StreamError::Refused(e) => e.code(),
            StreamError::ShuttingDown => "unavailable",
            StreamError::Idle(_) => "deadline_exceeded",
            StreamError::Cancelled(_) => "cancelled",
            StreamError::TooLarge(_) => "resource_exhausted",
        }
    }
}

type Inputs = Pin<Box<dyn Stream<Item = Result<StreamInput, ClientStreamError>> + Send>>;
type Tx = mpsc::Sender<Result<StreamOutput, StreamError>>;

/// Longest hook error kept in a stream's audit (the first one of each hook).
const AUDIT_ERROR_CHARS: usize = 512;

/// Counters for the audit event of a stream.
#[derive(Debug, Default)]
struct Stats {
    chunks: u64,
    flushes: u64,
    raw_chars: u64,
    committed_chars: u64,
    /// What each hook did on the stream path, across flushes, in chain order (baseline first).
    hooks: Vec<HookStats>,
    /// A hook has failed on the stream path (under `Open`: its flush went on without it).
    failing: bool,
    /// Text was committed to the client after a hook had failed on the stream path.
    committed_while_failing: bool,
    /// The first hook failure on the stream path, worded as the audit's `failure_reason`.
    first_failure: Option<String>,
}

/// One hook's part in a stream's flushes.
#[derive(Debug)]
struct HookStats {
    name: String,
    actions: BTreeMap<&'static str, u64>,
    errors: u64,
    /// Its first error.
    error: Option<String>,
}

impl Stats {
    /// Records what the hooks did in one flush.
    fn flushed(&mut self, walk: &Walk) {
        for h in &walk.hooks {
            let at = match self.hooks.iter().position(|s| s.name == h.name) {
                Some(at) => at,
                None => {
                    self.hooks.push(HookStats {
                        name: h.name.clone(),
                        actions: BTreeMap::new(),
                        errors: 0,
                        error: None,
                    });
                    self.hooks.len() - 1
                }
            };
            let s = &mut self.hooks[at];
            *s.actions.entry(h.action.as_str()).or_default() += 1;
            if let Some(e) = &h.error {
                s.errors += 1;
                self.failing = true;
                self.first_failure.get_or_insert_with(|| {
                    let e: String = e.chars().take(AUDIT_ERROR_CHARS).collect();
                    format!("hook {:?} failed on the stream path: {e}", h.name)
                });
                s.error
                    .get_or_insert_with(|| e.chars().take(AUDIT_ERROR_CHARS).collect());
            }
        }
    }

    /// Records a stream-path failure in the audit as passed over (the stream went on without it).
    fn passed_over(&self, audit: &mut AuditEvent) {
        if let Some(f) = &self.first_failure {
            audit.policy_outcome = Some("passed_over");
            audit.failure_reason = Some(f.clone());
        }
    }

    fn committed(&mut self, text: &str) {
        self.committed_chars += text.chars().count() as u64;
        self.committed_while_failing |= self.failing;
    }
}

enum End {
    /// `finish` arrived: run the final path.
    Finished,
    /// A terminal action on the stream path: its walk is the final.
    Stopped(Walk),
    /// The stream cannot go on: tell the client (if still there) and audit why.
    Failed(StreamError),
}

impl Engine {
    /// Runs one stream. The answers come back as they are produced; a slow reader slows the stream
    /// down instead of growing a buffer.
    pub fn stream<S>(
        self: &Arc<Self>,
        inputs: S,
    ) -> impl Stream<Item = Result<StreamOutput, StreamError>> + Send + 'static
    where
        S: Stream<Item = Result<StreamInput, ClientStreamError>> + Send + 'static,
    {
        let (tx, rx) = mpsc::channel(8);
        let engine = self.clone();
        // The stream's spans are children of the caller's (the gRPC request's, with its traceparent).
        tokio::spawn(
            async move {
                drive(engine, Box::pin(inputs), tx).await;
            }
            .in_current_span(),
        );
        tokio_stream::wrappers::ReceiverStream::new(rx)
    }
}

async fn send(tx: &Tx, msg: StreamOutput) -> Result<(), StreamError> {
    tx.send(Ok(msg))
        .await
        .map_err(|_| StreamError::Cancelled("the client went away".into()))
}

/// The next message, within the idle limit and unless the engine is shutting down.
async fn next(engine: &Engine, inputs: &mut Inputs) -> Result<Option<StreamInput>, StreamError> {
    let read = tokio::time::timeout(engine.limits().stream_idle, inputs.next());
    let msg = tokio::select! {
        m = read => m,
        _ = engine.stopping() => return Err(StreamError::ShuttingDown),
    };
    match msg {
        Err(_) => Err(StreamError::Idle(engine.limits().stream_idle.as_secs())),
        Ok(None) => Ok(None),
        Ok(Some(Err(e))) => Err(StreamError::Cancelled(format!(
            "the client stream failed: {e}"
        ))),
        Ok(Some(Ok(m))) => Ok(Some(m)),
    }
}

async fn drive(engine: Arc<Engine>, mut inputs: Inputs, tx: Tx) {
    let began = Instant::now();
    let run_id = RunId::new();
    let mut audit = AuditEvent::new(&run_id.to_string(), "stream");
    let open = match next(&engine, &mut inputs).await {
        Ok(Some(StreamInput::Open(o))) => o,
        Ok(_) => {
            let e = EngineError::InvalidArgument("a stream starts with open".into());
            let _ = tx
                .send(Err(engine.refuse(&mut audit, e, began, None).into()))
                .await;
            return;
        }
        Err(e) => {
            audit.error = Some(e.to_string());
            engine.audit().write(&audit);
            return;
        }
    };
    audit.requested(
        &open.namespace,
        &open.target,
        &open.trigger_point,
        &open.session_id,
    );
    audit.caller = open.auth.name().map(str::to_string);
    let chunk_by_chunk = open.chunk_by_chunk;
    let prepared = (|| {
        engine.audit_admits()?;
        let target = Target::check(
            engine.limits(),
            &open.auth,
            &open.namespace,
            &open.target,
            &open.trigger_point,
            open.context,
            open.session_id,
        )?;
        if !target.key.trigger_point.carries_text() {
            return Err(EngineError::InvalidArgument(format!(
                "{} carries a structured payload; stream text at input or output",
                target.key.trigger_point
            )));
        }
        let chains = Chains::resolve(&engine.registry(), &target.key)?;
        Ok((target, chains))
    })();
    let (target, chains) = match prepared {
        Ok(p) => p,
        Err(e) => {
            let _ = tx
                .send(Err(engine.refuse(&mut audit, e, began, None).into()))
                .await;
            return;
        }
    };
    // During a rollout, the version that serves this session (and a candidate in shadow, run on the
    // whole text once the stream is over).
    let selection = engine.select(&chains, &target.session_id, &run_id.to_string());
    let chains = selection.chains.clone();
    chains.describe(&mut audit);
    selection.describe(&mut audit);
    let span = tracing::info_span!(
        "stream",
        run_id = %run_id,
        chain = %Escaped(&chains.main().qualified_name()),
        namespace = %Escaped(&target.key.namespace),
        target = %Escaped(&target.key.target),
        trigger_point = target.key.trigger_point.as_str(),
        action = tracing::field::Empty,
        code = tracing::field::Empty,
    );
    let run = Run {
        engine: &engine,
        chains: &chains,
        run_id,
        began,
        tx: &tx,
        chunk_by_chunk,
    };
    run.serve(&target, &mut inputs, audit, selection)
        .instrument(span)
        .await;
}

/// One stream whose chains are resolved.
struct Run<'a> {
    engine: &'a Engine,
    chains: &'a Chains,
    run_id: RunId,
    began: Instant,
    tx: &'a Tx,
    chunk_by_chunk: bool,
}

impl Run<'_> {
    /// Claims the sandboxes, runs the stream path, then the final path, and audits the whole.
    async fn serve(
        &self,
        target: &Target,
        inputs: &mut Inputs,
        mut audit: AuditEvent,
        selection: Selection,
    ) {
        let engine = self.engine;
        let mut pipeline =
            match Pipeline::open(engine, self.chains, target, self.run_id, false).await {
                Ok(p) => p,
                Err(e) => {
                    let _ = self
                        .tx
                        .send(Err(engine
                            .refuse(&mut audit, e, self.began, Some(self.chains))
                            .into()))
                        .await;
                    return;
                }
            };
        pipeline.record_sandboxes(&mut audit);
        let mut stats = Stats::default();
        let mut raw = String::new();
        let end = self
            .stream_path(&mut pipeline, inputs, &mut raw, &mut stats)
            .await;
        let shadow_payload = (!selection.shadows.is_empty()).then(|| Value::String(raw.clone()));
        let final_walk = match end {
            End::Finished => {
                let mut fresh = self.chains.fresh_states();
                pipeline.walk(Value::String(raw), &mut fresh).await
            }
            End::Stopped(walk) => walk,
            End::Failed(e) => {
                pipeline.record_host_calls(&mut audit, engine.limits().audit_host_calls);
                drop(pipeline);
                audit.error = Some(e.to_string());
                stats.passed_over(&mut audit);
                audit.stream = Some(stream_json(&stats, false));
                audit.latency_us = self.began.elapsed().as_micros() as u64;
                engine.audit().write(&audit);
                let labels = ChainLabels::of(self.chains.main());
                let m = engine.metrics();
                m.runs
                    .with_label_values(&labels.with(&["stream", "none"]))
                    .inc();
                m.requests
                    .with_label_values(&labels.with(&[e.code()]))
                    .inc();
                tracing::Span::current().record("code", e.code());
                let _ = self.tx.send(Err(e)).await;
                return;
            }
        };
        pipeline.record_host_calls(&mut audit, engine.limits().audit_host_calls);
        drop(pipeline);
        let stopped = final_walk.is_terminal();
        // Failures of earlier passes count even when the final pass went clean: text was shown
        // while they failed. The final pass's own failures, if any, take their place below.
        stats.passed_over(&mut audit);
        audit.stream = Some(stream_json(&stats, stopped));
        engine.finish(&mut audit, self.chains, &final_walk, self.began, "stream");
        engine.record_rollout(&selection, &final_walk);
        if let Some(payload) = shadow_payload {
            engine.start_shadows(selection, target, &payload, &final_walk, self.run_id);
        }
        let result = RunResult {
            run_id: self.run_id.to_string(),
            walk: final_walk,
        };
        let _ = send(self.tx, StreamOutput::Final(result)).await;
    }

    /// Runs the stream path until `finish`, a terminal action, or a failure.
    async fn stream_path(
        &self,
        pipeline: &mut Pipeline<'_>,
        inputs: &mut Inputs,
        raw: &mut String,
        stats: &mut Stats,
    ) -> End {
        let limits = self.engine.limits();
        let (flush, lookback) = self.chains.stream_window();
        let mut window = Window::new(flush, lookback);
        let mut state = self.chains.fresh_states();
        loop {
            let msg = match next(self.engine, inputs).await {
                Ok(Some(m)) => m,
                Ok(None) => {
                    return End::Failed(StreamError::Cancelled(
                        "the client closed the stream without finish".into(),
                    ));
                }
                Err(e) => return End::Failed(e),
            };
            let mut last = false;
            let mut ready = false;
            let mut pending = Some(msg);
            // Take what the client has already sent, up to a bound: when chunks arrive faster than
            // the chain runs, one flush covers them all (batches are never smaller than flushChars).
            while let Some(msg) = pending.take() {
                match msg {
                    StreamInput::Chunk(text) => {
                        stats.chunks += 1;
                        stats.raw_chars += text.chars().count() as u64;
                        if raw.len() + text.len() > limits.stream_bytes {
                            return End::Failed(StreamError::TooLarge(limits.stream_bytes));
                        }
                        raw.push_str(&text);
                        ready |= window.push(&text);
                    }
                    StreamInput::Finish => last = true,
                    StreamInput::Open(_) => {
                        return End::Failed(StreamError::Refused(EngineError::InvalidArgument(
                            "open may be sent only once".into(),
                        )));
                    }
                }
                if last || !ready || self.chunk_by_chunk || window.pending_len() >= COALESCE_BYTES {
                    break;
                }
                match futures::FutureExt::now_or_never(inputs.next()) {
                    Some(Some(Ok(m))) => pending = Some(m),
                    Some(Some(Err(e))) => {
                        return End::Failed(StreamError::Cancelled(format!(
                            "the client stream failed: {e}"
                        )));
                    }
                    // Nothing waiting (or the stream ended: the next read reports it).
                    _ => {}
                }
            }
            if !ready && !last {
                continue;
            }
            let commit = match window.take_batch() {
                Some(batch) => {
                    stats.flushes += 1;
                    let walk = pipeline
                        .walk(Value::String(batch.clone()), &mut state)
                        .await;
                    stats.flushed(&walk);
                    if walk.is_terminal() {
                        // This walk is the final: its errors are counted when it is audited.
                        let hook = walk
                            .hooks
                            .iter()
                            .rev()
                            .find(|h| Some(h.index) == walk.terminal_index)
                            .map(|h| h.name.clone())
                            .unwrap_or_default();
                        let blocked = StreamOutput::Blocked {
                            message: walk.message.clone(),
                            hook,
                        };
                        if let Err(e) = send(self.tx, blocked).await {
                            return End::Failed(e);
                        }
                        return End::Stopped(walk);
                    }
                    self.engine.count_hooks(self.chains, &walk);
                    let text = walk.payload.as_str().unwrap_or_default().to_string();
                    window.settle(&batch, &text, last)
                }
                None if last => window.release_tail(),
                None => String::new(),
            };
            if !commit.is_empty() {
                stats.committed(&commit);
                if let Err(e) = send(self.tx, StreamOutput::Commit(commit)).await {
                    return End::Failed(e);
                }
            }
            if last {
                return End::Finished;
            }
        }
    }
}

/// The stream path in the audit: the counters, what each hook did across flushes (actions, errors
/// and the first error), and whether text was committed while a hook was failing.
fn stream_json(s: &Stats, stopped: bool) -> Value {
    let hooks: Vec<Value> = s
        .hooks
        .iter()
        .map(|h| {
            let mut v = json!({"name": h.name, "actions": h.actions, "errors": h.errors});
            if let Some(e) = &h.error {
                v["error"] = json!(e);
            }
            v
        })
        .collect();
    json!({"chunks": s.chunks, "flushes": s.flushes, "raw_chars": s.raw_chars, "committed_chars": s.committed_chars, "stopped": stopped, "hooks": hooks, "committed_while_failing": s.committed_while_failing})
}
