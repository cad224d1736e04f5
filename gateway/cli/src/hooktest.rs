//! `sluice test` and `sluice run`: chains run in the same local gVisor sandboxes the gateway uses, by
//! an in-process gateway on a loopback port. No Capability's own endpoint is ever called (the files
//! may come from anyone): each answers from a canned stub, or, without one, with an error that says
//! how to stub it.
//!
//! A test file (YAML):
//!
//! ```yaml
//! chains: [../pii-redaction.yaml]        # relative to this file
//! capabilities:                          # stubs: a canned result, or an error the hook sees
//!   llm.run: {result: {text: "Summary."}}
//!   credit.check: {error: "no credit"}
//!   credit.charge: {denied: "no credit left"}   # a gate says no: HostCallError code "denied"
//! cases:
//!   - name: redacts a phone number
//!     target: support-bot
//!     triggerPoint: input                # default input
//!     text: "call 010-1234-5678"         # or value: {...} for the agent-loop points
//!     context: {user_id: u-1}
//!     expect:
//!       action: modify
//!       text: "call [phone]"
//!       contains: ["[phone]"]
//!       message: "..."
//!       hooks: {redact-phone: modify}
//!   - name: streams
//!     target: support-bot
//!     triggerPoint: output
//!     chunks: ["call 010-", "1234-5678 now"]
//!     expect: {commits: ["call [phone] now"], text: "call [phone] now"}
//! ```

