//! The protocol loop: `init` opens a cell (the chain's hooks, compiled), `chunk` walks it with a
//! fresh WebAssembly instance per hook, `end` closes it with a verdict (`supervisor/PROTOCOL.md`).

use std::cell::OnceCell;
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use crate::checks::{
    ACTIONS, ERROR_BYTES, HookError, Limits, TERMINAL, check_result, relayed_text,
};
use crate::clock::Moment;
use crate::deadline::Deadline;
use crate::protocol::{Channel, Incoming};
use crate::relay::{Link, Relay};
use crate::runtime::{CallError, HookCode, Runtime};

pub(crate) const PROTOCOL_VERSION: u64 = 3;

/// The most line numbers of a hook's code `lines` carries (a hook's code is far shorter).
const MAX_LINES: usize = 100_000;

/// The `lines` of an instance's answer under `--trace-lines` (which lines of the hook's code ran,
/// which could have), passed on only in the shape the protocol gives it: `{"run": [n...], "code":
/// [n...]}`, positive line numbers, bounded. The instance runs beside the hook, which can change
/// what it answers: anything else is dropped.
fn lines_of(lines: Value) -> Option<Value> {
    let numbers = |key: &str| -> Option<Vec<u32>> {
        let list = lines.get(key)?.as_array()?;
        if list.len() > MAX_LINES {
            return None;
        }
        list.iter()
            .map(|n| {
                n.as_u64()
                    .filter(|&n| n > 0)
                    .and_then(|n| u32::try_from(n).ok())
            })
            .collect()
    };
    Some(json!({"run": numbers("run")?, "code": numbers("code")?}))
}
const DEFAULT_TIMEOUT_MS: u64 = 2000;
/// Compiled hooks kept across trigger points (a chain's code changes rarely; each entry is the
/// marshalled bytecode of one hook, never a payload).
const LOADED_CACHE_ENTRIES: usize = 256;

/// One hook of the open cell.
struct Hook {
    index: usize,
    name: String,
    action: String,
    settings: Value,
    /// Its compiled code, or why it cannot be called.
    code: Result<HookCode, NotLoaded>,
}

impl Hook {
    fn ack(&self) -> Value {
        let mut out = json!({"name": self.name, "ok": self.code.is_ok()});
        if let Err(error) = &self.code {
            out["error"] = json!(relayed_text(error.to_string(), ERROR_BYTES));
            if let NotLoaded::Refused {
                line: Some(line), ..
            } = error
            {
                out["line"] = json!(line);
            }
        }
        out
    }
}

/// Why a hook of the open cell cannot be called: said in its ack, and as its error in every walk.
#[derive(Clone, Debug, thiserror::Error)]
enum NotLoaded {
    #[error("declared action {0} is not one of modify, block, skip, detect")]
    Action(String),
    /// The cell's runner refused the code (it does not compile, or its module code raised): the
    /// runner's own words, and the line when it names one.
    #[error("{message}")]
    Refused { message: String, line: Option<u64> },
    #[error(
        "its module code did not finish within the chain's spec.timeoutMs ({} ms, for the module code of all its hooks together)",
        .0.as_millis()
    )]
    TimedOut(Duration),
    #[error("its module code failed: {0}")]
    Failed(CallError),
}

impl NotLoaded {
    /// The runner's refusal, a JSON object `{"error": ..., "line": ...}`.
    fn refused(refusal: &str) -> Self {
        let refusal: Value =
            serde_json::from_str(refusal).unwrap_or_else(|_| json!({"error": refusal}));
        NotLoaded::Refused {
            message: refusal["error"]
                .as_str()
                .unwrap_or("the hook's code did not load")
                .to_string(),
            line: refusal["line"].as_u64(),
        }
    }
}

/// A declared action a hook may have: any but `pass`, which is only ever an answer.
fn declared_action(spec: &Value) -> Result<(), NotLoaded> {
    match spec["action"].as_str() {
        Some(action) if action != "pass" && ACTIONS.contains(&action) => Ok(()),
        _ => Err(NotLoaded::Action(
            spec.get("action")
                .map(Value::to_string)
                .unwrap_or_else(|| "None".into()),
        )),
    }
}

