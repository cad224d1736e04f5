//! The `sluice-gateway` binary in local mode: bad files are reported with file and line while the
//! rest serves, the directory is watched and swapped atomically, in-flight runs finish on the chain
//! they started with, and sandboxes left by a killed gateway are removed at the next start.

use sluice_proto::{self as proto, gateway_client::GatewayClient};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const GOOD: &str = r#"apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: good}
spec:
  target: bot
  triggerPoint: input
  pool: {warm: 1, max: 4}
  hooks:
    - name: tag
      action: modify
      settings: {tag: v1}
      code: |
        import time
        def execute(context, settings):
            if context["outgoing"] == "slow":
                time.sleep(1.5)
            return {"action": "modify", "outgoing": settings["tag"]}
"#;

/// Second document is broken on line 9 of the file (an unknown trigger point).
const BAD: &str = r#"apiVersion: sluice.dev/v1alpha1
kind: Capability
metadata: {name: echo}
spec: {endpoint: {builtin: echo}}
---
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: bad}
spec: {target: other, triggerPoint: upside_down, hooks: [{name: a, action: block, code: "x"}]}
"#;

struct Gateway {
    child: Child,
    addr: String,
    stderr_lines: std::sync::mpsc::Receiver<String>,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start(dir: &Path, state: &Path) -> Gateway {
    let port = free_port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice-gateway"))
        .arg("--local")
        .arg(dir)
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--state-dir")
        .arg(state)
        .arg("--audit")
        .arg(state.join("audit.jsonl"))
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("gateway binary starts");
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    Gateway {
        child,
        addr: format!("http://127.0.0.1:{port}"),
        stderr_lines: rx,
    }
}

/// A test that fails leaves no gateway behind: asked to stop (it removes its sandboxes), then killed.
impl Drop for Gateway {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = Command::new("kill")
                .args(["-TERM", &self.child.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(20);
            while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Gateway {
    fn wait_for_log(&self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.stderr_lines.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return line,
                Ok(_) => {}
                Err(_) => break,
            }
        }
        panic!("the gateway never logged {needle:?}");
    }

    async fn client(&self) -> GatewayClient<tonic::transport::Channel> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(c) = GatewayClient::connect(self.addr.clone()).await {
                return c;
            }
            assert!(Instant::now() < deadline, "gateway never listened");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

async fn run(
    client: &mut GatewayClient<tonic::transport::Channel>,
    target: &str,
    text: &str,
) -> Result<proto::RunResponse, tonic::Status> {
    let req = proto::RunRequest {
        namespace: "default".into(),
        target: target.into(),
        trigger_point: "input".into(),
        payload: Some(proto::run_request::Payload::Text(text.into())),
        ..Default::default()
    };
    client.run(req).await.map(|r| r.into_inner())
}

fn text(r: &proto::RunResponse) -> String {
    match &r.payload {
        Some(proto::run_response::Payload::Text(t)) => t.clone(),
        _ => String::new(),
    }
}

fn runsc_list(state: &Path) -> String {
    let out = Command::new("runsc")
        .arg("--root")
        .arg(state.join("runsc"))
        .arg("list")
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .skip(1)
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_files_are_reported_watched_changes_swap_and_in_flight_runs_keep_their_chain() {
    let dir = tempfile::tempdir().unwrap();
    let state = tempfile::Builder::new()
        .prefix("sluice-lm")
        .tempdir_in("/tmp")
        .unwrap();
    std::fs::write(dir.path().join("good.yaml"), GOOD).unwrap();
    std::fs::write(dir.path().join("bad.yaml"), BAD).unwrap();
    let mut gw = start(dir.path(), state.path());
    let line = gw.wait_for_log("bad.yaml:9", Duration::from_secs(30));
    assert!(line.contains("upside_down"), "{line}");
    let mut client = gw.client().await;
    let r = run(&mut client, "bot", "hi").await.unwrap();
    assert_eq!(text(&r), "v1", "the good chain serves despite the bad file");

    // A run in flight on v1 while the file changes to v2 and a broken file is dropped in.
    let mut slow_client = client.clone();
    let in_flight = tokio::spawn(async move { run(&mut slow_client, "bot", "slow").await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    std::fs::write(
        dir.path().join("dropped.yaml"),
        "kind: HookChain\napiVersion: sluice.dev/v1alpha1\nmetadata: [oops\n",
    )
    .unwrap();
    let tmp = dir.path().join(".good.yaml.tmp");
    std::fs::write(&tmp, GOOD.replace("tag: v1", "tag: v2")).unwrap();
    std::fs::rename(&tmp, dir.path().join("good.yaml")).unwrap();
    let r = in_flight.await.unwrap().unwrap();
    assert_eq!(
        text(&r),
        "v1",
        "a run finishes on the chain it started with"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = run(&mut client, "bot", "hi").await.unwrap();
        if text(&r) == "v2" {
            break;
        }
        assert!(Instant::now() < deadline, "the change was never picked up");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Removing the file removes the chain.
    std::fs::remove_file(dir.path().join("good.yaml")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while run(&mut client, "bot", "hi").await.map_err(|s| s.code()) != Err(tonic::Code::NotFound) {
        assert!(Instant::now() < deadline, "the removed chain still serves");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // SIGTERM: graceful exit, nothing left.
    sigterm(&gw.child);
    let status = gw.child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert_eq!(
        runsc_list(state.path()),
        "",
        "sandboxes left after a clean shutdown"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxes_of_a_killed_gateway_are_removed_at_the_next_start() {
    let dir = tempfile::tempdir().unwrap();
    let state = tempfile::Builder::new()
        .prefix("sluice-crash")
        .tempdir_in("/tmp")
        .unwrap();
    std::fs::write(
        dir.path().join("good.yaml"),
        GOOD.replace("warm: 1", "warm: 3"),
    )
    .unwrap();
    let mut gw = start(dir.path(), state.path());
    let mut client = gw.client().await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while runsc_list(state.path()).lines().count() < 3 {
        assert!(Instant::now() < deadline, "pool never filled");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(text(&run(&mut client, "bot", "hi").await.unwrap()), "v1");
    gw.child.kill().unwrap();
    gw.child.wait().unwrap();
    // What a killed gateway leaves: its bundles always, and containers unless they wound down by
    // themselves when their stdin closed.
    let old: Vec<String> = std::fs::read_dir(state.path().join("bundles"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    assert!(!old.is_empty(), "a SIGKILLed gateway leaves its bundles");

    let mut gw = start(dir.path(), state.path());
    gw.wait_for_log("listening", Duration::from_secs(60));
    let list = runsc_list(state.path());
    for id in &old {
        assert!(
            !list.contains(id.as_str()),
            "leftover {id} still listed:\n{list}"
        );
        assert!(
            !state.path().join("bundles").join(id).exists(),
            "leftover bundle {id}"
        );
    }
    let mut client = gw.client().await;
    assert_eq!(text(&run(&mut client, "bot", "hi").await.unwrap()), "v1");
    sigterm(&gw.child);
    assert!(gw.child.wait().unwrap().success());
    assert_eq!(runsc_list(state.path()), "");
    let bundles = std::fs::read_dir(state.path().join("bundles"))
        .unwrap()
        .count();
    assert_eq!(bundles, 0, "bundles left");
}

/// Asks the gateway process to stop, as a service manager would.
fn sigterm(child: &std::process::Child) {
    let status = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill(1) runs");
    assert!(status.success(), "kill -TERM failed");
}

/// Waits until a run of `bot` answers `want` (the directory is re-read within a second).
async fn until_answers(
    client: &mut GatewayClient<tonic::transport::Channel>,
    want: &str,
) -> proto::RunResponse {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(r) = run(client, "bot", "hi").await
            && text(&r) == want
        {
            return r;
        }
        assert!(
            Instant::now() < deadline,
            "the chain never answered {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_save_keeps_the_last_valid_version_serving_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let state = tempfile::Builder::new()
        .prefix("sluice-lv")
        .tempdir_in("/tmp")
        .unwrap();
    let file = dir.path().join("good.yaml");
    let save = |text: String| {
        let tmp = dir.path().join(".good.yaml.tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, &file).unwrap();
    };
    std::fs::write(&file, GOOD).unwrap();
    let gw = start(dir.path(), state.path());
    let mut client = gw.client().await;
    until_answers(&mut client, "v1").await;

    // A syntax error in the hook: its code line 4 is line 16 of the file.
    save(
        GOOD.replace("tag: v1", "tag: v2")
            .replace("time.sleep(1.5)", "time.sleep(1.5"),
    );
    let line = gw.wait_for_log("good.yaml:16", Duration::from_secs(30));
    assert!(
        line.contains("SyntaxError") && line.contains("last valid version keeps serving"),
        "{line}"
    );
    let r = run(&mut client, "bot", "hi").await.unwrap();
    assert_eq!(text(&r), "v1", "the last valid version answers");
    assert!(r.hooks.iter().all(|h| h.error.is_empty()), "{r:?}");

    // A schema typo: the chain neither disappears (NOT_FOUND) nor changes.
    save(
        GOOD.replace("tag: v1", "tag: v3")
            .replace("triggerPoint: input", "triggerPoint: Input"),
    );
    let line = gw.wait_for_log("good.yaml:6", Duration::from_secs(30));
    assert!(line.contains("Input"), "{line}");
    let r = run(&mut client, "bot", "hi").await.expect("no NOT_FOUND");
    assert_eq!(text(&r), "v1");

    // An unknown field is a failed check too.
    save(
        GOOD.replace("tag: v1", "tag: v4")
            .replace("  pool:", "  failurepolicy: Open\n  pool:"),
    );
    let line = gw.wait_for_log("failurepolicy", Duration::from_secs(30));
    assert!(line.contains("did you mean \"failurePolicy\""), "{line}");
    assert_eq!(text(&run(&mut client, "bot", "hi").await.unwrap()), "v1");

    // The audit of runs served by the older version says so.
    let audit = std::fs::read_to_string(state.path().join("audit.jsonl")).unwrap();
    let last: serde_json::Value =
        serde_json::from_str(audit.lines().last().expect("an audit line")).unwrap();
    let note = last["superseded"].as_str().unwrap_or_default();
    assert!(
        note.contains("last valid version") && note.contains("good.yaml"),
        "{last}"
    );

    // Fixed: the newest version serves, and its runs are not marked.
    save(GOOD.replace("tag: v1", "tag: v5"));
    until_answers(&mut client, "v5").await;
    let audit = std::fs::read_to_string(state.path().join("audit.jsonl")).unwrap();
    let last: serde_json::Value =
        serde_json::from_str(audit.lines().last().expect("an audit line")).unwrap();
    assert!(last.get("superseded").is_none(), "{last}");
    drop(client);
    let mut gw = gw;
    sigterm(&gw.child);
    assert!(gw.child.wait().unwrap().success());
}

/// A FIFO among the chain files, present at start and while serving: the old reader blocked on it
/// forever (the gateway never listened). Now it is reported, Runs answer, and a change to another
/// file is picked up through file notifications.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_in_the_chain_directory_never_stalls_start_runs_or_reloads() {
    let dir = tempfile::tempdir().unwrap();
    let state = tempfile::Builder::new()
        .prefix("sluice-fifo")
        .tempdir_in("/tmp")
        .unwrap();
    let file = dir.path().join("good.yaml");
    std::fs::write(&file, GOOD).unwrap();
    let made = Command::new("mkfifo")
        .arg(dir.path().join("zz.yaml"))
        .status()
        .unwrap();
    assert!(made.success());
    let gw = start(dir.path(), state.path());
    let line = gw.wait_for_log("zz.yaml", Duration::from_secs(60));
    assert!(line.contains("a FIFO, not a regular file"), "{line}");
    gw.wait_for_log("file notifications", Duration::from_secs(30));
    let mut client = gw.client().await;
    until_answers(&mut client, "v1").await;

    // Nothing changes for a while: the directory is not read again (reading it is no change).
    let quiet = Instant::now() + Duration::from_secs(3);
    while let Some(left) = quiet.checked_duration_since(Instant::now()) {
        if let Ok(line) = gw.stderr_lines.recv_timeout(left) {
            assert!(
                !line.contains("registry loaded"),
                "the registry was reloaded with nothing changed: {line}"
            );
        }
    }

    let tmp = dir.path().join(".good.yaml.tmp");
    std::fs::write(&tmp, GOOD.replace("tag: v1", "tag: v2")).unwrap();
    std::fs::rename(&tmp, &file).unwrap();
    until_answers(&mut client, "v2").await;
    gw.wait_for_log("registry loaded", Duration::from_secs(5));
    drop(client);
    let mut gw = gw;
    sigterm(&gw.child);
    assert!(gw.child.wait().unwrap().success());
}

/// The audit on standard output, which nobody reads (in a cluster: the node's containerd stopped,
/// and with it the reader of the container's output). The gateway once blocked in the write of an
/// audit line as soon as the pipe was full: the run that wrote it, then every run, hung. Now every
/// run is answered: served while its line can wait in the gateway, then refused (UNAVAILABLE, the
/// client tries another replica); once the output is read, every served run's line is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_audit_nobody_reads_never_stalls_runs_and_loses_no_served_runs_line() {
    let dir = tempfile::tempdir().unwrap();
    let state = tempfile::Builder::new()
        .prefix("sluice-audit-pipe")
        .tempdir_in("/tmp")
        .unwrap();
    std::fs::write(
        dir.path().join("good.yaml"),
        GOOD.replace("warm: 1, max: 4", "warm: 2, max: 4"),
    )
    .unwrap();
    let port = free_port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice-gateway"))
        .arg("--local")
        .arg(dir.path())
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--state-dir")
        .arg(state.path())
        .arg("--audit")
        .arg("-")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("gateway binary starts");
    // Held, not read, until the end.
    let mut stdout = child.stdout.take().unwrap();
    let gw = Gateway {
        child,
        addr: format!("http://127.0.0.1:{port}"),
        stderr_lines: std::sync::mpsc::channel().1,
    };
    let client = gw.client().await;
    let (mut served, mut refused) = (Vec::new(), 0);
    // Four callers at once; a pipe (64 KiB) holds about a hundred lines.
    'calls: for round in 0..1000 {
        let calls = (0..4).map(|i| {
            let mut client = client.clone();
            async move {
                tokio::time::timeout(
                    Duration::from_secs(10),
                    run(&mut client, "bot", &format!("call {round} {i}")),
                )
                .await
            }
        });
        for r in futures::future::join_all(calls).await {
            match r {
                Ok(Ok(r)) => {
                    assert_eq!(text(&r), "v1");
                    served.push(r.run_id);
                }
                Ok(Err(s)) if s.code() == tonic::Code::Unavailable => {
                    assert!(
                        s.message().contains("audit log is not being written"),
                        "{s:?}"
                    );
                    refused += 1;
                }
                Ok(Err(s)) => panic!("a run failed: {s:?}"),
                Err(_) => panic!(
                    "a run was not answered within 10 s after {} runs",
                    served.len()
                ),
            }
        }
        if refused >= 8 {
            break 'calls;
        }
    }
    assert!(refused >= 8, "never refused: {} runs served", served.len());
    println!(
        "{} runs served, then runs refused, with nobody reading the audit",
        served.len()
    );
    let reading = std::thread::spawn(move || {
        use std::io::Read;
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        text
    });
    // Being read, the gateway serves again.
    let mut client = client.clone();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match run(&mut client, "bot", "after").await {
            Ok(r) => {
                served.push(r.run_id);
                break;
            }
            Err(s) => assert!(Instant::now() < deadline, "never served again: {s:?}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    sigterm(&gw.child);
    let mut gw = gw;
    assert!(gw.child.wait().unwrap().success());
    drop(gw);
    let audit = reading.join().unwrap();
    let ids: std::collections::HashSet<String> = audit
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["run_id"].as_str().map(str::to_string))
        .collect();
    let missing: Vec<&String> = served.iter().filter(|id| !ids.contains(*id)).collect();
    assert!(
        missing.is_empty(),
        "{} served runs missing from the audit: {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
}
