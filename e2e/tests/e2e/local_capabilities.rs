//! host_call and the capability runner against real services on loopback: the example fake LLM over
//! gRPC and the credit ledger over HTTP, driven by hooks in real sandboxes.

use serde_json::{Value, json};
use sluice_e2e::{Harness, action, text};
use sluice_example_services::Services;
use sluice_proto::{self as proto, Action};
use std::collections::HashMap;
use std::time::{Duration, Instant};

fn capabilities(llm: &str, credit: &str, llm_timeout_ms: u32) -> String {
    format!(
        r#"apiVersion: sluice.dev/v1alpha1
kind: Capability
metadata: {{name: llm.run, namespace: default}}
spec:
  schema: {{type: object, required: [prompt], additionalProperties: false, properties: {{prompt: {{type: string}}}}}}
  gates: [credit.check]
  dispatch: [credit.consume]
  endpoint: {{grpc: "{llm}"}}
  timeoutMs: {llm_timeout_ms}
---
apiVersion: sluice.dev/v1alpha1
kind: Capability
metadata: {{name: credit.check, namespace: default}}
spec: {{endpoint: {{http: "{credit}/execute"}}, timeoutMs: 2000}}
---
apiVersion: sluice.dev/v1alpha1
kind: Capability
metadata: {{name: credit.consume, namespace: default}}
spec: {{endpoint: {{http: "{credit}/execute"}}, timeoutMs: 2000}}
---
apiVersion: sluice.dev/v1alpha1
kind: Capability
metadata: {{name: echo, namespace: default}}
spec: {{endpoint: {{builtin: echo}}}}
---
apiVersion: sluice.dev/v1alpha1
kind: Capability
metadata: {{name: secret.tool, namespace: default}}
spec: {{endpoint: {{builtin: echo}}}}
"#
    )
}

/// A hook that performs the host_call described by the input text (JSON) and reports what happened.
const CALLER: &str = r#"import json
def execute(context, settings):
    req = json.loads(context["outgoing"])
    if "spoof" in req:
        context["caller"]["user_id"] = req["spoof"]
        context["session_id"] = "forged"
    results = []
    for _ in range(req.get("times", 1)):
        try:
            results.append({"ok": context.host_call(req["name"], req["payload"])})
        except HostCallError as e:
            results.append({"error": str(e), "code": e.code})
    return {"action": "modify", "outgoing": json.dumps(results)}
"#;

fn chain() -> String {
    let mut y = String::from(
        "apiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata: {name: caller, namespace: default}\nspec:\n  target: t-cap\n  triggerPoint: input\n  timeoutMs: 3000\n  pool: {warm: 3, max: 16}\n  hooks:\n    - name: caller\n      action: modify\n      capabilities: [llm.run, echo, missing.one, credit.check, flaky.run]\n      code: |\n",
    );
    for l in CALLER.lines() {
        y.push_str(&format!("        {l}\n"));
    }
    y
}

struct Setup {
    h: Harness,
    services: Services,
}