struct OpenCell {
    trigger_point: String,
    failure_policy: String,
    limits: Limits,
    timeout: Duration,
    hooks: Vec<Hook>,
    /// When its first walk began: what its hooks' clocks read in every walk of it when the gateway
    /// sends no moment (an older one; `clock`).
    first_walk: OnceCell<Moment>,
}

type Loaded = Result<Arc<Vec<u8>>, NotLoaded>;

/// Why a `chunk` whose `moment_ms` no clock can read is refused.
const BAD_MOMENT: &str = "chunk refused: moment_ms must be a whole number of milliseconds since \
                          the Unix epoch, before the year 2554";

/// The run's moment a `chunk` carries (`moment_ms`); None when it carries none (an older gateway).
fn run_moment(msg: &Value) -> Result<Option<Moment>, &'static str> {
    let Some(ms) = msg.get("moment_ms") else {
        return Ok(None);
    };
    ms.as_u64()
        .and_then(Moment::from_unix_ms)
        .map(Some)
        .ok_or(BAD_MOMENT)
}

/// How long past the chain's deadline `init` waits for its hooks' instances to be prepared before it
/// answers anyway (a hook whose instance is not ready then is instantiated when it runs).
const PREPARE_GRACE: Duration = Duration::from_secs(1);
/// What past the chain's deadline `init` is answered within, all loading and preparing included
/// (below the gateway's 5 s margin).
const ACK_WITHIN: Duration = Duration::from_secs(4);

/// Identifies a hook's name and code together (the compiled-code cache and prepared instances).
fn hook_key(name: &str, code: &str) -> [u8; 32] {
    let mut digest = Sha256::new();
    digest.update(name.as_bytes());
    digest.update([0]);
    digest.update(code.as_bytes());
    digest.finalize().into()
}

/// Under `--trace-lines`, how long after its time is up a hook that did not stop itself is stopped:
/// within the gateway's own grace (500 ms), so the gateway hears the hook's answer.
const TRACE_GRACE: Duration = Duration::from_millis(300);

pub(crate) struct Supervisor {
    runtime: Runtime,
    channel: Arc<Mutex<Channel>>,
    cell: Option<OpenCell>,
    loaded: HashMap<[u8; 32], Loaded>,
    next_host_call: Arc<AtomicU64>,
    /// Each call stops itself at the line it is on shortly before its deadline (`--trace-lines`).
    trace_lines: bool,
}

impl Supervisor {
    pub(crate) fn new(runtime: Runtime, channel: Channel) -> Self {
        Self {
            runtime,
            channel: Arc::new(Mutex::new(channel)),
            cell: None,
            loaded: HashMap::new(),
            next_host_call: Arc::new(AtomicU64::new(0)),
            trace_lines: false,
        }
    }

    /// Authoring tools' mode: a hook that runs out of time is stopped by its own instance just
    /// before the deadline, at the line it is on, so that its error names the line (an endless
    /// loop at line N). Tracing every line makes hooks slower: never in a gateway that serves.
    pub(crate) fn with_trace_lines(mut self, on: bool) -> Self {
        self.trace_lines = on;
        self
    }

    fn send(&self, msg: &Value) {
        let mut channel = self.channel.lock().unwrap_or_else(|e| e.into_inner());
        if channel.send(msg).is_err() {
            std::process::exit(0); // the gateway is gone: nothing is left to answer
        }
    }

    /// Answers requests until the gateway closes the stream or says `shutdown`.
    pub(crate) fn serve(&mut self) {
        self.send(
            &json!({"type": "ready", "protocol": PROTOCOL_VERSION, "pid": std::process::id()}),
        );
        loop {
            let incoming = self
                .channel
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .receive();
            let msg = match incoming {
                Ok(Incoming::Message(msg)) => msg,
                Ok(Incoming::Malformed(why)) => {
                    self.send(&json!({"type": "error", "message": why}));
                    continue;
                }
                Ok(Incoming::Closed) | Err(_) => break,
            };
            match msg["type"].as_str() {
                Some("shutdown") => break,
                Some("init") => self.init(&msg),
                Some("chunk") => self.chunk(&msg),
                Some("end") => self.end(),
                // A keepalive over an idle stream: answered at once, whatever the cell's state.
                Some("ping") => self.send(&json!({"type": "pong"})),
                other => {
                    let shown = other
                        .map(|t| format!("'{t}'"))
                        .unwrap_or_else(|| "None".into());
                    self.send(&json!({"type": "error", "message": format!("unknown request type {shown}")}));
                }
            }
        }
    }

