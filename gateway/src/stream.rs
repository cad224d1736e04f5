//! `Gateway.Stream`: an agent reply through the chain on two paths.
//!
//! Stream path: chunks are buffered to `flushChars`; the chain runs on (held-back tail + new text)
//! with the state vector threaded across flushes; all but the last `lookbackChars` characters of the
//! result are committed, and that tail becomes the next batch's prefix, so a pattern split across
//! chunks is seen whole before any of it is shown. Final path: the same sandbox runs the chain once
//! more, with a fresh state vector, on the raw reply the gateway assembled itself; that result is the
//! one to persist. A terminal action on the stream path stops commits at once and is the final.

use crate::audit::{AuditEvent, now_rfc3339};
use crate::engine::{Engine, EngineError};
use crate::outcome::Walk;
use crate::pipeline::{Chains, Pipeline};
use crate::proto::{self, stream_request::Msg as In, stream_response::Msg as Out};
use crate::server::run_response;
use serde_json::{Value, json};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tonic::Status;

/// Most bytes gathered into one flush when the client is ahead of the chain.
const COALESCE_BYTES: usize = 64 * 1024;

pub type Responses =
    Pin<Box<dyn futures::Stream<Item = Result<proto::StreamResponse, Status>> + Send>>;

/// Splits `text` so that the second part holds its last `keep` characters (never splitting one).
pub fn split_tail(text: &str, keep: usize) -> (&str, &str) {
    let chars = text.chars().count();
    if chars <= keep {
        return ("", text);
    }
    let at = text
        .char_indices()
        .nth(chars - keep)
        .map(|(i, _)| i)
        .unwrap_or(text.len());
    text.split_at(at)
}

/// Splits `text` at the given character positions (taken modulo its length, sorted, deduplicated):
/// how tests and tools cut a reply into chunks.
pub fn chunk_at(text: &str, cuts: &[usize]) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (chars.len() + 1)).collect();
    cuts.sort_unstable();
    cuts.dedup();
    let mut out = Vec::new();
    let mut last = 0;
    for c in cuts.into_iter().chain([chars.len()]) {
        if c > last {
            out.push(chars[last..c].iter().collect());
            last = c;
        }
    }
    out
}

/// The stream path's window: what was received but not yet run, and what was run but held back.
#[derive(Debug, Default)]
pub struct Window {
    /// Raw text received since the last flush.
    pending: String,
    pending_chars: usize,
    /// Processed text held back from the last flush.
    tail: String,
    flush_chars: usize,
    lookback_chars: usize,
}

impl Window {
    pub fn new(flush_chars: usize, lookback_chars: usize) -> Self {
        Self {
            flush_chars: flush_chars.max(1),
            lookback_chars,
            ..Default::default()
        }
    }

    /// Adds received text; true when enough is buffered to run the chain.
    pub fn push(&mut self, chunk: &str) -> bool {
        self.pending.push_str(chunk);
        self.pending_chars += chunk.chars().count();
        self.pending_chars >= self.flush_chars
    }

    /// Bytes received and not yet run.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// The batch to run now (held-back tail + new text), or None when nothing new arrived.
    pub fn take_batch(&mut self) -> Option<String> {
        if self.pending.is_empty() {
            return None;
        }
        self.pending_chars = 0;
        let mut batch = std::mem::take(&mut self.tail);
        batch.push_str(&std::mem::take(&mut self.pending));
        Some(batch)
    }

    /// Takes the chain's result for a batch; returns the part safe to commit now. On the last batch
    /// everything is committed.
    pub fn settle(&mut self, result: &str, last: bool) -> String {
        if last {
            return result.to_string();
        }
        let (commit, tail) = split_tail(result, self.lookback_chars);
        self.tail = tail.to_string();
        commit.to_string()
    }

    /// What is still held back, released as-is at the end when no new text came after it.
    pub fn release_tail(&mut self) -> String {
        std::mem::take(&mut self.tail)
    }
}

/// Counters for the audit event of a stream.
#[derive(Debug, Default)]
struct Stats {
    chunks: u64,
    flushes: u64,
    raw_chars: u64,
    committed_chars: u64,
}

enum End {
    /// `finish` arrived: run the final path.
    Finished,
    /// A terminal action on the stream path: its walk is the final.
    Stopped(Walk),
    /// The stream cannot go on: tell the client (if still there) and audit why.
    Failed(Status),
}

pub async fn serve(
    engine: Arc<Engine>,
    inbound: tonic::Streaming<proto::StreamRequest>,
) -> Result<Responses, Status> {
    let (tx, rx) = mpsc::channel(8);
    tokio::spawn(async move {
        drive(engine, inbound, tx).await;
    });
    Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
}

type Tx = mpsc::Sender<Result<proto::StreamResponse, Status>>;

