//! Local-mode end to end: real gateway, real gRPC, real runsc sandboxes. Each test ends by checking
//! that nothing of its sandboxes is left behind.

use serde_json::json;
use sluice_e2e::{Harness, action, chain_yaml, text};
use sluice_proto::{self as proto, Action};
use std::time::{Duration, Instant};

const UPPER: &str = "def execute(context, settings):\n    return {'action': 'modify', 'outgoing': context['outgoing'].upper()}\n";
const PASS: &str = "def execute(context, settings):\n    return {'action': 'pass'}\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_action_and_the_walk_stops_at_the_terminal_index() {
    let chains = [
        chain_yaml(
            "mod",
            "t-modify",
            "input",
            "",
            &[("up", "modify", UPPER), ("p", "detect", PASS)],
        ),
        chain_yaml(
            "det",
            "t-detect",
            "input",
            "",
            &[(
                "find",
                "detect",
                "def execute(context, settings):\n    return {'action': 'detect', 'findings': {'len': len(context['outgoing'])}}\n",
            )],
        ),
        chain_yaml(
            "blk",
            "t-block",
            "input",
            "",
            &[
                ("up", "modify", UPPER),
                (
                    "stop",
                    "block",
                    "def execute(c, s):\n    return {'action': 'block', 'message': 'no: ' + c['outgoing']}\n",
                ),
                (
                    "never",
                    "modify",
                    "def execute(c, s):\n    return {'action': 'modify', 'outgoing': 'REACHED'}\n",
                ),
            ],
        ),
        chain_yaml(
            "skp",
            "t-skip",
            "input",
            "",
            &[
                (
                    "cache",
                    "skip",
                    "def execute(c, s):\n    return {'action': 'skip', 'message': 'cached answer'}\n",
                ),
                (
                    "never",
                    "modify",
                    "def execute(c, s):\n    return {'action': 'modify', 'outgoing': 'REACHED'}\n",
                ),
            ],
        ),
        chain_yaml("pas", "t-pass", "input", "", &[("p", "detect", PASS)]),
    ];
    let files: Vec<(String, String)> = chains
        .iter()
        .enumerate()
        .map(|(i, c)| (format!("c{i}.yaml"), c.clone()))
        .collect();
    let refs: Vec<(&str, &str)> = files
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    let h = Harness::start(&refs).await;

    let r = h.run_text("t-modify", "input", "hello").await.unwrap();
    assert_eq!((action(&r), text(&r)), (Action::Modify, "HELLO"));
    assert_eq!(r.hooks.len(), 2);
    assert_eq!(r.terminal_index, None);

    let r = h.run_text("t-detect", "input", "four").await.unwrap();
    assert_eq!(action(&r), Action::Detect);
    assert_eq!(
        sluice_e2e::from_proto(r.hooks[0].findings.as_ref().unwrap()),
        json!({"len": 4})
    );
    assert_eq!(text(&r), "four");

    let r = h.run_text("t-block", "input", "hi").await.unwrap();
    assert_eq!(
        (action(&r), r.terminal_index, r.message.as_str()),
        (Action::Block, Some(1), "no: HI")
    );
    assert_eq!(
        r.hooks.iter().map(|h| h.name.as_str()).collect::<Vec<_>>(),
        ["up", "stop"],
        "the walk stops at the terminal hook"
    );

    let r = h.run_text("t-skip", "input", "hi").await.unwrap();
    assert_eq!(
        (action(&r), r.terminal_index, r.message.as_str()),
        (Action::Skip, Some(0), "cached answer")
    );
    assert_eq!(r.hooks.len(), 1);

    let r = h.run_text("t-pass", "input", "same").await.unwrap();
    assert_eq!((action(&r), text(&r)), (Action::Pass, "same"));

    let audit = h.audit();
    assert_eq!(audit.len(), 5, "one audit event per run");
    assert!(audit.iter().all(|e| {
        e["code_hash"]
            .as_str()
            .is_some_and(|c| c.starts_with("sha256:"))
    }));
    h.stop_and_check_leaks().await;
}