    fn init(&mut self, msg: &Value) {
        if self.cell.is_some() {
            self.send(
                &json!({"type": "error", "message": "init while a cell is open: end it first"}),
            );
            return;
        }
        let timeout = Duration::from_millis(
            msg["timeout_ms"]
                .as_u64()
                .unwrap_or(DEFAULT_TIMEOUT_MS)
                .max(1),
        );
        let opened = Instant::now();
        let specs = msg["hooks"].as_array().cloned().unwrap_or_default();
        let mut hooks = Vec::with_capacity(specs.len());
        // All hooks' module code together runs within the chain's deadline, as a walk's hooks do.
        let mut left = timeout;
        for (index, spec) in specs.iter().enumerate() {
            let began = Instant::now();
            let hook = self.open_hook(index, spec, left, timeout);
            // A hook that ran out of time has failed; the hooks after it get the whole deadline
            // again, as in a walk.
            left = match &hook.code {
                Err(NotLoaded::TimedOut(_)) => timeout,
                _ => left.saturating_sub(began.elapsed()),
            };
            hooks.push(hook);
        }
        // Each hook gets an instance with its module code run before the trigger point needs it, so
        // a walk only calls `execute`. Under `--trace-lines` every call runs unprepared, its module
        // code traced too.
        if !self.trace_lines {
            // The gateway waits for the ack up to the deadline + 5 s: answer within that.
            let wait = (timeout + PREPARE_GRACE)
                .min((timeout + ACK_WITHIN).saturating_sub(opened.elapsed()));
            self.runtime.prepare(
                hooks.iter().filter_map(|h| h.code.clone().ok()).collect(),
                wait,
            );
        }
        let ack = json!({"type": "ack", "hooks": hooks.iter().map(Hook::ack).collect::<Vec<_>>()});
        self.cell = Some(OpenCell {
            trigger_point: msg["trigger_point"].as_str().unwrap_or("").to_string(),
            failure_policy: msg["failure_policy"]
                .as_str()
                .unwrap_or("Closed")
                .to_string(),
            limits: Limits::from_init(&msg["limits"]),
            timeout,
            hooks,
            first_walk: OnceCell::new(),
        });
        self.send(&ack);
    }

    /// One hook of a new cell, set up step by step:
    /// 1. its declaration: name (or its place), declared action, settings;
    /// 2. the declared action is one a hook may have;
    /// 3. its code compiled, or found compiled, its module code run within `left` of the chain's
    ///    deadline (`timeout`).
    fn open_hook(&mut self, index: usize, spec: &Value, left: Duration, timeout: Duration) -> Hook {
        let name = spec["name"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| format!("hook-{index}"));
        let action = spec["action"].as_str().unwrap_or("").to_string();
        let settings = spec
            .get("settings")
            .cloned()
            .filter(|s| !s.is_null())
            .unwrap_or_else(|| json!({}));
        let code = declared_action(spec).and_then(|()| {
            let text = spec["code"].as_str().unwrap_or("");
            let key = hook_key(&name, text);
            Ok(HookCode {
                key,
                name: name.clone(),
                code: self.load(key, &name, text, left, timeout)?,
                timeout,
            })
        });
        Hook {
            index,
            name,
            action,
            settings,
            code,
        }
    }

    /// A hook's compiled code: from the cache when this exact code was loaded before, else compiled
    /// (and its module code run once, as a check) in a fresh instance.
    /// `left` is what remains of the chain's deadline (`timeout`) for this hook's module code.
    fn load(
        &mut self,
        key: [u8; 32],
        name: &str,
        code: &str,
        left: Duration,
        timeout: Duration,
    ) -> Loaded {
        if let Some(found) = self.loaded.get(&key) {
            return found.clone();
        }
        if left.is_zero() {
            return Err(NotLoaded::TimedOut(timeout));
        }
        let loaded = match self.runtime.load_hook(name, code, left) {
            Ok(Ok(compiled)) => Ok(Arc::new(compiled)),
            Ok(Err(refusal)) => Err(NotLoaded::refused(&refusal)),
            // A load that ran out of time or memory says so; it is not cached (it may pass later).
            Err(CallError::Deadline) => return Err(NotLoaded::TimedOut(timeout)),
            Err(e) => return Err(NotLoaded::Failed(e)),
        };
        if self.loaded.len() >= LOADED_CACHE_ENTRIES {
            self.loaded.clear();
        }
        self.loaded.insert(key, loaded.clone());
        loaded
    }

