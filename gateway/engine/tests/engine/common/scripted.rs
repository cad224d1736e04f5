//! A scripted sandbox backend: an in-process task speaking `supervisor/PROTOCOL.md` over in-memory
//! pipes, answering each `chunk` with whatever lines a script returns. It stands in for a supervisor
//! that misbehaves (results the real one would refuse, summaries that disagree) and for a fast,
//! deterministic chain in property tests.

use async_trait::async_trait;
use serde_json::{Value, json};
use sluice_engine::{Sandbox, SandboxBackend, SandboxHandle, SandboxSpec, StartError};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

/// What a script is asked to answer: one `chunk` of a chain.
pub(crate) struct Chunk<'a> {
    pub id: u64,
    pub start: usize,
    pub outgoing: &'a Value,
    /// The state vector the chunk carries, as the protocol sends it (no script reads it yet).
    #[allow(dead_code)]
    pub state: &'a [Value],
    /// The chain's hooks, as `init` sent them.
    pub hooks: &'a [Value],
}

/// Returns the lines to send for one chunk (`hook_result`s, `host_call`s and the `result`). A line
/// `{"type": "pause", "ms": N}` is not sent: the scripted supervisor waits N ms there, as a hook that
/// runs that long.
pub(crate) type Script = Arc<dyn Fn(&Chunk) -> Vec<Value> + Send + Sync>;

pub(crate) struct ScriptedBackend {
    script: Script,
    seq: AtomicU64,
    protocol: u32,
    dirty: Option<String>,
    host_results: Arc<Mutex<Vec<Value>>>,
    boot_delay: std::time::Duration,
    chunk_delay: std::time::Duration,
    /// Sandboxes started before this many have been are outdated once it has (an upgrade).
    outdated_before: Arc<AtomicU64>,
    /// Answers `end` only once the next request is in (or a few seconds have passed), and notes
    /// in `exchange` what came and went in which order.
    end_waits_for_next: bool,
    exchange: Arc<Mutex<Vec<String>>>,
    /// Holds this many sandboxes per chain, serving or not, as the kube backend's `--kube-hold`.
    holds: Option<usize>,
}

impl ScriptedBackend {
    pub(crate) fn new(script: Script) -> Self {
        Self {
            script,
            seq: AtomicU64::new(0),
            protocol: 3,
            dirty: None,
            host_results: Arc::default(),
            boot_delay: std::time::Duration::ZERO,
            chunk_delay: std::time::Duration::ZERO,
            outdated_before: Arc::default(),
            end_waits_for_next: false,
            exchange: Arc::default(),
            holds: None,
        }
    }

    /// Keeps `n` sandboxes per chain whatever the chain's `pool.warm`, those serving a trigger point
    /// counted (the kube backend's `--kube-hold`).
    pub(crate) fn holds(mut self, n: usize) -> Self {
        self.holds = Some(n);
        self
    }

    /// Answers each `end` only once the next request has arrived (within a few seconds), as a
    /// supervisor far away would seem to a gateway that does not wait for it; `exchange` tells in
    /// which order requests came and answers went.
    pub(crate) fn end_waits_for_next(mut self) -> Self {
        self.end_waits_for_next = true;
        self
    }

    /// What every sandbox received (`got <type>`) and answered to `end` (`sent ended`), in order.
    pub(crate) fn exchange(&self) -> Arc<Mutex<Vec<String>>> {
        self.exchange.clone()
    }

