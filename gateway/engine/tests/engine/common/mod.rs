//! What the engine tests share: an engine on the process backend (the real supervisor as a plain
//! child process) or on a scripted one, chains written as JSON specs, a fake `Capabilities`, and the
//! audit lines the engine wrote.

pub(crate) mod dying;
pub(crate) mod scripted;

use async_trait::async_trait;
use futures::StreamExt;
use serde_json::{Value, json};
use sluice_crds::definition::{Definition, Origin, Spec};
use sluice_engine::{
    Audit, AuditHostCall, Caller, Capabilities, Chain, ClientStreamError, Engine, EngineError,
    HostCallError, HostCalls, Limits, Metrics, Pools, Registry, RunInput, RunResult,
    SandboxBackend, StreamError, StreamInput, StreamOpen, StreamOutput,
};
use sluice_sandbox_process::ProcessBackend;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub(crate) const NS: &str = "team";
pub(crate) const TARGET: &str = "bot";
pub(crate) const PLATFORM: &str = "sluice-system";

/// A hook of a chain spec.
pub(crate) fn hook(name: &str, action: &str, code: &str) -> Value {
    json!({"name": name, "action": action, "code": code})
}

/// A hook whose `execute` is `body` (indented by four spaces).
pub(crate) fn py(name: &str, action: &str, body: &str) -> Value {
    let code = format!(
        "def execute(context, settings):\n{}",
        body.lines()
            .map(|l| format!("    {l}\n"))
            .collect::<String>()
    );
    hook(name, action, &code)
}

/// A tenant chain of `NS` for `TARGET`; `extra` fields are merged into its spec.
pub(crate) fn tenant(trigger_point: &str, hooks: Vec<Value>, extra: Value) -> Definition {
    chain(NS, "tenant", TARGET, trigger_point, hooks, extra)
}

/// An enforced baseline of the platform namespace.
pub(crate) fn baseline(trigger_point: &str, hooks: Vec<Value>) -> Definition {
    baseline_with(trigger_point, hooks, json!({}))
}

/// An enforced baseline of the platform namespace; `extra` fields are merged into its spec.
pub(crate) fn baseline_with(
    trigger_point: &str,
    hooks: Vec<Value>,
    mut extra: Value,
) -> Definition {
    extra["enforced"] = json!(true);
    chain(PLATFORM, "baseline", "*", trigger_point, hooks, extra)
}

pub(crate) fn chain(
    namespace: &str,
    name: &str,
    target: &str,
    trigger_point: &str,
    hooks: Vec<Value>,
    extra: Value,
) -> Definition {
    let mut spec = json!({
        "target": target, "triggerPoint": trigger_point, "hooks": hooks,
        "pool": {"warm": 1, "max": 8}, "timeoutMs": 5000,
    });
    if let (Some(s), Some(e)) = (spec.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            s.insert(k.clone(), v.clone());
        }
    }
    Definition {
        origin: Origin {
            file: format!("{name}.yaml").into(),
            line: 1,
        },
        namespace: namespace.into(),
        name: name.into(),
        spec: Spec::HookChain(Box::new(
            serde_json::from_value(spec).expect("a valid HookChain spec"),
        )),
        superseded: None,
        code_lines: Vec::new(),
        orders: Default::default(),
        directed: None,
    }
}

/// Audit lines as the engine wrote them.
#[derive(Clone, Default)]
pub(crate) struct AuditLines(Arc<Mutex<Vec<u8>>>);

impl Write for AuditLines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl AuditLines {
    /// Everything written, as text.
    pub(crate) fn raw(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }

    pub(crate) fn events(&self) -> Vec<Value> {
        let bytes = self.0.lock().unwrap().clone();
        String::from_utf8(bytes)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).expect("audit lines are JSON"))
            .collect()
    }
}

/// One host_call as the fake saw it.
#[derive(Clone, Debug)]
pub(crate) struct SeenCall {
    pub chain: String,
    pub hook: usize,
    pub name: String,
    pub payload: Value,
    pub caller: Caller,
}

/// Capabilities for tests: `echo` answers `{"echo": payload}`, `sleep` waits `payload.ms`, `deny`
/// refuses, anything else is unknown. Every call is recorded.
#[derive(Clone, Default)]
pub(crate) struct FakeCapabilities {
    pub seen: Arc<Mutex<Vec<SeenCall>>>,
}

struct FakeRun {
    chain: Arc<Chain>,
    caller: Caller,
    seen: Arc<Mutex<Vec<SeenCall>>>,
    /// One record per call, as the capability runner keeps them.
    records: Mutex<Vec<AuditHostCall>>,
}

#[derive(Debug, thiserror::Error)]
#[error("denied by the test: {0}")]
struct Denied(String);