async fn send(tx: &Tx, msg: Out) -> Result<(), Status> {
    // A full channel waits: a slow reader slows us down instead of growing a buffer.
    tx.send(Ok(proto::StreamResponse { msg: Some(msg) }))
        .await
        .map_err(|_| Status::cancelled("the client went away"))
}

async fn next(
    engine: &Engine,
    inbound: &mut tonic::Streaming<proto::StreamRequest>,
) -> Result<Option<In>, Status> {
    let read = tokio::time::timeout(engine.limits.stream_idle, inbound.next());
    let msg = tokio::select! {
        m = read => m,
        _ = engine.stopping() => {
            return Err(Status::unavailable("the gateway is shutting down; the stream was ended before its final"));
        }
    };
    match msg {
        Err(_) => Err(Status::deadline_exceeded(format!(
            "no stream message for {} s; the stream is closed",
            engine.limits.stream_idle.as_secs()
        ))),
        Ok(None) => Ok(None),
        Ok(Some(Err(s))) => Err(Status::cancelled(format!(
            "the client stream failed: {}",
            s.message()
        ))),
        Ok(Some(Ok(r))) => Ok(r.msg),
    }
}

async fn drive(engine: Arc<Engine>, mut inbound: tonic::Streaming<proto::StreamRequest>, tx: Tx) {
    let began = Instant::now();
    let run_id = ulid::Ulid::new().to_string();
    let mut audit = AuditEvent {
        ts: now_rfc3339(),
        run_id: run_id.clone(),
        mode: "stream",
        namespace: String::new(),
        target: String::new(),
        trigger_point: String::new(),
        chain: None,
        code_hash: None,
        session_id: None,
        sandbox: None,
        baseline: None,
        hooks: vec![],
        host_calls: vec![],
        action: "none",
        terminal_index: None,
        latency_us: 0,
        error: None,
        stream: None,
    };
    let open = match next(&engine, &mut inbound).await {
        Ok(Some(In::Open(o))) => o,
        Ok(_) => {
            let e = EngineError::InvalidArgument("a stream starts with open".into());
            let _ = tx
                .send(Err(engine.refuse(&mut audit, e, began).into()))
                .await;
            return;
        }
        Err(s) => {
            audit.error = Some(s.message().to_string());
            engine.audit.write(&audit);
            return;
        }
    };
    audit.namespace = open.namespace.clone();
    audit.target = open.target.clone();
    audit.trigger_point = open.trigger_point.clone();
    audit.session_id = (!open.session_id.is_empty()).then(|| open.session_id.clone());
    let prepared = (|| {
        let target = engine.target(
            &open.namespace,
            &open.target,
            &open.trigger_point,
            open.context.into_iter().collect(),
            open.session_id,
        )?;
        if !target.key.trigger_point.carries_text() {
            return Err(EngineError::InvalidArgument(format!(
                "{} carries a structured payload; stream text at input or output",
                target.key.trigger_point
            )));
        }
        let chains = engine.resolve_chains(&target.key)?;
        Ok((target, chains))
    })();
    let (target, chains) = match prepared {
        Ok(p) => p,
        Err(e) => {
            let _ = tx
                .send(Err(engine.refuse(&mut audit, e, began).into()))
                .await;
            return;
        }
    };
    chains.describe(&mut audit);
    let chain = chains.main().clone();
    let span = tracing::info_span!("stream", run_id = %run_id, chain = %chain.qualified_name());
    let _guard = span.enter();
    let mut session = match Pipeline::open(&engine, &chains, &target, &run_id).await {
        Ok(s) => s,
        Err(e) => {
            let _ = tx
                .send(Err(engine.refuse(&mut audit, e, began).into()))
                .await;
            return;
        }
    };
    session.record_sandboxes(&mut audit);
    let mut stats = Stats::default();
    let mut raw = String::new();
    let end = stream_path(
        &engine,
        &chains,
        &mut session,
        &mut inbound,
        &tx,
        &mut raw,
        &mut stats,
    )
    .await;
    let final_walk = match end {
        End::Finished => {
            let mut fresh = chains.fresh_states();
            session.walk(Value::String(raw.clone()), &mut fresh).await
        }
        End::Stopped(walk) => walk,
        End::Failed(status) => {
            audit.host_calls = session.host_calls();
            drop(session);
            audit.error = Some(status.message().to_string());
            audit.stream = Some(stream_json(&stats, false));
            audit.latency_us = began.elapsed().as_micros() as u64;
            engine.audit.write(&audit);
            engine
                .metrics
                .runs
                .with_label_values(&[chain.spec.trigger_point.as_str(), "stream", "none"])
                .inc();
            let _ = tx.send(Err(status)).await;
            return;
        }
    };
    audit.host_calls = session.host_calls();
    drop(session);
    let stopped = final_walk.is_terminal();
    audit.stream = Some(stream_json(&stats, stopped));
    engine.finish(&mut audit, &chains, &final_walk, began, "stream");
    let _ = send(&tx, Out::Final(run_response(&run_id, &final_walk))).await;
}