use serde::Deserialize;
use serde_json::{Value, json};
use sluice_gateway::{LocalOptions, RunningGateway, start_local};
use sluice_proto::convert::{from_proto, to_proto};
use sluice_proto::{self as proto, gateway_client::GatewayClient};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TestFile {
    #[serde(default)]
    pub chains: Vec<PathBuf>,
    #[serde(default)]
    pub capabilities: BTreeMap<String, Stub>,
    pub cases: Vec<Case>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Stub {
    #[serde(default)]
    pub result: Value,
    /// The call fails (`HostCallError` code `unavailable`) with this text.
    #[serde(default)]
    pub error: Option<String>,
    /// A gate refuses the call with this reason (`HostCallError` code `denied`): no credit, say.
    #[serde(default)]
    pub denied: Option<String>,
}

impl Stub {
    /// The gate a `denied` stub is given: a capability of its own whose answer is the refusal.
    fn gate(name: &str) -> String {
        format!("{name}.stub-gate")
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Case {
    pub name: String,
    pub target: String,
    #[serde(default = "input")]
    pub trigger_point: String,
    #[serde(default = "default_ns")]
    pub namespace: String,
    #[serde(default)]
    pub text: Option<String>,
    #[serde(default)]
    pub value: Option<Value>,
    #[serde(default)]
    pub chunks: Option<Vec<String>>,
    #[serde(default)]
    pub context: BTreeMap<String, String>,
    pub expect: Expect,
}

fn input() -> String {
    "input".into()
}
fn default_ns() -> String {
    "default".into()
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    pub action: Option<String>,
    pub text: Option<String>,
    pub value: Option<Value>,
    #[serde(default)]
    pub contains: Vec<String>,
    #[serde(default)]
    pub excludes: Vec<String>,
    pub message: Option<String>,
    #[serde(default)]
    pub hooks: BTreeMap<String, String>,
    /// Hook name → a piece of its expected error.
    #[serde(default)]
    pub errors: BTreeMap<String, String>,
    pub commits: Option<Vec<String>>,
    pub blocked: Option<bool>,
}

/// What one run gave back, as `sluice run` prints it and `sluice test` compares it.
/// Why a case got no answer from the local gateway.
#[derive(Debug, thiserror::Error)]
pub enum CaseError {
    #[error("the case needs text, value or chunks")]
    NoPayload,
    #[error("{0}")]
    NotOpened(String),
    #[error("{code:?}: {message}")]
    Refused { code: tonic::Code, message: String },
}

impl CaseError {
    fn refused(s: tonic::Status) -> Self {
        Self::Refused {
            code: s.code(),
            message: s.message().to_string(),
        }
    }
}

pub fn response_json(r: &proto::RunResponse) -> Value {
    let action = |a: i32| {
        proto::Action::try_from(a)
            .map(|a| a.as_str_name().to_lowercase())
            .unwrap_or_default()
    };
    let payload = match &r.payload {
        Some(proto::run_response::Payload::Text(t)) => json!({"text": t}),
        Some(proto::run_response::Payload::Value(v)) => {
            json!({"value": from_proto(v)})
        }
        None => Value::Null,
    };
    // A hook that failed took no action: it reads as "error" (never as the "pass" the gRPC enum
    // carries beside its error), and every failure is listed at the top, where it is seen first.
    let errors: Vec<Value> = r
        .hooks
        .iter()
        .filter(|h| !h.error.is_empty())
        .map(|h| json!({"hook": h.name, "error": h.error}))
        .collect();
    let mut out = json!({
        "run_id": r.run_id,
        "action": action(r.action),
        "payload": payload,
        "message": r.message,
        "terminal_index": r.terminal_index,
        "hooks": r.hooks.iter().map(|h| {
            let failed = !h.error.is_empty();
            let mut o = json!({
                "name": h.name,
                "action": if failed { "error".to_string() } else { action(h.action) },
                "message": h.message,
                "findings": h.findings.as_ref().map(from_proto),
                "latency_us": h.latency_us,
            });
            if failed {
                o["error"] = json!(h.error);
            }
            if !h.output.is_empty() {
                o["output"] = json!(h.output);
            }
            o
        }).collect::<Vec<_>>(),
    });
    if !errors.is_empty() {
        out["errors"] = Value::Array(errors);
    }
    out
}

/// How much of what each hook printed (its end) `sluice test` and `sluice run` show.
pub(crate) const HOOK_OUTPUT_BYTES: usize = 4096;

/// An in-process gateway over the given chain files, with stubbed capabilities.
pub struct Local {
    pub gateway: RunningGateway,
    pub client: GatewayClient<tonic::transport::Channel>,
    _dir: tempfile::TempDir,
    _state: tempfile::TempDir,
    stubs: Option<tokio::task::JoinHandle<()>>,
    /// The gateway serves copies of the chain files: (copy, original), so that file:line in errors
    /// can name the file the author edits.
    copies: Vec<(PathBuf, PathBuf)>,
}

/// `text` with every copy's path replaced by its original's.
fn originals(copies: &[(PathBuf, PathBuf)], text: &str) -> String {
    copies.iter().fold(text.to_string(), |t, (copy, original)| {
        t.replace(&copy.display().to_string(), &original.display().to_string())
    })
}

impl Local {
    /// Serves `files` with every Capability's endpoint pointed at a stub on loopback: the stub's
    /// canned answer where `stubs` has one, else an error saying how to stub it. A chain under test
    /// may come from anyone (a pull request), so nothing it names is ever called.
    pub async fn start(
        files: &[PathBuf],
        stubs: &BTreeMap<String, Stub>,
        gvisor: bool,
    ) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let mut answers = StubAnswers::default();
        let mut copies = Vec::new();
        for (i, f) in files.iter().enumerate() {
            let text =
                std::fs::read_to_string(f).map_err(|e| anyhow::anyhow!("{}: {e}", f.display()))?;
            // One copy per document, each at its line in the original, so file:line in errors
            // still points into the file the author edits.
            for (j, (line, doc)) in sluice_crds::manifest::documents(&text).iter().enumerate() {
                let copy = dir.path().join(format!("{i:03}-{j:03}.yaml"));
                let stubbed = |name: &str| stubs.get(name).cloned();
                let routed = |name: &str| answers.route(addr, name, stubs);
                let served = match stubbed_capability(doc, stubbed, routed) {
                    Some(json) => format!("{}{json}\n", "\n".repeat(line.saturating_sub(1))),
                    None => doc.clone(),
                };
                std::fs::write(&copy, served)?;
                copies.push((copy, f.clone()));
            }
        }
        // Stubs of capabilities the files do not define are served as capabilities of their own,
        // and a `denied` stub's gate as one more, answering with the refusal.
        let mut yaml = String::new();
        let capability = |name: &str, url: &str, gates: &str| {
            format!(
                "---\napiVersion: sluice.dev/v1alpha1\nkind: Capability\nmetadata: {{name: {name:?}, namespace: default}}\nspec: {{endpoint: {{http: {url:?}}}, timeoutMs: 5000{gates}}}\n"
            )
        };
        for (name, stub) in stubs {
            let gates = match stub.denied {
                Some(_) => format!(", gates: [{:?}]", Stub::gate(name)),
                None => String::new(),
            };
            if !answers.defines(name) {
                let url = answers.route(addr, name, stubs);
                yaml.push_str(&capability(name, &url, &gates));
            }
            if let Some(reason) = &stub.denied {
                let gate = Stub::gate(name);
                let refusal = Stub {
                    result: json!({"allow": false, "reason": reason}),
                    error: None,
                    denied: None,
                };
                let url = answers.route(addr, &gate, &BTreeMap::from([(gate.clone(), refusal)]));
                yaml.push_str(&capability(&gate, &url, ""));
            }
        }
        let stubs_file = dir.path().join("zz-stubs.yaml");
        std::fs::write(&stubs_file, yaml)?;
        copies.push((
            stubs_file,
            PathBuf::from("(the stubs under the test file's capabilities:)"),
        ));
        let stub_task = Some(tokio::spawn(serve_stubs(listener, Arc::new(answers))));
        let state = tempfile::Builder::new()
            .prefix("sluice-cli")
            .tempdir_in("/tmp")?;
        let mut opts = LocalOptions::new(dir.path(), state.path());
        opts.limits.claim_timeout = std::time::Duration::from_secs(60);
        // What hooks print is shown to their author: in `sluice run`'s answers and under a failing
        // case of `sluice test`.
        opts.limits.hook_output_bytes = HOOK_OUTPUT_BYTES;
        opts.gvisor = gvisor;
        // An author's hook that runs out of time is stopped at the line it is on, and says so.
        opts.sandbox.program = Some(
            match opts.sandbox.program.take() {
                Some(p) => p,
                None => sluice_engine::SupervisorProgram::locate()?,
            }
            .with_trace_lines(),
        );
        let gateway = start_local(opts).await?;
        // Which lines each hook ran (the sandboxes trace them, above): `sluice test --coverage`.
        gateway.engine.record_coverage();
        // Every problem of the files, each once, at the author's file and line.
        let problems: Vec<String> = gateway
            .engine
            .registry()
            .errors()
            .iter()
            .filter(|e| !e.message.contains("will fail until it does"))
            .map(|e| originals(&copies, &e.to_string()))
            .collect();
        if !problems.is_empty() {
            anyhow::bail!("{}", problems.join("\n"));
        }
        // Whatever the rewriting above missed must not be served: only the stubs are reachable.
        let stub_prefix = format!("http://{addr}/");
        for cap in gateway.engine.registry().capabilities() {
            let e = &cap.spec.endpoint;
            let stubbed = e.grpc.is_none()
                && e.http
                    .as_deref()
                    .is_none_or(|u| u.starts_with(&stub_prefix));
            if !stubbed {
                gateway.shutdown().await;
                anyhow::bail!(
                    "Capability {:?} in {} keeps its own endpoint; sluice test and sluice run call none (is it written in an unusual way?)",
                    cap.name,
                    cap.namespace
                );
            }
        }
        let client = GatewayClient::connect(format!("http://{}", gateway.addr)).await?;
        Ok(Self {
            gateway,
            client,
            _dir: dir,
            _state: state,
            stubs: stub_task,
            copies,
        })
    }

    /// Each hook written as code in the files, with the lines the runs so far ran, in the files
    /// the author edits.
    pub fn coverage(&self) -> Vec<sluice_engine::HookCoverage> {
        let mut hooks = self.gateway.engine.coverage().unwrap_or_default();
        for h in &mut hooks {
            if let Some((_, original)) = self.copies.iter().find(|(copy, _)| *copy == h.file) {
                h.file = original.clone();
            }
        }
        hooks
    }

    pub async fn stop(self) {
        self.gateway.shutdown().await;
        if let Some(t) = self.stubs {
            t.abort();
        }
    }

    pub async fn run(&self, case: &Case) -> Result<Value, CaseError> {
        let payload = match (&case.text, &case.value) {
            (Some(t), _) => proto::run_request::Payload::Text(t.clone()),
            (None, Some(v)) => proto::run_request::Payload::Value(to_proto(v)),
            (None, None) => return Err(CaseError::NoPayload),
        };
        let req = proto::RunRequest {
            namespace: case.namespace.clone(),
            target: case.target.clone(),
            trigger_point: case.trigger_point.clone(),
            payload: Some(payload),
            context: case.context.clone().into_iter().collect(),
            session_id: "sluice-test".into(),
        };
        let r = self
            .client
            .clone()
            .run(req)
            .await
            .map_err(CaseError::refused)?;
        Ok(self.with_originals(response_json(&r.into_inner())))
    }

    pub async fn stream(&self, case: &Case, chunks: &[String]) -> Result<Value, CaseError> {
        let open = proto::StreamOpen {
            namespace: case.namespace.clone(),
            target: case.target.clone(),
            trigger_point: case.trigger_point.clone(),
            context: case.context.clone().into_iter().collect(),
            session_id: "sluice-test".into(),
            // Each chunk is handled as if it came on its own, as a slow model's reply does: a
            // pattern split across chunks meets the window's lookback, not one joined batch.
            chunk_by_chunk: true,
        };
        let mut msgs = vec![proto::StreamRequest {
            msg: Some(proto::stream_request::Msg::Open(open)),
        }];
        msgs.extend(chunks.iter().map(|c| proto::StreamRequest {
            msg: Some(proto::stream_request::Msg::Chunk(c.clone())),
        }));
        msgs.push(proto::StreamRequest {
            msg: Some(proto::stream_request::Msg::Finish(proto::StreamFinish {})),
        });
        let mut out = self
            .client
            .clone()
            .stream(futures::stream::iter(msgs))
            .await
            .map_err(|s| CaseError::NotOpened(s.message().to_string()))?
            .into_inner();
        let (mut commits, mut blocked, mut final_) = (vec![], Value::Null, Value::Null);
        while let Some(m) = out.message().await.map_err(CaseError::refused)? {
            match m.msg {
                Some(proto::stream_response::Msg::Commit(c)) => commits.push(c),
                Some(proto::stream_response::Msg::Blocked(b)) => {
                    blocked = json!({"message": b.message, "hook": b.hook})
                }
                Some(proto::stream_response::Msg::Final(f)) => final_ = response_json(&f),
                None => {}
            }
        }
        Ok(self.with_originals(json!({"commits": commits, "blocked": blocked, "final": final_})))
    }

    fn with_originals(&self, v: Value) -> Value {
        let text = v.to_string();
        let fixed = originals(&self.copies, &text);
        if fixed == text {
            return v;
        }
        serde_json::from_str(&fixed).unwrap_or(v)
    }
}

/// What the stub server answers, by path: `/<n>` is the n-th capability routed to it.
#[derive(Default)]
struct StubAnswers {
    routes: Vec<(String, Option<Stub>)>,
}

impl StubAnswers {
    /// The stub URL for capability `name`: its canned answer, or the error that says how to stub it.
    fn route(
        &mut self,
        addr: std::net::SocketAddr,
        name: &str,
        stubs: &BTreeMap<String, Stub>,
    ) -> String {
        self.routes
            .push((name.to_string(), stubs.get(name).cloned()));
        format!("http://{addr}/{}", self.routes.len() - 1)
    }

    fn defines(&self, name: &str) -> bool {
        self.routes.iter().any(|(n, _)| n == name)
    }

    /// HTTP status and body for a request to `path`.
    fn answer(&self, path: &str) -> (u16, String) {
        let route = path
            .trim_start_matches('/')
            .parse::<usize>()
            .ok()
            .and_then(|i| self.routes.get(i));
        match route {
            Some((_, Some(Stub { error: Some(e), .. }))) => (500, e.clone()),
            Some((_, Some(s))) => (200, json!({"result": s.result}).to_string()),
            Some((name, None)) => (
                500,
                format!(
                    "{name:?} has no stub (no endpoint is called here): add it under `capabilities:` in the test file, or pass --stub {name}=RESULT_JSON to sluice run"
                ),
            ),
            None => (404, "no such stub".to_string()),
        }
    }
}

/// A Capability document with its endpoint replaced by the stub `route` gives, as JSON (which is
/// YAML); `None` for anything else (other kinds, built-in endpoints, documents that do not parse:
/// the gateway reports those). A stubbed capability stands for the whole call, so its gates and
/// dispatch steps go; an unstubbed one keeps them (each answers its own "no stub" error).
fn stubbed_capability(
    doc: &str,
    stubbed: impl Fn(&str) -> Option<Stub>,
    route: impl FnOnce(&str) -> String,
) -> Option<String> {
    let mut v: Value = serde_saphyr::from_str(doc).ok()?;
    if v.get("kind").and_then(Value::as_str) != Some("Capability") {
        return None;
    }
    let name = v.get("metadata")?.get("name")?.as_str()?.to_string();
    let endpoint = v.get("spec")?.get("endpoint");
    // A built-in reaches nothing outside: it stays, unless the test file stubs it.
    if endpoint.is_some_and(|e| {
        e.get("builtin").is_some() && e.get("http").is_none() && e.get("grpc").is_none()
    }) && stubbed(&name).is_none()
    {
        return None;
    }
    v["spec"]["endpoint"] = json!({"http": route(&name)});
    if let Some(stub) = stubbed(&name)
        && let Some(spec) = v["spec"].as_object_mut()
    {
        spec.remove("gates");
        spec.remove("dispatch");
        if stub.denied.is_some() {
            spec.insert("gates".into(), json!([Stub::gate(&name)]));
        }
    }
    Some(v.to_string())
}

async fn serve_stubs(listener: tokio::net::TcpListener, answers: Arc<StubAnswers>) {
    use http_body_util::Full;
    use hyper::{Response, body::Bytes, service::service_fn};
    while let Ok((stream, _)) = listener.accept().await {
        let answers = answers.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let (status, body) = answers.answer(req.uri().path());
                async move {
                    let mut r = Response::new(Full::new(Bytes::from(body)));
                    *r.status_mut() = hyper::StatusCode::from_u16(status)
                        .unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
                    Ok::<_, std::convert::Infallible>(r)
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                .await;
        });
    }
}

/// Compares a result with the expectation; each mismatch is one line of a readable diff.
pub fn compare(expect: &Expect, got: &Value, streamed: bool) -> Vec<String> {
    let mut diff = Vec::new();
    let result = if streamed { &got["final"] } else { got };
    let mut want = |what: &str, expected: String, actual: String| {
        if expected != actual {
            diff.push(format!(
                "{what}:\n    expected: {expected}\n    got:      {actual}"
            ));
        }
    };
    if let Some(a) = &expect.action {
        want(
            "action",
            a.clone(),
            result["action"].as_str().unwrap_or_default().to_string(),
        );
    }
    let text = result["payload"]["text"].as_str().map(str::to_string);
    if let Some(t) = &expect.text {
        want(
            "text",
            format!("{t:?}"),
            format!("{:?}", text.clone().unwrap_or_default()),
        );
    }
    if let Some(v) = &expect.value {
        want(
            "value",
            v.to_string(),
            result["payload"]["value"].to_string(),
        );
    }
    if let Some(m) = &expect.message {
        want(
            "message",
            format!("{m:?}"),
            format!("{:?}", result["message"].as_str().unwrap_or_default()),
        );
    }
    let shown = text
        .clone()
        .unwrap_or_else(|| result["payload"]["value"].to_string());
    for c in &expect.contains {
        if !shown.contains(c.as_str()) {
            diff.push(format!("payload should contain {c:?}:\n    got: {shown:?}"));
        }
    }
    for c in &expect.excludes {
        let committed = got["commits"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect::<String>())
            .unwrap_or_default();
        if shown.contains(c.as_str()) || committed.contains(c.as_str()) {
            diff.push(format!("{c:?} should not appear:\n    got: {shown:?}"));
        }
    }
    let hooks = result["hooks"].as_array().cloned().unwrap_or_default();
    for (hook, action) in &expect.hooks {
        let got = hooks
            .iter()
            .find(|h| h["name"] == hook.as_str())
            .map(|h| h["action"].as_str().unwrap_or_default().to_string());
        diff_hook(&mut diff, hook, action, got);
    }
    for (hook, piece) in &expect.errors {
        let err = hooks
            .iter()
            .find(|h| h["name"] == hook.as_str())
            .map(|h| h["error"].as_str().unwrap_or_default().to_string())
            .unwrap_or_default();
        if !err.contains(piece.as_str()) {
            diff.push(format!(
                "error of hook {hook:?} should contain {piece:?}:\n    got: {err:?}"
            ));
        }
    }
    // A hook that failed gave no answer: whatever the chain's failurePolicy made of it (a block,
    // under Closed), the case fails unless it expects that failure.
    for h in &hooks {
        let Some(name) = h["name"].as_str() else {
            continue;
        };
        let failed = h["error"].as_str().is_some_and(|e| !e.is_empty());
        let expected = expect.errors.contains_key(name)
            || expect.hooks.get(name).is_some_and(|a| a == "error");
        if failed && !expected {
            diff.push(format!(
                "hook {name:?} failed, and the case does not expect a failure: the chain's {:?} came from its failurePolicy, not from the hook\n    fix the hook, or expect the failure: errors: {{{name}: \"<a piece of the error>\"}}",
                result["action"].as_str().unwrap_or_default()
            ));
        }
    }
    if let Some(commits) = &expect.commits {
        let got_commits: Vec<String> = got["commits"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|c| c.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        if commits.concat() != got_commits.concat() {
            diff.push(format!(
                "commits (concatenated):\n    expected: {:?}\n    got:      {:?}",
                commits.concat(),
                got_commits.concat()
            ));
        }
    }
    if let Some(b) = expect.blocked {
        let was = !got["blocked"].is_null();
        if b != was {
            diff.push(format!(
                "blocked mid-stream:\n    expected: {b}\n    got:      {was}"
            ));
        }
    }
    diff
}

/// What each hook that failed said, and what each hook printed, for a failing case: the usual
/// reasons it failed.
fn hook_failures(got: Option<&Value>, streamed: bool) -> Vec<String> {
    let Some(got) = got else { return Vec::new() };
    let result = if streamed { &got["final"] } else { got };
    let mut out = Vec::new();
    for h in result["hooks"].as_array().into_iter().flatten() {
        if let Some(error) = h["error"].as_str().filter(|e| !e.is_empty()) {
            out.push(format!(
                "hook {} failed:\n    {}",
                h["name"],
                error.replace('\n', "\n    ")
            ));
        }
        if let Some(printed) = h["output"].as_str().filter(|o| !o.is_empty()) {
            out.push(format!(
                "hook {} printed:\n    {}",
                h["name"],
                printed.trim_end().replace('\n', "\n    ")
            ));
        }
    }
    if !out.is_empty()
        && let Some(m) = result["message"].as_str().filter(|m| !m.is_empty())
    {
        out.push(format!("message: {m:?}"));
    } else if out.is_empty() {
        // No hook failed: the hook that ended the walk (block or skip) and what it said.
        let ended = result["terminal_index"]
            .as_u64()
            .and_then(|i| result["hooks"].get(i as usize));
        if let Some(h) = ended {
            let message = result["message"].as_str().unwrap_or_default();
            out.push(format!(
                "hook {} returned {} with message {message:?}",
                h["name"],
                h["action"].as_str().unwrap_or("?")
            ));
        }
    }
    out
}

fn diff_hook(diff: &mut Vec<String>, hook: &str, expected: &str, got: Option<String>) {
    match got {
        Some(a) if a == expected => {}
        Some(a) => diff.push(format!(
            "hook {hook:?}:\n    expected: {expected}\n    got:      {a}"
        )),
        None => diff.push(format!(
            "hook {hook:?}: expected {expected}, but it did not run"
        )),
    }
}

/// How `sluice test` runs a file's cases.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Only the cases whose name contains this text (`--run`).
    pub only: Option<String>,
    /// Keep each case's full answer (`-v`).
    pub verbose: bool,
    /// Run hooks in gVisor sandboxes (runsc and root) as well as in their WebAssembly instances.
    pub gvisor: bool,
}

/// One case's outcome.
#[derive(Clone, Debug)]
pub struct CaseReport {
    pub name: String,
    pub passed: bool,
    /// Why it failed: mismatches, then what each failed hook said.
    pub details: Vec<String>,
    /// The answer, when `verbose`.
    pub answer: Option<Value>,
}

/// Every case of one test file, in order (those `--run` left out are not listed).
#[derive(Clone, Debug)]
pub struct FileReport {
    pub path: PathBuf,
    pub cases: Vec<CaseReport>,
    /// Each hook written as code in the chains the file uses, with the lines its cases ran.
    pub coverage: Vec<sluice_engine::HookCoverage>,
}

impl FileReport {
    pub fn passed(&self) -> usize {
        self.cases.iter().filter(|c| c.passed).count()
    }

    pub fn failed(&self) -> usize {
        self.cases.len() - self.passed()
    }
}

/// Why a test file could not be run at all.
#[derive(Debug, thiserror::Error)]
pub enum TestFileError {
    #[error("{path}: cannot read: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}:{line}: {message}")]
    Invalid {
        path: String,
        line: usize,
        message: String,
    },
    #[error("{path}: cannot start the local gateway: {message}")]
    Gateway { path: String, message: String },
}

/// "target (trigger point)" of every HookChain in the files, for a case whose target none serves.
fn chain_targets(files: &[PathBuf]) -> Vec<String> {
    let mut targets: Vec<String> = files
        .iter()
        .filter_map(|f| Some((f, std::fs::read_to_string(f).ok()?)))
        .flat_map(|(f, text)| sluice_crds::manifest::parse(f, &text))
        .filter_map(|o| match o.ok()?.value {
            sluice_crds::manifest::Object::HookChain(hc) => Some(format!(
                "{} ({})",
                hc.spec.target,
                hc.spec.trigger_point.as_str()
            )),
            sluice_crds::manifest::Object::Capability(_) => None,
        })
        .collect();
    targets.sort();
    targets.dedup();
    targets
}

/// The keys a case may have, for "did you mean" on a misspelt one.
const CASE_KEYS: &[&str] = &[
    "name",
    "target",
    "triggerPoint",
    "namespace",
    "text",
    "value",
    "chunks",
    "context",
    "expect",
];
const EXPECT_KEYS: &[&str] = &[
    "action", "text", "value", "contains", "excludes", "message", "hooks", "errors", "commits",
    "blocked",
];

/// A case that does not read: names the misspelt key and the one meant.
fn case_problem(raw: &Value, e: &serde_json::Error) -> String {
    let mut unknown = Vec::new();
    if let Some(map) = raw.as_object() {
        for k in map.keys().map(String::as_str) {
            if !CASE_KEYS.contains(&k) {
                unknown.push((k.to_string(), CASE_KEYS));
            }
        }
        if let Some(expect) = raw.get("expect").and_then(|e| e.as_object()) {
            for k in expect.keys().map(String::as_str) {
                if !EXPECT_KEYS.contains(&k) {
                    unknown.push((format!("expect.{k}"), EXPECT_KEYS));
                }
            }
        }
    }
    match unknown.first() {
        Some((k, known)) => {
            let bare = k.trim_start_matches("expect.");
            let meant = sluice_crds::fields::did_you_mean(bare, known.iter().copied())
                .map(|m| format!("; did you mean {m:?}?"))
                .unwrap_or_else(|| format!(" (known: {})", known.join(", ")));
            format!("unknown key {k:?} in this case{meant}")
        }
        None => format!("this case does not read: {e}"),
    }
}

/// Runs the cases of one test file. A case that does not read (a misspelt key) fails alone; the
/// others still run.
pub async fn run_file(path: &Path, opts: &RunOptions) -> Result<FileReport, TestFileError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| TestFileError::Read {
        path: shown.clone(),
        source,
    })?;
    let invalid = |e: serde_saphyr::Error| TestFileError::Invalid {
        path: shown.clone(),
        line: e.location().map(|l| l.line() as usize).unwrap_or(1),
        message: e.to_string(),
    };
    let mut raw: Value = serde_saphyr::from_str(&text).map_err(invalid)?;
    let raw_cases = raw
        .as_object_mut()
        .and_then(|m| m.remove("cases"))
        .unwrap_or(Value::Array(vec![]));
    if let Some(m) = raw.as_object_mut() {
        m.insert("cases".into(), Value::Array(vec![]));
    }
    let file: TestFile = serde_json::from_value(raw).map_err(|e| TestFileError::Invalid {
        path: shown.clone(),
        line: 1,
        message: e.to_string(),
    })?;
    let mut cases: Vec<Result<Case, (String, String)>> = Vec::new();
    for (i, c) in raw_cases.as_array().into_iter().flatten().enumerate() {
        let name = c
            .get("name")
            .and_then(|n| n.as_str())
            .map(str::to_string)
            .unwrap_or_else(|| format!("case #{}", i + 1));
        cases.push(
            serde_json::from_value::<Case>(c.clone()).map_err(|e| (name, case_problem(c, &e))),
        );
    }
    let wanted = |name: &str| opts.only.as_deref().is_none_or(|p| name.contains(p));
    cases.retain(|c| match c {
        Ok(c) => wanted(&c.name),
        Err((name, _)) => wanted(name),
    });
    let mut report = FileReport {
        path: path.to_path_buf(),
        cases: Vec::new(),
        coverage: Vec::new(),
    };
    if cases.is_empty() {
        return Ok(report);
    }
    let base = path.parent().unwrap_or(Path::new("."));
    let chains: Vec<PathBuf> = file.chains.iter().map(|c| base.join(c)).collect();
    if let Some((given, missing)) = file.chains.iter().zip(&chains).find(|(_, p)| !p.exists()) {
        let given = given.display().to_string();
        return Err(TestFileError::Invalid {
            path: shown.clone(),
            line: text
                .lines()
                .position(|l| l.contains(given.as_str()))
                .map_or(1, |i| i + 1),
            message: format!(
                "chains: {given}: there is no {} (a chain's path is relative to the test file's directory, {})",
                missing.display(),
                if base.as_os_str().is_empty() {
                    ".".to_string()
                } else {
                    base.display().to_string()
                }
            ),
        });
    }
    let targets = chain_targets(&chains);
    let local = Local::start(&chains, &file.capabilities, opts.gvisor)
        .await
        .map_err(|e| TestFileError::Gateway {
            path: shown.clone(),
            message: format!("{e:#}"),
        })?;
    for case in cases {
        let case = match case {
            Ok(c) => c,
            Err((name, problem)) => {
                report.cases.push(CaseReport {
                    name,
                    passed: false,
                    details: vec![problem],
                    answer: None,
                });
                continue;
            }
        };
        let streamed = case.chunks.is_some();
        let got = match &case.chunks {
            Some(chunks) => local.stream(&case, chunks).await,
            None => local.run(&case).await,
        };
        let mut details = match &got {
            Ok(v) => compare(&case.expect, v, streamed),
            Err(CaseError::Refused {
                code: tonic::Code::NotFound,
                message,
            }) => vec![format!(
                "no chain serves target {:?} at {:?} ({message}); the chains here serve: {}",
                case.target,
                case.trigger_point,
                if targets.is_empty() {
                    "nothing".to_string()
                } else {
                    targets.join(", ")
                }
            )],
            Err(e) => vec![format!("the gateway refused the case: {e}")],
        };
        let passed = details.is_empty();
        if !passed {
            details.extend(hook_failures(got.as_ref().ok(), streamed));
        }
        report.cases.push(CaseReport {
            name: case.name.clone(),
            passed,
            details,
            answer: got.ok().filter(|_| opts.verbose),
        });
    }
    report.coverage = local.coverage();
    local.stop().await;
    Ok(report)
}