#[async_trait]
impl HostCalls for FakeRun {
    async fn call(&self, hook: usize, name: &str, payload: Value) -> Result<Value, HostCallError> {
        self.seen.lock().unwrap().push(SeenCall {
            chain: self.chain.qualified_name(),
            hook,
            name: name.into(),
            payload: payload.clone(),
            caller: self.caller.clone(),
        });
        let answer = match name {
            "echo" => Ok(json!({"echo": payload})),
            "sleep" => {
                let ms = payload["ms"].as_u64().unwrap_or_default();
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Ok(json!({"slept": ms}))
            }
            "deny" => Err(HostCallError::Refused {
                code: sluice_engine::HostCallCode::Denied,
                error: Box::new(Denied(name.into())),
            }),
            other => Err(HostCallError::Unavailable(other.into())),
        };
        self.records.lock().unwrap().push(AuditHostCall {
            hook: self
                .chain
                .spec
                .hooks
                .get(hook)
                .map(|h| h.name.clone())
                .unwrap_or_default(),
            capability: name.into(),
            gates: vec![],
            consumed: None,
            latency_us: 1,
            error: answer.as_ref().err().map(|e| e.to_string()),
        });
        answer
    }

    fn audit(&self) -> Vec<AuditHostCall> {
        self.records.lock().unwrap().clone()
    }
}

impl Capabilities for FakeCapabilities {
    fn for_run(
        &self,
        _registry: Arc<Registry>,
        chain: Arc<Chain>,
        caller: Caller,
    ) -> Arc<dyn HostCalls> {
        Arc::new(FakeRun {
            chain,
            caller,
            seen: self.seen.clone(),
            records: Mutex::default(),
        })
    }
}

pub(crate) struct Harness {
    pub engine: Arc<Engine>,
    pub audit: AuditLines,
    pub capabilities: FakeCapabilities,
}

/// The engine's log lines at info and above go to the test's captured output, which the test
/// runner shows only when the test fails: why a sandbox was retired, why a boot failed.
pub(crate) fn show_logs_on_failure() {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(tracing_subscriber::EnvFilter::new(
            "sluice=info,sluice_engine=info",
        ))
        .try_init();
}

/// Limits for tests: a sandbox should always be there quickly.
pub(crate) fn limits() -> Limits {
    Limits {
        claim_timeout: Duration::from_secs(20),
        boot_timeout: Duration::from_secs(20),
        stream_idle: Duration::from_secs(20),
        ..Limits::default()
    }
}

/// The process backend: the real `sluice-supervisor` and its cell runtime, as `make cell` builds
/// them into `target/debug`. Without them the test stops naming the file it looked for and the
/// command that makes it (a fresh clone has neither until `make cell` runs).
pub(crate) fn process_backend() -> ProcessBackend {
    ProcessBackend::new().unwrap_or_else(|e| {
        panic!("the engine tests run the real supervisor as a child process: {e}")
    })
}

impl Harness {
    /// An engine serving `definitions` from supervisors run as child processes.
    pub(crate) async fn process(definitions: Vec<Definition>) -> Self {
        let backend = process_backend();
        Self::with_backend(Arc::new(backend), definitions, limits()).await
    }

    pub(crate) async fn with_backend(
        backend: Arc<dyn SandboxBackend>,
        definitions: Vec<Definition>,
        limits: Limits,
    ) -> Self {
        Self::with_boots(backend, definitions, limits, 4).await
    }

    /// An engine whose pools boot at most `boot_concurrency` sandboxes at once.
    pub(crate) async fn with_boots(
        backend: Arc<dyn SandboxBackend>,
        definitions: Vec<Definition>,
        limits: Limits,
        boot_concurrency: usize,
    ) -> Self {
        show_logs_on_failure();
        let metrics = Metrics::new();
        let audit = AuditLines::default();
        let capabilities = FakeCapabilities::default();
        let pools = Pools::new(backend, limits.clone(), metrics.clone(), boot_concurrency);
        let engine = Engine::new(
            pools,
            Audit::new(Box::new(audit.clone())),
            metrics,
            limits,
            Arc::new(capabilities.clone()),
        );
        let registry = Registry::build_for(
            PLATFORM,
            definitions,
            vec![],
            &sluice_crds::signing::Policy::default(),
        );
        // Capabilities are the fake's, not the registry's: hooks listing them are reported, and served.
        let errors: Vec<_> = registry
            .errors()
            .iter()
            .filter(|e| !e.message.contains("will fail until it does"))
            .collect();
        assert!(errors.is_empty(), "{errors:?}");
        engine.set_registry(registry).await;
        Self {
            engine,
            audit,
            capabilities,
        }
    }