async fn setup(llm_timeout_ms: u32) -> Setup {
    let services = Services::start(
        "127.0.0.1:0".parse().unwrap(),
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    let caps = capabilities(
        &format!("http://{}", services.llm_addr),
        &format!("http://{}", services.credit_addr),
        llm_timeout_ms,
    );
    let h = Harness::start_with(&[("caps.yaml", &caps), ("chain.yaml", &chain())], |o| {
        o.limits.host_calls_per_run = 5
    })
    .await;
    Setup { h, services }
}

async fn call(h: &Harness, user: &str, req: Value) -> Vec<Value> {
    let ctx: HashMap<String, String> = [("user_id".to_string(), user.to_string())].into();
    let r = h
        .run(
            "t-cap",
            "input",
            proto::run_request::Payload::Text(req.to_string()),
            ctx,
        )
        .await
        .unwrap();
    assert_eq!(action(&r), Action::Modify, "{r:?}");
    serde_json::from_str(text(&r)).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runner_resolves_validates_gates_executes_and_dispatches_in_order() {
    let s = setup(5000).await;
    s.services.credit.set_balance("ann", 10);

    // Served: gate (reserve) → execute → dispatch (settle), in that order, with the trusted caller.
    let out = call(
        &s.h,
        "ann",
        json!({"name": "llm.run", "payload": {"prompt": "Summarise: The cat sat. Then it left."}}),
    )
    .await;
    assert_eq!(out[0]["ok"]["text"], "Summary: The cat sat.");
    let calls = s.services.calls();
    let order: Vec<&str> = calls.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(order, ["credit.check", "llm.run", "credit.consume"]);
    assert_eq!(calls[1].caller["user_id"], "ann");
    assert_eq!(calls[1].caller["target"], "t-cap");
    assert_eq!(
        s.services.credit.balance("ann"),
        (9, 0),
        "one credit consumed, nothing left reserved"
    );

    // Schema violation: nothing downstream is called.
    let before = s.services.calls().len();
    let out = call(
        &s.h,
        "ann",
        json!({"name": "llm.run", "payload": {"prompt": 5}}),
    )
    .await;
    assert!(
        out[0]["error"]
            .as_str()
            .unwrap()
            .contains("does not match its schema"),
        "{out:?}"
    );
    let out = call(
        &s.h,
        "ann",
        json!({"name": "llm.run", "payload": {"prompt": "x", "extra": true}}),
    )
    .await;
    assert!(
        out[0]["error"].as_str().unwrap().contains("schema"),
        "{out:?}"
    );
    assert_eq!(out[0]["code"], "invalid", "{out:?}");
    // Not listed by the hook, and not existing at all.
    let out = call(&s.h, "ann", json!({"name": "secret.tool", "payload": {}})).await;
    assert!(
        out[0]["error"]
            .as_str()
            .unwrap()
            .contains("may not call \"secret.tool\""),
        "{out:?}"
    );
    assert_eq!(out[0]["code"], "forbidden", "{out:?}");
    let out = call(&s.h, "ann", json!({"name": "missing.one", "payload": {}})).await;
    assert!(
        out[0]["error"].as_str().unwrap().contains("does not exist"),
        "{out:?}"
    );
    assert_eq!(
        s.services.calls().len(),
        before,
        "refused calls reached a service"
    );

    // Denial by the gate stops execute.
    s.services.credit.set_balance("bob", 0);
    let out = call(
        &s.h,
        "bob",
        json!({"name": "llm.run", "payload": {"prompt": "hello"}}),
    )
    .await;
    let err = out[0]["error"].as_str().unwrap();
    assert!(
        err.contains("denied by gate \"credit.check\"") && err.contains("below the cost"),
        "{err}"
    );
    assert_eq!(out[0]["code"], "denied", "{out:?}");
    let after: Vec<String> = s.services.calls()[before..]
        .iter()
        .map(|c| c.name.clone())
        .collect();
    // Execute never ran; the dispatch step heard of the call (and had nothing to release).
    assert_eq!(
        after,
        ["credit.check", "credit.consume"],
        "execute ran after a denial"
    );
    assert_eq!(s.services.credit.balance("bob"), (0, 0));

    // The builtin echo, and the audit of every host_call.
    let out = call(
        &s.h,
        "ann",
        json!({"name": "echo", "payload": {"x": [1, 2]}}),
    )
    .await;
    assert_eq!(out[0]["ok"], json!({"x": [1, 2]}));
    let audit = s.h.audit();
    let first = &audit[0]["host_calls"][0];
    assert_eq!(first["capability"], "llm.run");
    assert_eq!(first["gates"][0]["allow"], true);
    assert_eq!(first["consumed"]["credits"], 1);
    s.h.stop_and_check_leaks().await;
    s.services.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caller_identity_cannot_be_spoofed_by_the_payload() {
    let s = setup(5000).await;
    s.services.credit.set_balance("ann", 5);
    s.services.credit.set_balance("admin", 1000);
    // The hook tries to pass itself off as admin inside the payload: the schema refuses the extra
    // field, and nothing the hook sends ever reaches `caller`.
    let out = call(
        &s.h,
        "ann",
        json!({"name": "llm.run", "payload": {"prompt": "hi", "caller": {"user_id": "admin"}}}),
    )
    .await;
    assert!(
        out[0]["error"].as_str().unwrap().contains("schema"),
        "{out:?}"
    );
    assert_eq!(out[0]["code"], "invalid", "{out:?}");
    // The hook rewrites its own view of the caller before calling: the runner's caller comes from
    // the request on the trusted side.
    let out = call(
        &s.h,
        "ann",
        json!({"name": "llm.run", "payload": {"prompt": "Summarise: Hi."}, "spoof": "admin"}),
    )
    .await;
    assert!(out[0]["ok"].is_object(), "{out:?}");
    for c in s.services.calls() {
        assert_eq!(
            c.caller["user_id"], "ann",
            "a service saw a spoofed caller: {c:?}"
        );
    }
    assert_eq!(s.services.credit.balance("admin"), (1000, 0));
    s.h.stop_and_check_leaks().await;
    s.services.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_that_is_down_fails_within_the_capability_timeout() {
    // An LLM endpoint that accepts connections and never answers, and one where nothing listens.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let services = Services::start(
        "127.0.0.1:0".parse().unwrap(),
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    services.credit.set_balance("ann", 10);
    let caps = capabilities(&format!("http://{}", silent.local_addr().unwrap()), &format!("http://{}", services.credit_addr), 400)
        .replace("metadata: {name: echo, namespace: default}\nspec: {endpoint: {builtin: echo}}", &format!("metadata: {{name: echo, namespace: default}}\nspec: {{endpoint: {{http: \"http://127.0.0.1:{dead_port}/x\"}}, timeoutMs: 400}}"));
    let h = Harness::start(&[("caps.yaml", &caps), ("chain.yaml", &chain())]).await;
    let began = Instant::now();
    let out = call(
        &h,
        "ann",
        json!({"name": "llm.run", "payload": {"prompt": "hi"}}),
    )
    .await;
    let err = out[0]["error"].as_str().unwrap();
    assert!(err.contains("did not answer within 400 ms"), "{err}");
    assert_eq!(out[0]["code"], "timeout", "{out:?}");
    assert!(
        began.elapsed() < Duration::from_secs(3),
        "took {:?}",
        began.elapsed()
    );
    assert_eq!(
        services.credit.balance("ann"),
        (10, 0),
        "the reservation was released when execute failed"
    );
    let out = call(&h, "ann", json!({"name": "echo", "payload": {}})).await;
    assert!(
        out[0]["error"].as_str().unwrap().contains("cannot reach"),
        "{out:?}"
    );
    assert_eq!(out[0]["code"], "unavailable", "{out:?}");
    h.stop_and_check_leaks().await;
    services.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_calls_per_run_are_bounded() {
    let s = setup(5000).await;
    let out = call(
        &s.h,
        "ann",
        json!({"name": "echo", "payload": 1, "times": 8}),
    )
    .await;
    assert_eq!(out.iter().filter(|r| r.get("ok").is_some()).count(), 5);
    assert!(
        out[5]["error"]
            .as_str()
            .unwrap()
            .contains("host_call limit reached"),
        "{out:?}"
    );
    s.h.stop_and_check_leaks().await;
    s.services.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_concurrent_runs_against_credit_for_three_serve_exactly_three() {
    let s = setup(5000).await;
    s.services.credit.set_balance("ann", 3);
    let runs = (0..10).map(|_| {
        call(
            &s.h,
            "ann",
            json!({"name": "llm.run", "payload": {"prompt": "Summarise: Short."}}),
        )
    });
    let results = futures::future::join_all(runs).await;
    let served = results.iter().filter(|r| r[0].get("ok").is_some()).count();
    assert_eq!(served, 3, "{results:?}");
    assert_eq!(
        s.services.credit.balance("ann"),
        (0, 0),
        "balance never negative, nothing left reserved"
    );
    let executes = s
        .services
        .calls()
        .iter()
        .filter(|c| c.name == "llm.run")
        .count();
    assert_eq!(executes, 3, "the LLM was called only for the served runs");
    s.h.stop_and_check_leaks().await;
    s.services.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_summariser_example_runs_against_the_example_services() {
    let services = Services::start(
        "127.0.0.1:0".parse().unwrap(),
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    services.credit.set_balance("user-1", 20);
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples");
    let caps = std::fs::read_to_string(format!("{root}/capabilities.yaml"))
        .unwrap()
        .replace(
            "http://127.0.0.1:7001",
            &format!("http://{}", services.llm_addr),
        )
        .replace(
            "http://127.0.0.1:7002",
            &format!("http://{}", services.credit_addr),
        );
    let chain = std::fs::read_to_string(format!("{root}/summarize-long-replies.yaml")).unwrap();
    let h = Harness::start(&[("caps.yaml", &caps), ("chain.yaml", &chain)]).await;
    let long = format!(
        "The deployment finished without errors. {}",
        "Details follow. ".repeat(40)
    );
    let ctx: HashMap<String, String> = [("user_id".to_string(), "user-1".to_string())].into();
    let r = h
        .run(
            "research-bot",
            "output",
            proto::run_request::Payload::Text(long),
            ctx.clone(),
        )
        .await
        .unwrap();
    assert_eq!(text(&r), "Summary: The deployment finished without errors.");
    let r = h
        .run(
            "research-bot",
            "output",
            proto::run_request::Payload::Text("short".into()),
            ctx,
        )
        .await
        .unwrap();
    assert_eq!((action(&r), text(&r)), (Action::Pass, "short"));
    assert!(services.credit.balance("user-1").0 < 20);
    h.stop_and_check_leaks().await;
    services.stop();
}

/// An application service that accepts connections and never answers (a hung LLM).
fn hung_service() -> (std::net::TcpListener, String) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = format!("http://{}", l.local_addr().unwrap());
    (l, addr)
}

async fn setup_hung(
    tweak: impl FnOnce(&mut sluice_gateway::LocalOptions),
) -> (Setup, std::net::TcpListener) {
    let services = Services::start(
        "127.0.0.1:0".parse().unwrap(),
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    let (hung, llm) = hung_service();
    let caps = capabilities(&llm, &format!("http://{}", services.credit_addr), 5000);
    let h = Harness::start_with(&[("caps.yaml", &caps), ("chain.yaml", &chain())], tweak).await;
    (Setup { h, services }, hung)
}

fn settled(s: &Setup, user: &str) -> bool {
    let consumed = s.services.calls().iter().any(|c| {
        c.name == "credit.consume" && c.caller.get("user_id").map(String::as_str) == Some(user)
    });
    consumed && s.services.credit.balance(user).1 == 0
}

/// The run's host_call time ends while execute is still waiting: the hook is told so, and the
/// reservation the gate made is still released by the dispatch step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_cut_off_mid_execute_still_settles() {
    let (s, _hung) = setup_hung(|o| {
        o.limits.host_call_time_per_run = Duration::from_millis(1000);
    })
    .await;
    s.services.credit.set_balance("ann", 10);
    let out = call(
        &s.h,
        "ann",
        json!({"name": "llm.run", "payload": {"prompt": "Summarise: a cat."}}),
    )
    .await;
    assert!(
        out[0]["error"]
            .as_str()
            .is_some_and(|e| e.contains("host_call limit reached")),
        "{out:?}"
    );
    assert!(
        settled(&s, "ann"),
        "the reservation leaked: {:?}, calls {:?}",
        s.services.credit.balance("ann"),
        s.services.calls()
    );
    s.h.stop_and_check_leaks().await;
    s.services.stop();
}

/// The client goes away while its run waits on a capability: the run is still finished, its
/// reservation settled, and its audit event written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_client_disconnects_is_finished_settled_and_audited() {
    let (s, _hung) = setup_hung(|_| {}).await;
    s.services.credit.set_balance("bob", 10);
    let h = &s.h;
    let client = h.client.clone();
    let ask = json!({"name": "llm.run", "payload": {"prompt": "Summarise: a dog."}});
    let request = proto::RunRequest {
        namespace: "default".into(),
        target: "t-cap".into(),
        trigger_point: "input".into(),
        payload: Some(proto::run_request::Payload::Text(ask.to_string())),
        context: [("user_id".to_string(), "bob".to_string())].into(),
        session_id: "s-gone".into(),
    };
    let pending = tokio::spawn(async move { client.clone().run(request).await });
    // Wait until the gate has reserved: the run is inside execute, which hangs.
    let began = Instant::now();
    while !s.services.calls().iter().any(|c| c.name == "credit.check") {
        assert!(
            began.elapsed() < Duration::from_secs(60),
            "the gate was never called"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    pending.abort();
    let _ = pending.await;
    // The run goes on without its client: execute times out (5 s), dispatch settles, audit.
    let began = Instant::now();
    let event = loop {
        if let Some(e) = h.audit().into_iter().find(|e| e["session_id"] == "s-gone") {
            break e;
        }
        assert!(
            began.elapsed() < Duration::from_secs(60),
            "no audit event for the run whose client went away"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(event["action"], "modify", "{event}");
    assert!(
        settled(&s, "bob"),
        "the reservation leaked: {:?}",
        s.services.credit.balance("bob")
    );
    s.h.stop_and_check_leaks().await;
    s.services.stop();
}

/// The gateway is told to stop while a run waits on a capability whose gate has reserved: the
/// shutdown lets the run finish (execute times out), and the reservation is settled before the
/// gateway is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_shutting_down_mid_call_still_settles() {
    let (s, _hung) = setup_hung(|_| {}).await;
    s.services.credit.set_balance("cy", 10);
    let client = s.h.client.clone();
    let ask = json!({"name": "llm.run", "payload": {"prompt": "Summarise: a fox."}});
    let request = proto::RunRequest {
        namespace: "default".into(),
        target: "t-cap".into(),
        trigger_point: "input".into(),
        payload: Some(proto::run_request::Payload::Text(ask.to_string())),
        context: [("user_id".to_string(), "cy".to_string())].into(),
        session_id: "s-shutdown".into(),
    };
    let pending = tokio::spawn(async move { client.clone().run(request).await });
    let began = Instant::now();
    while !s.services.calls().iter().any(|c| c.name == "credit.check") {
        assert!(
            began.elapsed() < Duration::from_secs(60),
            "the gate was never called"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(s.services.credit.balance("cy").1, 1, "the gate reserved");
    let Setup { h, services } = s;
    h.stop_and_check_leaks().await;
    let answer = pending.await.unwrap();
    assert!(answer.is_ok(), "the run in flight was finished: {answer:?}");
    let consumed = services.calls().iter().any(|c| {
        c.name == "credit.consume" && c.caller.get("user_id").map(String::as_str) == Some("cy")
    });
    assert!(consumed, "no settlement: {:?}", services.calls());
    assert_eq!(
        services.credit.balance("cy"),
        (10, 0),
        "released, not leaked"
    );
    services.stop();
}

/// "No credit" and "the ledger is down" read differently to a hook: `denied` with the gate's reason,
/// `unavailable` when the gate could not say. And a hook that calls a gate itself is refused (it
/// would reserve what nothing settles), saying what to call instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hook_tells_no_credit_from_a_ledger_that_is_down_and_cannot_call_a_gate() {
    let s = setup(5000).await;
    s.services.credit.set_balance("bob", 0);
    let out = call(
        &s.h,
        "bob",
        json!({"name": "llm.run", "payload": {"prompt": "hello"}}),
    )
    .await;
    assert_eq!(out[0]["code"], "denied", "{out:?}");
    assert!(
        out[0]["error"].as_str().unwrap().contains("below the cost"),
        "{out:?}"
    );

    let before = s.services.calls().len();
    let out = call(
        &s.h,
        "bob",
        json!({"name": "credit.check", "payload": {"capability": "llm.run", "payload": {"prompt": "x"}}}),
    )
    .await;
    assert_eq!(out[0]["code"], "forbidden", "{out:?}");
    let err = out[0]["error"].as_str().unwrap();
    assert!(
        err.contains("\"credit.check\" is a gate of \"llm.run\"")
            && err.contains("call \"llm.run\" instead"),
        "{err}"
    );
    assert_eq!(s.services.calls().len(), before, "the gate was called");
    s.h.stop_and_check_leaks().await;
    s.services.stop();

    // The ledger down: nothing listens where the gate points.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let services = Services::start(
        "127.0.0.1:0".parse().unwrap(),
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    let caps = capabilities(&format!("http://{}", services.llm_addr), &dead_url, 5000);
    let h = Harness::start(&[("caps.yaml", &caps), ("chain.yaml", &chain())]).await;
    let out = call(
        &h,
        "bob",
        json!({"name": "llm.run", "payload": {"prompt": "hello"}}),
    )
    .await;
    assert_eq!(out[0]["code"], "unavailable", "{out:?}");
    let err = out[0]["error"].as_str().unwrap();
    assert!(
        err.contains("could not be checked by gate \"credit.check\""),
        "{err}"
    );
    assert!(
        !services.calls().iter().any(|c| c.name == "llm.run"),
        "execute ran without its gate"
    );
    h.stop_and_check_leaks().await;
    services.stop();
}

/// An application endpoint that answers each call the way its payload's `mode` says: `ok` (one
/// credit consumed), `fail` (HTTP 500) or `hang` (never). Counts the calls it answered `ok`.
async fn flaky_service() -> (String, std::sync::Arc<std::sync::atomic::AtomicI64>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/execute", listener.local_addr().unwrap());
    let served = std::sync::Arc::new(std::sync::atomic::AtomicI64::new(0));
    let count = served.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                continue;
            };
            let count = count.clone();
            tokio::spawn(async move {
                loop {
                    // One request at a time on the connection: headers, then the body.
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    let (head_end, length) = loop {
                        let Ok(n) = stream.read(&mut chunk).await else {
                            return;
                        };
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&buf[..at]).to_lowercase();
                            let length = head
                                .lines()
                                .find_map(|l| l.strip_prefix("content-length:"))
                                .and_then(|v| v.trim().parse::<usize>().ok())
                                .unwrap_or(0);
                            break (at + 4, length);
                        }
                    };
                    while buf.len() < head_end + length {
                        let Ok(n) = stream.read(&mut chunk).await else {
                            return;
                        };
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                    }
                    let body: Value = serde_json::from_slice(&buf[head_end..head_end + length])
                        .unwrap_or_default();
                    let (status, answer) = match body["payload"]["mode"].as_str() {
                        Some("ok") => {
                            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            (
                                "200 OK",
                                json!({"result": {"done": true}, "consumed": {"credits": 1}}),
                            )
                        }
                        Some("hang") => {
                            tokio::time::sleep(Duration::from_secs(3600)).await;
                            return;
                        }
                        _ => ("500 Internal Server Error", json!({"error": "it broke"})),
                    };
                    let text = answer.to_string();
                    let reply = format!(
                        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{text}",
                        text.len()
                    );
                    if stream.write_all(reply.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (url, served)
}

/// 200 gated calls at once, some served, some failing, some timing out, some whose client goes
/// away, more than the credit covers: the ledger ends exactly at balance − credits consumed, never
/// below zero, with no reservation left open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_gated_calls_leave_the_ledger_exact_whatever_happens() {
    let services = Services::start(
        "127.0.0.1:0".parse().unwrap(),
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    let (flaky, served) = flaky_service().await;
    let credit = format!("http://{}", services.credit_addr);
    let caps = capabilities(&format!("http://{}", services.llm_addr), &credit, 5000)
        + &format!(
            "---\napiVersion: sluice.dev/v1alpha1\nkind: Capability\nmetadata: {{name: flaky.run, namespace: default}}\nspec: {{gates: [credit.check], dispatch: [credit.consume], endpoint: {{http: \"{flaky}\"}}, timeoutMs: 300}}\n"
        );
    let h = Harness::start_with(&[("caps.yaml", &caps), ("chain.yaml", &chain())], |o| {
        o.limits.claim_timeout = Duration::from_secs(120);
        o.gvisor = false;
    })
    .await;
    const BALANCE: i64 = 120;
    services.credit.set_balance("ann", BALANCE);
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut pending = Vec::new();
    let mut gone = 0;
    for i in 0..200 {
        let mode = ["ok", "ok", "ok", "fail", "hang"][(next() % 5) as usize];
        let disconnect = next() % 5 == 0;
        gone += usize::from(disconnect);
        let ask = json!({"name": "flaky.run", "payload": {"mode": mode}});
        let request = proto::RunRequest {
            namespace: "default".into(),
            target: "t-cap".into(),
            trigger_point: "input".into(),
            payload: Some(proto::run_request::Payload::Text(ask.to_string())),
            context: [("user_id".to_string(), "ann".to_string())].into(),
            session_id: format!("s-{i}"),
        };
        let mut client = h.client.clone();
        let task = tokio::spawn(async move { client.run(request).await });
        if disconnect {
            // Gone once its gate has been asked (the run surely started), a moment later.
            let wait = Duration::from_millis(next() % 300);
            let calls = services.log.clone();
            let session = format!("s-{i}");
            tokio::spawn(async move {
                let began = Instant::now();
                while began.elapsed() < Duration::from_secs(60)
                    && !calls.lock().unwrap().iter().any(|c| {
                        c.name == "credit.check" && c.caller.get("session_id") == Some(&session)
                    })
                {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                tokio::time::sleep(wait).await;
                task.abort();
            });
        } else {
            pending.push(task);
        }
    }
    for task in pending {
        let _ = task.await;
    }
    // Every run is finished, with or without its client: one audit event each.
    let began = Instant::now();
    while h.audit().len() < 200 {
        assert!(
            began.elapsed() < Duration::from_secs(120),
            "{} of 200 runs audited",
            h.audit().len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let consumed = served.load(std::sync::atomic::Ordering::SeqCst);
    let (balance, reserved) = services.credit.balance("ann");
    assert!(gone > 0 && consumed > 0, "gone {gone}, consumed {consumed}");
    assert_eq!(
        (balance, reserved, services.credit.open_holds("ann")),
        (BALANCE - consumed, 0, 0),
        "{consumed} credits consumed of {BALANCE}"
    );
    assert!(balance >= 0, "overspent: {balance}");
    h.stop_and_check_leaks().await;
    services.stop();
}

/// docs/hooks.md's "charge per message" hook on the examples' `credit.charge`: each message costs one
/// credit, settled at once; when the credit is gone the hook blocks with its message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_charge_per_message_hook_charges_and_blocks() {
    let services = Services::start(
        "127.0.0.1:0".parse().unwrap(),
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    services.credit.set_balance("cat", 3);
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples");
    let caps = std::fs::read_to_string(format!("{root}/capabilities.yaml"))
        .unwrap()
        .replace(
            "http://127.0.0.1:7001",
            &format!("http://{}", services.llm_addr),
        )
        .replace(
            "http://127.0.0.1:7002",
            &format!("http://{}", services.credit_addr),
        );
    // The hook exactly as docs/hooks.md shows it.
    let docs =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/hooks.md")).unwrap();
    let hook = docs
        .split("```yaml\n    - name: charge\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("docs/hooks.md shows the charge hook");
    let chain = format!(
        "apiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata: {{name: charged, namespace: default}}\nspec:\n  target: paid\n  triggerPoint: input\n  hooks:\n    - name: charge\n{hook}"
    );
    let h = Harness::start(&[("caps.yaml", &caps), ("chain.yaml", &chain)]).await;
    let ctx: HashMap<String, String> = [("user_id".to_string(), "cat".to_string())].into();
    let mut actions = Vec::new();
    for i in 0..4 {
        let r = h
            .run(
                "paid",
                "input",
                proto::run_request::Payload::Text(format!("message {i}")),
                ctx.clone(),
            )
            .await
            .unwrap();
        actions.push((action(&r), r.message.clone()));
    }
    assert_eq!(
        actions,
        [
            (Action::Pass, String::new()),
            (Action::Pass, String::new()),
            (Action::Pass, String::new()),
            (Action::Block, "You have no credit left.".to_string()),
        ]
    );
    assert_eq!(services.credit.balance("cat"), (0, 0));
    assert_eq!(services.credit.open_holds("cat"), 0);
    h.stop_and_check_leaks().await;
    services.stop();
}