    fn chunk(&mut self, msg: &Value) {
        let Some(cell) = self.cell.as_ref() else {
            self.send(
                &json!({"type": "error", "message": "chunk without an open cell: send init first"}),
            );
            return;
        };
        // Hooks of one run cannot time each other: their clocks stand at the run's moment, the
        // same in every walk of it whichever sandbox serves it; from a gateway that sends none (an
        // older one), at the start of the cell's first walk, as before.
        let at = match run_moment(msg) {
            Ok(Some(at)) => at,
            Ok(None) => *cell.first_walk.get_or_init(Moment::now),
            Err(why) => {
                self.send(&json!({"type": "error", "message": why}));
                return;
            }
        };
        self.runtime
            .stand_clocks_at((!self.trace_lines).then_some(at));
        let run = msg["id"].clone();
        let mut payload = msg["outgoing"].clone();
        let states = msg["state"].as_array().cloned().unwrap_or_default();
        let context = msg
            .get("context")
            .cloned()
            .filter(Value::is_object)
            .unwrap_or_else(|| json!({}));
        let start = msg["start"].as_u64().unwrap_or(0) as usize;
        self.runtime.walk_begins(
            cell.hooks
                .iter()
                .skip(start)
                .filter_map(|h| h.code.as_ref().ok().map(|c| &c.key)),
        );
        let budget = Arc::new(AtomicU64::new(cell.limits.host_calls));
        let mut terminal = Value::Null;
        let mut top = "pass".to_string();
        let mut began = Instant::now();
        // One deadline model on both sides (PROTOCOL.md, "Deadlines"): the walk's hooks share the
        // chain's deadline, counted from here on the wall clock, the supervisor's own work between
        // them included and time waiting for host_results not; a hook that runs out of it has
        // failed, and the hooks after it share a fresh one. The gateway counts the same way.
        let mut deadline = self.walk_deadline(cell);
        for hook in cell.hooks.iter().skip(start) {
            // The previous hook's result goes out before this hook runs, so that if this one takes
            // the sandbox down the gateway still knows how far the walk got.
            let _ = self
                .channel
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .flush();
            let mut result = Map::new();
            result.insert("type".into(), json!("hook_result"));
            result.insert("id".into(), run.clone());
            result.insert("index".into(), json!(hook.index));
            result.insert("name".into(), json!(hook.name));
            let state = states.get(hook.index).cloned().unwrap_or(Value::Null);
            let link = Link {
                channel: self.channel.clone(),
                run: run.clone(),
                hook: hook.index,
                limits: cell.limits,
                budget: budget.clone(),
                next_id: self.next_host_call.clone(),
            };
            match self.call(
                cell,
                hook,
                (&payload, state, &context),
                Relay::new(link),
                &deadline,
                &mut result,
            ) {
                Ok(fields) => result.extend(fields),
                Err(HookError(error)) => {
                    result.insert("action".into(), json!("pass"));
                    result.insert("error".into(), json!(relayed_text(error, ERROR_BYTES)));
                }
            }
            if deadline.expired() {
                // The gateway starts afresh when told, whatever its own clock says.
                result.insert("ran_out".into(), json!(true));
                deadline.disarm();
                deadline = self.walk_deadline(cell);
            }
            let ended = Instant::now();
            result.insert(
                "latency_us".into(),
                json!((ended - began).as_micros() as u64),
            );
            began = ended;
            let failed = result.contains_key("error");
            let action = result["action"].as_str().unwrap_or("pass").to_string();
            if action == "modify" {
                payload = result["outgoing"].clone();
            }
            let _ = self
                .channel
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .queue(&Value::Object(result));
            if failed {
                if cell.failure_policy == "Open" {
                    continue;
                }
                terminal = json!(hook.index);
                top = "block".into();
                break;
            }
            if TERMINAL.contains(&action.as_str()) {
                terminal = json!(hook.index);
                top = action;
                break;
            }
            if action == "modify" || (action == "detect" && top == "pass") {
                top = action;
            }
        }
        deadline.disarm();
        self.send(&json!({"type": "result", "id": run, "action": top, "terminal_index": terminal}));
        self.runtime.walk_ended();
    }