    /// Runs `payload` through the tenant target at `trigger_point`.
    pub(crate) async fn run(
        &self,
        trigger_point: &str,
        payload: Value,
    ) -> Result<RunResult, EngineError> {
        self.run_at(TARGET, trigger_point, payload).await
    }

    /// Serves `definitions` from now on, as a changed chain directory or cluster would.
    pub(crate) async fn apply(&self, definitions: Vec<Definition>) {
        let registry = Registry::build_for(
            PLATFORM,
            definitions,
            vec![],
            &sluice_crds::signing::Policy::default(),
        );
        self.engine.set_registry(registry).await;
    }

    /// Runs `payload` through the tenant target at `trigger_point`, for `session`.
    pub(crate) async fn run_session(
        &self,
        trigger_point: &str,
        payload: Value,
        session: &str,
    ) -> Result<RunResult, EngineError> {
        self.engine
            .run(RunInput {
                namespace: NS.into(),
                target: TARGET.into(),
                trigger_point: trigger_point.into(),
                payload: Some(payload),
                session_id: session.into(),
                ..Default::default()
            })
            .await
    }

    /// Runs `payload` through `target` of `NS` at `trigger_point`.
    pub(crate) async fn run_at(
        &self,
        target: &str,
        trigger_point: &str,
        payload: Value,
    ) -> Result<RunResult, EngineError> {
        self.engine
            .run(RunInput {
                namespace: NS.into(),
                target: target.into(),
                trigger_point: trigger_point.into(),
                payload: Some(payload),
                context: [("user_id".to_string(), "u-1".to_string())].into(),
                session_id: "s-1".into(),
                ..Default::default()
            })
            .await
    }

    /// Streams `chunks` at `output` and collects everything the engine answered.
    pub(crate) async fn stream(&self, chunks: &[&str]) -> Streamed {
        let mut inputs = vec![StreamInput::Open(self.open("output"))];
        inputs.extend(chunks.iter().map(|c| StreamInput::Chunk(c.to_string())));
        inputs.push(StreamInput::Finish);
        self.stream_inputs(inputs).await
    }

    pub(crate) fn open(&self, trigger_point: &str) -> StreamOpen {
        StreamOpen {
            namespace: NS.into(),
            target: TARGET.into(),
            trigger_point: trigger_point.into(),
            context: Default::default(),
            session_id: "s-1".into(),
            ..Default::default()
        }
    }

    /// Streams `inputs` as a client slower than the chain: each message is run before the next
    /// arrives (no two chunks share a flush unless the window asks for more).
    pub(crate) async fn stream_inputs(&self, inputs: Vec<StreamInput>) -> Streamed {
        collect(self.engine.stream(Paced::new(inputs))).await
    }

    /// Streams `inputs` as a client ahead of the chain: everything is waiting from the start.
    pub(crate) async fn stream_all_at_once(&self, inputs: Vec<StreamInput>) -> Streamed {
        let inputs = futures::stream::iter(inputs.into_iter().map(Ok::<_, ClientStreamError>));
        collect(self.engine.stream(inputs)).await
    }
}

/// A client that is slower than the chain: each message is not there on the first look (the
/// engine's "is more already waiting?"), only when the engine waits for it.
pub(crate) struct Paced {
    items: std::collections::VecDeque<StreamInput>,
    armed: bool,
}

impl Paced {
    pub(crate) fn new(items: Vec<StreamInput>) -> Self {
        Self {
            items: items.into(),
            armed: false,
        }
    }
}

impl futures::Stream for Paced {
    type Item = Result<StreamInput, ClientStreamError>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        if !self.armed {
            self.armed = true;
            cx.waker().wake_by_ref();
            return std::task::Poll::Pending;
        }
        self.armed = false;
        std::task::Poll::Ready(self.items.pop_front().map(Ok))
    }
}

/// Everything one stream answered, in order.
#[derive(Debug, Default)]
pub(crate) struct Streamed {
    pub commits: Vec<String>,
    pub blocked: Option<(String, String)>,
    /// Commits that arrived after the block (there must be none).
    pub commits_after_block: usize,
    pub final_: Option<RunResult>,
    pub error: Option<StreamError>,
}

pub(crate) async fn collect(
    outputs: impl futures::Stream<Item = Result<StreamOutput, StreamError>>,
) -> Streamed {
    let mut s = Streamed::default();
    let mut outputs = std::pin::pin!(outputs);
    while let Some(out) = outputs.next().await {
        match out {
            Ok(StreamOutput::Commit(c)) => {
                if s.blocked.is_some() {
                    s.commits_after_block += 1;
                }
                s.commits.push(c);
            }
            Ok(StreamOutput::Blocked { message, hook }) => s.blocked = Some((message, hook)),
            Ok(StreamOutput::Final(r)) => s.final_ = Some(r),
            Err(e) => s.error = Some(e),
        }
    }
    s
}