    /// From now on, every sandbox started so far says it is outdated (as pods of an old template
    /// after an upgrade); later ones are current.
    pub(crate) fn upgrade(&self) {
        self.outdated_before
            .store(self.seq.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    /// Takes this long to start each sandbox, like a real boot (without using the CPU).
    pub(crate) fn boot_delay(mut self, delay: std::time::Duration) -> Self {
        self.boot_delay = delay;
        self
    }

    /// Takes this long over each chunk before answering, like a hook at work (on tokio's clock), so
    /// that runs hold their sandboxes for a while.
    pub(crate) fn chunk_delay(mut self, delay: std::time::Duration) -> Self {
        self.chunk_delay = delay;
        self
    }

    /// Every `host_result` the engine answered to a scripted `host_call`, in order.
    pub(crate) fn host_results(&self) -> Arc<Mutex<Vec<Value>>> {
        self.host_results.clone()
    }

    /// Says it speaks this protocol version in its `ready`.
    pub(crate) fn protocol(mut self, version: u32) -> Self {
        self.protocol = version;
        self
    }

    /// Ends every cell with a dirty verdict for this reason.
    pub(crate) fn dirty(mut self, reason: &str) -> Self {
        self.dirty = Some(reason.into());
        self
    }
}

/// The lines an honest supervisor sends for a chain of hooks that each map `outgoing` through `f`
/// (modify when it changed the text, pass otherwise).
pub(crate) fn honest(chunk: &Chunk, f: impl Fn(&str) -> String) -> Vec<Value> {
    let mut text = chunk.outgoing.as_str().unwrap_or_default().to_string();
    let mut lines = Vec::new();
    let mut top = "pass";
    for (index, hook) in chunk.hooks.iter().enumerate().skip(chunk.start) {
        let out = f(&text);
        let name = hook["name"].clone();
        if out != text {
            top = "modify";
            text = out;
            lines.push(json!({"type": "hook_result", "id": chunk.id, "index": index, "name": name, "action": "modify", "outgoing": text}));
        } else {
            lines.push(json!({"type": "hook_result", "id": chunk.id, "index": index, "name": name, "action": "pass"}));
        }
    }
    lines.push(json!({"type": "result", "id": chunk.id, "action": top, "terminal_index": null}));
    lines
}

struct Handle {
    task: tokio::task::JoinHandle<()>,
    seq: u64,
    outdated_before: Arc<AtomicU64>,
}

#[async_trait]
impl SandboxHandle for Handle {
    async fn destroy(&self, _force: bool) {
        self.task.abort();
    }
    fn stdout_bytes(&self) -> u64 {
        0
    }
    fn outdated(&self) -> bool {
        self.seq < self.outdated_before.load(Ordering::Relaxed)
    }
}

#[async_trait]
impl SandboxBackend for ScriptedBackend {
    async fn start(&self, _spec: &SandboxSpec) -> Result<Sandbox, StartError> {
        tokio::time::sleep(self.boot_delay).await;
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let id = format!("scripted-{seq}");
        let (stdin, requests) = tokio::io::duplex(1 << 20);
        let (mut answers, protocol) = tokio::io::duplex(1 << 20);
        let script = self.script.clone();
        let host_results = self.host_results.clone();
        let version = self.protocol;
        let chunk_delay = self.chunk_delay;
        let end_waits_for_next = self.end_waits_for_next;
        let exchange = self.exchange.clone();
        let ended = match &self.dirty {
            Some(reason) => json!({"type": "ended", "clean": false, "reason": reason}),
            None => json!({"type": "ended", "clean": true}),
        };
        let task = tokio::spawn(async move {
            let mut send = async |v: Value| {
                let mut line = serde_json::to_vec(&v).expect("JSON");
                line.push(b'\n');
                answers.write_all(&line).await.is_ok()
            };
            if !send(json!({"type": "ready", "protocol": version})).await {
                return;
            }
            let mut hooks: Vec<Value> = Vec::new();
            let mut lines = BufReader::new(requests).lines();
            let mut pending: Option<String> = None;
            loop {
                let line = match pending.take() {
                    Some(line) => line,
                    None => match lines.next_line().await {
                        Ok(Some(line)) => line,
                        _ => return,
                    },
                };
                let msg: Value = serde_json::from_str(&line).expect("the engine sends JSON");
                exchange
                    .lock()
                    .unwrap()
                    .push(format!("got {}", msg["type"].as_str().unwrap_or("?")));
                match msg["type"].as_str() {
                    Some("init") => {
                        hooks = msg["hooks"].as_array().cloned().unwrap_or_default();
                        let acks: Vec<Value> = hooks
                            .iter()
                            .map(|h| json!({"name": h["name"], "ok": true}))
                            .collect();
                        if !send(json!({"type": "ack", "hooks": acks})).await {
                            return;
                        }
                    }
                    Some("end") => {
                        if end_waits_for_next {
                            let next = std::time::Duration::from_secs(3);
                            if let Ok(Ok(Some(line))) =
                                tokio::time::timeout(next, lines.next_line()).await
                            {
                                let msg: Value = serde_json::from_str(&line).expect("JSON");
                                exchange.lock().unwrap().push(format!(
                                    "got {} (before ended went out)",
                                    msg["type"].as_str().unwrap_or("?")
                                ));
                                pending = Some(line);
                            }
                        }
                        exchange.lock().unwrap().push("sent ended".into());
                        if !send(ended.clone()).await {
                            return;
                        }
                    }
                    Some("chunk") => {
                        tokio::time::sleep(chunk_delay).await;
                        let state = msg["state"].as_array().cloned().unwrap_or_default();
                        let chunk = Chunk {
                            id: msg["id"].as_u64().unwrap_or_default(),
                            start: msg["start"].as_u64().unwrap_or_default() as usize,
                            outgoing: &msg["outgoing"],
                            state: &state,
                            hooks: &hooks,
                        };
                        for answer in script(&chunk) {
                            if answer["type"] == "pause" {
                                let ms = answer["ms"].as_u64().unwrap_or_default();
                                tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
                                continue;
                            }
                            let asks = answer["type"] == "host_call";
                            if !send(answer).await {
                                return;
                            }
                            // Like a hook, wait for the answer before going on.
                            if asks {
                                let Ok(Some(line)) = lines.next_line().await else {
                                    return;
                                };
                                let reply: Value =
                                    serde_json::from_str(&line).expect("the engine sends JSON");
                                assert_eq!(reply["type"], "host_result", "{reply}");
                                host_results.lock().unwrap().push(reply);
                            }
                        }
                    }
                    _ => return,
                }
            }
        });
        Ok(Sandbox {
            id,
            stdin: Box::pin(stdin),
            protocol: Box::pin(protocol),
            handle: Box::new(Handle {
                task,
                seq,
                outdated_before: self.outdated_before.clone(),
            }),
        })
    }

    async fn clean_leftovers(&self) -> usize {
        0
    }

    fn warm_target(&self, chain_warm: usize) -> usize {
        self.holds.unwrap_or(chain_warm)
    }

    fn claimed_count_toward_warm(&self) -> bool {
        self.holds.is_some()
    }

    async fn live(&self) -> Vec<String> {
        Vec::new()
    }
}