fn failing_hooks() -> Vec<(&'static str, &'static str, &'static str)> {
    vec![
        (
            "undeclared",
            "detect",
            // Built at run time, so the static check passes it and the gateway's re-check must not.
            "def execute(c, s):\n    return {'action': 'bl' + 'ock', 'message': 'sneaky'}\n",
        ),
        (
            "raises",
            "modify",
            "def execute(c, s):\n    raise RuntimeError('broken hook')\n",
        ),
        (
            "malformed",
            "modify",
            // Built at run time too: `sluice check` refuses a literal list.
            "def execute(c, s):\n    return list(('not', 'a', 'dict'))\n",
        ),
        ("up", "modify", UPPER),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hook_errors_under_both_failure_policies() {
    let closed = chain_yaml(
        "closed",
        "t-closed",
        "input",
        "failurePolicy: Closed",
        &failing_hooks(),
    );
    let open = chain_yaml(
        "open",
        "t-open",
        "input",
        "failurePolicy: Open",
        &failing_hooks(),
    );
    let h = Harness::start(&[("closed.yaml", &closed), ("open.yaml", &open)]).await;

    // Closed: the first failing hook ends the run as block with the reason stated.
    let r = h.run_text("t-closed", "input", "x").await.unwrap();
    assert_eq!((action(&r), r.terminal_index), (Action::Block, Some(0)));
    assert!(
        r.message.contains("\"undeclared\"") && r.message.contains("declared 'detect'"),
        "{}",
        r.message
    );
    assert_eq!(r.hooks.len(), 1);

    // Open: every failing hook is recorded, the payload passes on unchanged, and the rest runs.
    let r = h.run_text("t-open", "input", "x").await.unwrap();
    assert_eq!(
        (action(&r), text(&r), r.terminal_index),
        (Action::Modify, "X", None)
    );
    let errors: Vec<&str> = r.hooks.iter().map(|h| h.error.as_str()).collect();
    assert!(errors[0].contains("declared 'detect'"), "{errors:?}");
    assert!(
        errors[1].contains("RuntimeError: broken hook"),
        "{errors:?}"
    );
    assert!(errors[2].contains("not a dict"), "{errors:?}");
    assert_eq!(errors[3], "");

    let audit = h.audit();
    assert_eq!(audit.len(), 2);
    assert!(
        audit[1]["hooks"][1]["error"]
            .as_str()
            .unwrap()
            .contains("broken hook")
    );
    h.stop_and_check_leaks().await;
}

/// Code Python's compiler refuses (`break` outside a loop parses, but does not compile) is never
/// served: the chain is refused when read, with the reason. Code compiled while a hook runs and
/// refused then is that hook's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compile_errors_are_refused_when_read_and_hook_errors_at_run_time() {
    let bad = chain_yaml(
        "bad",
        "t-bad",
        "input",
        "failurePolicy: Open",
        &[
            (
                "broken",
                "modify",
                "def execute(c, s):\n    return {'action': 'pass'}\nbreak\n",
            ),
            ("up", "modify", UPPER),
        ],
    );
    let late = chain_yaml(
        "late",
        "t-late",
        "input",
        "failurePolicy: Open",
        &[
            (
                "broken",
                "modify",
                "def execute(c, s):\n    exec(compile('break', '<late>', 'exec'))\n    return {'action': 'pass'}\n",
            ),
            ("up", "modify", UPPER),
        ],
    );
    let h = Harness::start(&[("bad.yaml", &bad), ("late.yaml", &late)]).await;
    let refused = h.run_text("t-bad", "input", "x").await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::NotFound, "{refused:?}");
    let errors: Vec<String> = h
        .gateway()
        .engine
        .registry()
        .errors()
        .iter()
        .map(|e| e.to_string())
        .collect();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("bad.yaml") && e.contains("'break' outside loop")),
        "{errors:?}"
    );
    let r = h.run_text("t-late", "input", "x").await.unwrap();
    assert!(r.hooks[0].error.contains("SyntaxError"), "{:?}", r.hooks[0]);
    assert_eq!(text(&r), "X");
    h.stop_and_check_leaks().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_infinite_loop_hits_the_deadline_and_the_next_run_is_fine() {
    let looping = chain_yaml(
        "loop",
        "t-loop",
        "input",
        "timeoutMs: 300\nfailurePolicy: Closed",
        &[(
            "spin",
            "modify",
            "def execute(c, s):\n    if c['outgoing'] == 'spin':\n        while True:\n            pass\n    return {'action': 'modify', 'outgoing': 'ok'}\n",
        )],
    );
    let open = chain_yaml(
        "loop-open",
        "t-loop-open",
        "input",
        "timeoutMs: 300\nfailurePolicy: Open",
        &[
            (
                "spin",
                "modify",
                "def execute(c, s):\n    while True:\n        pass\n",
            ),
            ("up", "modify", UPPER),
        ],
    );
    let h = Harness::start(&[("loop.yaml", &looping), ("open.yaml", &open)]).await;
    let began = Instant::now();
    let r = h.run_text("t-loop", "input", "spin").await.unwrap();
    assert!(
        began.elapsed() < Duration::from_secs(5),
        "the deadline ended the run"
    );
    assert_eq!((action(&r), r.terminal_index), (Action::Block, Some(0)));
    assert!(
        r.message.contains("timed out after 300 ms"),
        "{}",
        r.message
    );
    let killed = h.audit()[0]["sandbox"].as_str().unwrap().to_string();
    let _ = &killed;

    let r = h.run_text("t-loop", "input", "fine").await.unwrap();
    assert_eq!((action(&r), text(&r)), (Action::Modify, "ok"));

    // Open: the hung hook is skipped and the rest of the chain runs in a fresh sandbox.
    let r = h.run_text("t-loop-open", "input", "x").await.unwrap();
    assert_eq!((action(&r), text(&r)), (Action::Modify, "X"));
    assert!(r.hooks[0].error.contains("timed out"), "{:?}", r.hooks[0]);

    // The supervisor stopped the loop itself: the sandbox that ran it served on.
    assert!(
        h.gateway().backend().live().await.contains(&killed),
        "the sandbox {killed} of a timed-out hook was destroyed"
    );
    h.stop_and_check_leaks().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_gib_allocation_is_contained() {
    let bomb = chain_yaml(
        "bomb",
        "t-bomb",
        "input",
        "resources: {memory: 128Mi}\nfailurePolicy: Closed",
        &[(
            "bomb",
            "modify",
            "def execute(c, s):\n    blob = bytearray(1 << 30)\n    return {'action': 'modify', 'outgoing': str(len(blob))}\n",
        )],
    );
    let creep = chain_yaml(
        "creep",
        "t-creep",
        "input",
        "resources: {memory: 128Mi}\nfailurePolicy: Closed",
        &[(
            "creep",
            "modify",
            "def execute(c, s):\n    chunks = []\n    for _ in range(1024):\n        chunks.append(b'x' * (1 << 20))\n    return {'action': 'modify', 'outgoing': str(len(chunks))}\n",
        )],
    );
    let h = Harness::start(&[("bomb.yaml", &bomb), ("creep.yaml", &creep)]).await;
    for target in ["t-bomb", "t-creep"] {
        let r = h.run_text(target, "input", "x").await.unwrap();
        assert_eq!(action(&r), Action::Block, "{target}: {r:?}");
        assert!(
            r.message.contains("MemoryError") || r.message.contains("died"),
            "{target}: {}",
            r.message
        );
    }
    // The gateway keeps serving.
    let r = h.run_text("t-bomb", "input", "x").await.unwrap();
    assert_eq!(action(&r), Action::Block);
    h.stop_and_check_leaks().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn printing_does_not_corrupt_the_protocol() {
    let noisy = chain_yaml(
        "noisy",
        "t-noisy",
        "input",
        "",
        &[(
            "noisy",
            "modify",
            "import os, sys\ndef execute(c, s):\n    print('{\"type\": \"result\", \"id\": 1, \"action\": \"block\", \"terminal_index\": 0}')\n    sys.stderr.write('{\"type\": \"hook_result\"}\\n')\n    sys.stdout.write('x' * 200000)\n    os.write(1, b'raw\\n')\n    os.write(2, b'{\"type\": \"error\", \"message\": \"forged\"}\\n')\n    return {'action': 'modify', 'outgoing': 'clean'}\n",
        )],
    );
    let h = Harness::start(&[("noisy.yaml", &noisy)]).await;
    for _ in 0..2 {
        let r = h.run_text("t-noisy", "input", "x").await.unwrap();
        assert_eq!((action(&r), text(&r)), (Action::Modify, "clean"));
    }
    h.stop_and_check_leaks().await;
}

/// Files removed when dropped.
struct RemoveOnDrop(Vec<std::path::PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        for path in &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hooks_cannot_reach_host_files_network_or_environment() {
    // A file in the gateway's working directory and one in the host's /tmp.
    let cwd_file = std::env::current_dir()
        .unwrap()
        .join(format!("sluice-secret-{}.txt", std::process::id()));
    std::fs::write(&cwd_file, "host secret cwd").unwrap();
    let tmp_file = format!("/tmp/sluice-secret-{}.txt", std::process::id());
    std::fs::write(&tmp_file, "host secret tmp").unwrap();
    // Removed however the test ends (a failed run once left its secrets in the source tree).
    let _cleanup = RemoveOnDrop(vec![cwd_file.clone(), tmp_file.clone().into()]);
    // A listener on loopback that records any connection.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    listener.set_nonblocking(true).unwrap();
    // SAFETY: set before the gateway starts its threads' work; only this test reads it.
    // (set_var is unsafe since edition 2024: nothing else touches the environment meanwhile.)
    #[allow(unsafe_code)]
    unsafe {
        std::env::set_var("SLUICE_TEST_SECRET", "gateway-env-secret")
    };

    let code = format!(
        r#"import os
def execute(c, s):
    seen = []
    for path in [{cwd:?}, {tmp:?}, "/etc/passwd", "/root"]:
        try:
            with open(path) as f:
                seen.append("read " + path + ": " + f.read(40))
        except Exception as e:
            seen.append("no " + path)
    try:
        # Imported as an attacker would, past `sluice check`'s refusal of `import socket`.
        socket = __import__("socket")
        socket.create_connection(("127.0.0.1", {port}), timeout=1).close()
        seen.append("connected")
    except Exception as e:
        seen.append("no network: " + type(e).__name__)
    seen.append("env: " + ",".join(sorted(os.environ)))
    seen.append("secret: " + str("gateway-env-secret" in str(os.environ)))
    return {{"action": "modify", "outgoing": "\n".join(seen)}}
"#,
        cwd = cwd_file.to_string_lossy(),
        tmp = tmp_file,
    );
    let chain = chain_yaml(
        "probe",
        "t-probe",
        "input",
        "",
        &[("probe", "modify", &code)],
    );
    let h = Harness::start(&[("probe.yaml", &chain)]).await;
    let r = h.run_text("t-probe", "input", "x").await.unwrap();
    let report = text(&r).to_string();
    assert!(
        !report.contains("host secret"),
        "a hook read a host file:\n{report}"
    );
    assert!(
        report.contains(&format!("no {}", cwd_file.to_string_lossy())),
        "{report}"
    );
    assert!(report.contains(&format!("no {tmp_file}")), "{report}");
    assert!(
        report.contains("no /etc/passwd") && report.contains("no /root"),
        "{report}"
    );
    assert!(report.contains("no network"), "{report}");
    assert!(
        listener.accept().is_err(),
        "the hook connected to the host's loopback listener"
    );
    assert!(report.contains("secret: False"), "{report}");
    assert!(!report.contains("SLUICE_TEST_SECRET"), "{report}");
    h.stop_and_check_leaks().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_runs_are_all_correct() {
    let chain = chain_yaml(
        "echo",
        "t-many",
        "input",
        "pool: {warm: 4, max: 24}",
        &[
            (
                "tag",
                "modify",
                "def execute(c, s):\n    return {'action': 'modify', 'outgoing': c['outgoing'] + ':' + c['caller']['n']}\n",
            ),
            ("up", "modify", UPPER),
        ],
    );
    let h = Harness::start(&[("many.yaml", &chain)]).await;
    let runs = (0..20).map(|i| {
        let h = &h;
        async move {
            let ctx = [("n".to_string(), i.to_string())].into();
            let r = h
                .run(
                    "t-many",
                    "input",
                    proto::run_request::Payload::Text(format!("run{i}")),
                    ctx,
                )
                .await
                .unwrap();
            (i, r)
        }
    });
    for (i, r) in futures::future::join_all(runs).await {
        assert_eq!(text(&r), format!("RUN{i}:{i}"));
    }
    let audit = h.audit();
    assert_eq!(audit.len(), 20);
    // reuse: Recycle (the default): sandboxes served one trigger point after another, each in a
    // cell of its own, never two at once (the outputs above are each run's own).
    let sandboxes: std::collections::HashSet<&str> = audit
        .iter()
        .map(|e| e["sandbox"].as_str().unwrap())
        .collect();
    assert!(
        !sandboxes.is_empty() && sandboxes.len() <= 20,
        "{sandboxes:?}"
    );
    h.stop_and_check_leaks().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_get_the_stated_status_codes() {
    let chain = chain_yaml("c", "t-codes", "input", "", &[("p", "detect", PASS)]);
    let tool = chain_yaml(
        "tool",
        "t-codes",
        "before_tool",
        "",
        &[("p", "detect", PASS)],
    );
    let h = Harness::start_with(&[("c.yaml", &chain), ("tool.yaml", &tool)], |o| {
        o.limits.request_bytes = 64 * 1024;
        o.limits.payload_bytes = 16 * 1024;
    })
    .await;
    let code = |r: Result<proto::RunResponse, tonic::Status>| r.unwrap_err().code();

    assert_eq!(
        code(h.run_text("nobody", "input", "x").await),
        tonic::Code::NotFound
    );
    assert_eq!(
        code(h.run_text("t-codes", "sideways", "x").await),
        tonic::Code::InvalidArgument
    );
    assert_eq!(
        code(h.run_value("t-codes", "input", json!({"a": 1})).await),
        tonic::Code::InvalidArgument
    );
    assert_eq!(
        code(h.run_text("t-codes", "before_tool", "x").await),
        tonic::Code::InvalidArgument
    );
    // Over the payload limit, and over the transport's message limit (refused before decoding):
    // INVALID_ARGUMENT both, and the gateway keeps serving.
    assert_eq!(
        code(h.run_text("t-codes", "input", &"x".repeat(32 * 1024)).await),
        tonic::Code::InvalidArgument
    );
    assert_eq!(
        code(
            h.run_text("t-codes", "input", &"x".repeat(100 * 1024))
                .await
        ),
        tonic::Code::InvalidArgument
    );
    let mut empty = proto::RunRequest {
        namespace: "default".into(),
        target: "t-codes".into(),
        trigger_point: "input".into(),
        ..Default::default()
    };
    assert_eq!(
        h.client
            .clone()
            .run(empty.clone())
            .await
            .unwrap_err()
            .code(),
        tonic::Code::InvalidArgument
    );
    empty.namespace.clear();
    empty.payload = Some(proto::run_request::Payload::Text("x".into()));
    assert_eq!(
        h.client.clone().run(empty).await.unwrap_err().code(),
        tonic::Code::InvalidArgument
    );
    let r = h
        .run_value(
            "t-codes",
            "before_tool",
            json!({"name": "read", "arguments": {"path": "a"}}),
        )
        .await
        .unwrap();
    assert_eq!(action(&r), Action::Pass);

    // Health reports serving once warm; reflection lists the Gateway service.
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", h.gateway().addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let mut serving = false;
    for _ in 0..50 {
        let s = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: "sluice.v1.Gateway".into(),
            })
            .await
            .unwrap()
            .into_inner();
        if s.status == tonic_health::pb::health_check_response::ServingStatus::Serving as i32 {
            serving = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(serving, "health never reported SERVING");
    // Reflection lists the Gateway service, so grpcurl and friends work without the proto files.
    use tonic_reflection::pb::v1::{
        ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
    };
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", h.gateway().addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let ask = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = ServerReflectionClient::new(channel)
        .server_reflection_info(futures::stream::iter([ask]))
        .await
        .unwrap()
        .into_inner();
    let listed = match answers
        .message()
        .await
        .unwrap()
        .and_then(|r| r.message_response)
    {
        Some(MessageResponse::ListServicesResponse(l)) => {
            l.service.into_iter().map(|s| s.name).collect::<Vec<_>>()
        }
        other => panic!("unexpected reflection answer {other:?}"),
    };
    assert!(
        listed.iter().any(|s| s == "sluice.v1.Gateway"),
        "{listed:?}"
    );
    let refused = h.audit().iter().filter(|e| e["error"].is_string()).count();
    assert!(refused >= 5, "refused requests are audited too");
    h.stop_and_check_leaks().await;
}