    /// The deadline a walk's hooks share, from now. Under `--trace-lines` the hard deadline is
    /// `TRACE_GRACE` later, for a hook that does not stop itself.
    fn walk_deadline(&self, cell: &OpenCell) -> Deadline {
        let grace = if self.trace_lines {
            TRACE_GRACE
        } else {
            Duration::ZERO
        };
        self.runtime.arm(cell.timeout + grace)
    }

    /// Runs one hook in a fresh instance; the fields of its `hook_result`, or its error. What the
    /// hook wrote goes into `output` either way.
    fn call(
        &self,
        cell: &OpenCell,
        hook: &Hook,
        (payload, state, context): (&Value, Value, &Value),
        relay: Relay,
        deadline: &Deadline,
        output: &mut Map<String, Value>,
    ) -> Result<Map<String, Value>, HookError> {
        let code = hook
            .code
            .as_ref()
            .map_err(|why| HookError(why.to_string()))?;
        let mut request = json!({"outgoing": payload, "state": state, "context": context, "settings": hook.settings});
        // Under `--trace-lines` the instance stops itself when the time left is up, at the line it
        // is on; the hard deadline comes `TRACE_GRACE` later, for a hook that does not stop.
        if self.trace_lines {
            let left = deadline.left().unwrap_or_default();
            request["trace_s"] = json!(left.saturating_sub(TRACE_GRACE).as_secs_f64());
        }
        let request = request.to_string();
        let called =
            self.runtime
                .call_hook(code, &request, relay, deadline, cell.limits.answer_bytes());
        if let Some(text) = called.output {
            output.insert("output".into(), json!(text));
        }
        let answer = called.answer.map_err(|e| match e {
            CallError::Deadline => HookError(format!(
                "timed out after {} ms: an endless loop or slow code (the chain's spec.timeoutMs is {} ms for the whole chain, \
                 time in host_calls not counted); fix the loop, make the hook faster or raise spec.timeoutMs",
                cell.timeout.as_millis(),
                cell.timeout.as_millis()
            )),
            other => HookError(other.to_string()),
        })?;
        let mut answer: Value = serde_json::from_str(&answer)
            .map_err(|e| HookError(format!("the hook's instance answered malformed JSON: {e}")))?;
        if self.trace_lines
            && let Some(lines) = answer.get_mut("lines").map(Value::take).and_then(lines_of)
        {
            output.insert("lines".into(), lines);
        }
        if let Some(error) = answer.get_mut("error").map(Value::take) {
            return Err(HookError(match error {
                Value::String(error) => error,
                other => other.to_string(),
            }));
        }
        check_result(
            &hook.action,
            &cell.trigger_point,
            &cell.limits,
            answer
                .get_mut("value")
                .map(Value::take)
                .unwrap_or(Value::Null),
        )
    }

    /// Closes the cell. Each instance that served it was entered for one call and is never entered
    /// again (the preparer resets it), so the sandbox is clean.
    fn end(&mut self) {
        self.cell = None;
        self.send(&json!({"type": "ended", "clean": true}));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_lines_in_the_protocols_shape_are_passed_on() {
        let ok = json!({"run": [1, 3], "code": [1, 2, 3], "extra": "dropped"});
        assert_eq!(
            lines_of(ok),
            Some(json!({"run": [1, 3], "code": [1, 2, 3]}))
        );
        for bad in [
            json!({"run": [1]}),
            json!({"run": [0], "code": [1]}),
            json!({"run": [-1], "code": [1]}),
            json!({"run": ["1"], "code": [1]}),
            json!({"run": [1.5], "code": [1]}),
            json!({"run": [1], "code": [1u64 << 40]}),
            json!({"run": vec![1; MAX_LINES + 1], "code": [1]}),
            json!([1, 2]),
        ] {
            assert_eq!(lines_of(bad.clone()), None, "{bad}");
        }
    }
}