fn stream_json(s: &Stats, stopped: bool) -> Value {
    json!({"chunks": s.chunks, "flushes": s.flushes, "raw_chars": s.raw_chars, "committed_chars": s.committed_chars, "stopped": stopped})
}

/// Runs the stream path until `finish`, a terminal action, or a failure.
async fn stream_path(
    engine: &Engine,
    chains: &Chains,
    session: &mut Pipeline<'_>,
    inbound: &mut tonic::Streaming<proto::StreamRequest>,
    tx: &Tx,
    raw: &mut String,
    stats: &mut Stats,
) -> End {
    // The tenant chain's streaming settings decide the window; a baseline runs on the same batches.
    let spec = &chains.main().spec.streaming;
    let mut window = Window::new(spec.flush_chars as usize, spec.lookback_chars as usize);
    let mut state = chains.fresh_states();
    loop {
        let msg = match next(engine, inbound).await {
            Ok(Some(m)) => m,
            Ok(None) => {
                return End::Failed(Status::cancelled(
                    "the client closed the stream without finish",
                ));
            }
            Err(s) => return End::Failed(s),
        };
        let mut last = false;
        let mut ready = false;
        let mut pending = Some(msg);
        // Take what the client has already sent, up to a bound: when chunks arrive faster than the
        // chain runs, one flush covers them all (batches are never smaller than flushChars).
        while let Some(msg) = pending.take() {
            match msg {
                In::Chunk(text) => {
                    stats.chunks += 1;
                    stats.raw_chars += text.chars().count() as u64;
                    if raw.len() + text.len() > engine.limits.stream_bytes {
                        return End::Failed(Status::resource_exhausted(format!(
                            "the reply is over the limit of {} bytes",
                            engine.limits.stream_bytes
                        )));
                    }
                    raw.push_str(&text);
                    ready |= window.push(&text);
                }
                In::Finish(_) => last = true,
                In::Open(_) => {
                    return End::Failed(Status::invalid_argument("open may be sent only once"));
                }
            }
            if last || !ready || window.pending_len() >= COALESCE_BYTES {
                break;
            }
            match futures::FutureExt::now_or_never(inbound.next()) {
                Some(Some(Ok(proto::StreamRequest { msg: Some(m) }))) => pending = Some(m),
                Some(Some(Err(s))) => {
                    return End::Failed(Status::cancelled(format!(
                        "the client stream failed: {}",
                        s.message()
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
                let walk = session.walk(Value::String(batch), &mut state).await;
                if walk.is_terminal() {
                    let hook = walk
                        .hooks
                        .iter()
                        .rev()
                        .find(|h| Some(h.index) == walk.terminal_index)
                        .map(|h| h.name.clone())
                        .unwrap_or_default();
                    let blocked = proto::StreamBlocked {
                        message: walk.message.clone(),
                        hook,
                    };
                    if let Err(s) = send(tx, Out::Blocked(blocked)).await {
                        return End::Failed(s);
                    }
                    return End::Stopped(walk);
                }
                let text = walk.payload.as_str().unwrap_or_default().to_string();
                window.settle(&text, last)
            }
            None if last => window.release_tail(),
            None => String::new(),
        };
        if !commit.is_empty() {
            stats.committed_chars += commit.chars().count() as u64;
            if let Err(s) = send(tx, Out::Commit(commit)).await {
                return End::Failed(s);
            }
        }
        if last {
            return End::Finished;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_tail_counts_characters_not_bytes() {
        assert_eq!(split_tail("héllo wörld", 3), ("héllo wö", "rld"));
        assert_eq!(split_tail("日本語テキスト", 2), ("日本語テキ", "スト"));
        assert_eq!(split_tail("ab", 5), ("", "ab"));
        assert_eq!(split_tail("ab\r\n", 1), ("ab\r", "\n"));
    }

    #[test]
    fn window_holds_back_the_lookback_and_releases_it_at_the_end() {
        let mut w = Window::new(4, 2);
        assert!(!w.push("ab"));
        assert!(w.push("cd"));
        let batch = w.take_batch().unwrap();
        assert_eq!(batch, "abcd");
        assert_eq!(w.settle(&batch, false), "ab");
        w.push("e");
        assert_eq!(
            w.take_batch().unwrap(),
            "cde",
            "the held-back tail prefixes the next batch"
        );
        assert_eq!(w.settle("cde", true), "cde");
        assert_eq!(w.take_batch(), None);
        assert_eq!(w.release_tail(), "");
    }
}