/// JUnit XML for the reports (one testsuite per file), as CI systems read it.
pub fn junit(reports: &[Result<FileReport, String>]) -> String {
    fn esc(s: &str) -> String {
        s.replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
            .replace('"', "&quot;")
    }
    let mut out = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<testsuites>\n");
    for r in reports {
        match r {
            Ok(f) => {
                out.push_str(&format!(
                    "  <testsuite name=\"{}\" tests=\"{}\" failures=\"{}\">\n",
                    esc(&f.path.display().to_string()),
                    f.cases.len(),
                    f.failed()
                ));
                for c in &f.cases {
                    out.push_str(&format!("    <testcase name=\"{}\"", esc(&c.name)));
                    if c.passed {
                        out.push_str("/>\n");
                    } else {
                        let first = c.details.first().cloned().unwrap_or_default();
                        out.push_str(&format!(
                            ">\n      <failure message=\"{}\">{}</failure>\n    </testcase>\n",
                            esc(first.lines().next().unwrap_or_default()),
                            esc(&c.details.join("\n"))
                        ));
                    }
                }
                out.push_str("  </testsuite>\n");
            }
            Err(e) => out.push_str(&format!(
                "  <testsuite name=\"{}\" tests=\"1\" failures=\"0\" errors=\"1\">\n    <testcase name=\"(file)\">\n      <error message=\"{}\"/>\n    </testcase>\n  </testsuite>\n",
                esc(e.split(':').next().unwrap_or_default()),
                esc(e)
            )),
        }
    }
    out.push_str("</testsuites>\n");
    out
}
