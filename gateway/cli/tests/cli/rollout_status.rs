//! `sluice rollout status` against a real local gateway (runsc sandboxes, its metrics port): a
//! canary is followed step by step until its hooks are live (exit 0), a rolled-back shadow ends the
//! wait with exit 1, and a wrong chain or address says what is there instead.

use sluice_gateway::{LocalOptions, start_local};
use sluice_proto::{self as proto, gateway_client::GatewayClient};
use std::path::Path;
use std::time::{Duration, Instant};

fn chain(code: &str, rollout: &str) -> String {
    format!(
        "apiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata:\n  name: bot-input\n  namespace: default\nspec:\n  target: bot\n  triggerPoint: input\n  pool: {{warm: 1, max: 4}}\n{rollout}  hooks:\n    - name: tag\n      action: modify\n      code: |\n        def execute(context, settings):\n            return {{'action': 'modify', 'outgoing': context['outgoing'] + ' {code}'}}\n"
    )
}

/// Replaces the chain file in one step, as an editor's save does.
fn save(dir: &Path, text: &str) {
    let tmp = dir.join(".bot.yaml.tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, dir.join("bot.yaml")).unwrap();
}

fn sluice(args: &[&str]) -> tokio::process::Command {
    let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_sluice"));
    c.args(["rollout", "status"]).args(args);
    c.env_remove("SLUICE_METRICS");
    c.stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    c
}

async fn status(args: &[&str]) -> (i32, String, String) {
    let out = sluice(args).output().await.expect("sluice runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Until `check` holds of the chain's /rollouts entry (30 s).
async fn until(
    metrics: &str,
    what: &str,
    check: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let all = sluice_cli::rollout::fetch(metrics)
            .await
            .expect("/rollouts answers");
        if let Ok(entry) = sluice_cli::rollout::find(&all, "default/bot-input")
            && check(entry)
        {
            return entry.clone();
        }
        assert!(Instant::now() < deadline, "never {what}: {all:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollout_status_follows_a_canary_to_the_end_and_a_rollback_fails_it() {
    let dir = tempfile::tempdir().unwrap();
    let state = tempfile::tempdir().unwrap();
    save(dir.path(), &chain("v1", ""));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap();
    let mut opts = LocalOptions::new(dir.path(), state.path());
    opts.metrics = Some(port);
    let gateway = start_local(opts).await.expect("the gateway starts");
    let metrics = port.to_string();
    let mut client = GatewayClient::connect(format!("http://{}", gateway.addr))
        .await
        .unwrap();

    // Nothing in progress: a look and a watch both say the hooks are live, at once.
    let (code, out, err) = status(&["bot-input", "--metrics", &metrics, "--watch=false"]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("default/bot-input: RolledOut: "), "{out}");
    let (code, out, _) = status(&["default/bot-input", "--metrics", &metrics]).await;
    assert_eq!(code, 0);
    assert!(out.contains("RolledOut"), "{out}");

    // A wrong name lists what there is; a wrong address says what it tried.
    let (code, _, err) = status(&["bot-output", "--metrics", &metrics]).await;
    assert_eq!(code, 1);
    assert!(
        err.contains("no chain default/bot-output: the gateway serves default/bot-input"),
        "{err}"
    );
    let (code, _, err) = status(&["bot-input", "--metrics", "127.0.0.1:1"]).await;
    assert_eq!(code, 1);
    assert!(
        err.contains("cannot reach the gateway's metrics port at 127.0.0.1:1"),
        "{err}"
    );

    // A canary: the watch prints its step with each version's numbers and ends when it is promoted.
    save(
        dir.path(),
        &chain(
            "v2",
            "  rollout: {strategy: Canary, steps: [50], stepDuration: 1s, minRuns: 2}\n",
        ),
    );
    until(&metrics, "a canary", |e| e["phase"] == "Progressing").await;
    let watcher = sluice(&["bot-input", "--metrics", &metrics, "--timeout", "60s"])
        .spawn()
        .unwrap();
    let pid = watcher.id();
    let waited = tokio::spawn(watcher.wait_with_output());
    let mut session = 0;
    while !waited.is_finished() {
        session += 1;
        let req = proto::RunRequest {
            namespace: "default".into(),
            target: "bot".into(),
            trigger_point: "input".into(),
            payload: Some(proto::run_request::Payload::Text("hi".into())),
            session_id: format!("s{session}"),
            ..Default::default()
        };
        client.run(req).await.expect("a run");
        assert!(session < 2000, "the canary never ended (watcher {pid:?})");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let out = waited.await.unwrap().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    println!("$ sluice rollout status bot-input\n{text}");
    assert_eq!(out.status.code(), Some(0), "{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[0].starts_with("default/bot-input: Progressing: "),
        "{text}"
    );
    assert!(lines[1].starts_with("  live "), "{text}");
    assert!(lines[2].starts_with("  candidate "), "{text}");
    assert!(
        lines
            .last()
            .unwrap()
            .starts_with("default/bot-input: RolledOut: "),
        "{text}"
    );

    // A shadow rolled back by hand: the watch ends with exit 1 and says so.
    save(dir.path(), &chain("v3", "  rollout: {strategy: Shadow}\n"));
    let shadowing = until(&metrics, "shadowing", |e| e["phase"] == "Shadowing").await;
    let candidate = shadowing["candidate_revision"]
        .as_str()
        .unwrap()
        .to_string();
    let (code, out, _) = status(&["bot-input", "--metrics", &metrics, "--watch=false"]).await;
    assert_eq!(
        code, 0,
        "a look at a rollout in progress is not a failure: {out}"
    );
    assert!(out.contains("Shadowing"), "{out}");
    let (code, out, _) = status(&[
        "bot-input",
        "--metrics",
        &metrics,
        "-o",
        "json",
        "--watch=false",
    ])
    .await;
    assert_eq!(code, 0);
    let entry: serde_json::Value = serde_json::from_str(&out).expect("one JSON entry");
    assert_eq!(entry["candidate_revision"], candidate.as_str());
    let watcher = sluice(&["bot-input", "--metrics", &metrics, "--timeout", "60s"])
        .spawn()
        .unwrap();
    let annotated = chain("v3", "  rollout: {strategy: Shadow}\n").replacen(
        "metadata:\n",
        &format!("metadata:\n  annotations:\n    sluice.dev/rollback: \"{candidate}\"\n"),
        1,
    );
    save(dir.path(), &annotated);
    let out = watcher.wait_with_output().await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.lines().next().unwrap().contains("Shadowing"), "{text}");
    assert!(
        text.lines()
            .last()
            .unwrap()
            .starts_with("default/bot-input: RolledBack: "),
        "{text}"
    );

    // A wait that times out fails and says what it waited for.
    save(dir.path(), &chain("v4", "  rollout: {strategy: Shadow}\n"));
    until(&metrics, "shadowing again", |e| e["phase"] == "Shadowing").await;
    let (code, _, err) = status(&["bot-input", "--metrics", &metrics, "--timeout", "1s"]).await;
    assert_eq!(code, 1);
    assert!(err.contains("timed out waiting for bot-input"), "{err}");
    gateway.shutdown().await;
}
