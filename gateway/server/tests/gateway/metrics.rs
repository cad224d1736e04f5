//! `/metrics` of the `sluice-gateway` binary (local mode, real runsc sandboxes), scraped as
//! Prometheus would after runs on two chains: each chain has its own series (runs by action, latency,
//! claims and claim waits, sandboxes by state, boots, cells, hook errors by hook), requests for
//! made-up targets are counted together under `_unknown`, and build and process metrics are there.
//! The start-up log says how many chains and warm sandboxes it waits for.

use sluice_proto::{self as proto, gateway_client::GatewayClient};
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const CHAINS: &str = r#"apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: support-in}
spec:
  target: support-bot
  triggerPoint: input
  pool: {warm: 1, max: 2}
  hooks:
    - name: tag
      action: modify
      code: |
        def execute(context, settings):
            return {"action": "modify", "outgoing": "[tagged] " + context["outgoing"]}
---
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: research-out}
spec:
  target: research-bot
  triggerPoint: output
  failurePolicy: Open
  pool: {warm: 1, max: 2}
  hooks:
    - name: flaky
      action: detect
      code: |
        def execute(context, settings):
            raise RuntimeError("always")
    - name: stop
      action: block
      code: |
        def execute(context, settings):
            return {"action": "block", "message": "no"}
"#;

struct Gateway(Child);

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `GET /metrics` over a plain socket, as a scraper does.
fn scrape(port: u16) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    out
}

async fn run(
    client: &mut GatewayClient<tonic::transport::Channel>,
    target: &str,
    trigger_point: &str,
) -> Result<proto::RunResponse, tonic::Status> {
    client
        .run(proto::RunRequest {
            namespace: "default".into(),
            target: target.into(),
            trigger_point: trigger_point.into(),
            payload: Some(proto::run_request::Payload::Text("hi".into())),
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_have_a_series_per_chain_after_runs_on_two_chains() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("chains.yaml"), CHAINS).unwrap();
    let state = tempfile::Builder::new()
        .prefix("sluice-metrics")
        .tempdir_in("/tmp")
        .unwrap();
    let (port, metrics_port) = (free_port(), free_port());
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice-gateway"))
        .arg("--local")
        .arg(dir.path())
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--metrics")
        .arg(format!("127.0.0.1:{metrics_port}"))
        .arg("--state-dir")
        .arg(state.path())
        .arg("--audit")
        .arg(state.path().join("audit.jsonl"))
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("gateway binary starts");
    let stderr = child.stderr.take().unwrap();
    let _gateway = Gateway(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    // Start-up says what it waits for, and when it is ready, with counts.
    let mut log = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !log.iter().any(|l: &String| l.contains("ready to serve")) {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => log.push(line),
            Err(_) => panic!("the gateway never said it was ready: {log:#?}"),
        }
    }
    let warming = log
        .iter()
        .find(|l| l.contains("warming up sandboxes"))
        .unwrap_or_else(|| panic!("{log:#?}"));
    assert!(
        warming.contains("chains=2") && warming.contains("warm_target=2"),
        "{warming}"
    );
    let ready = log.iter().find(|l| l.contains("ready to serve")).unwrap();
    assert!(ready.contains("warm=2"), "{ready}");

    let mut client = GatewayClient::connect(format!("http://127.0.0.1:{port}"))
        .await
        .unwrap();
    for _ in 0..2 {
        let r = run(&mut client, "support-bot", "input").await.unwrap();
        assert_eq!(r.action, proto::Action::Modify as i32);
    }
    let r = run(&mut client, "research-bot", "output").await.unwrap();
    assert_eq!(r.action, proto::Action::Block as i32);
    for target in ["made-up-1", "made-up-2", "made-up-3"] {
        let e = run(&mut client, target, "input").await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::NotFound);
    }

    let text = scrape(metrics_port);
    let support = r#"namespace="default",target="support-bot",trigger_point="input""#;
    let research = r#"namespace="default",target="research-bot",trigger_point="output""#;
    for want in [
        format!(r#"sluice_gateway_runs_total{{action="modify",mode="run",{support}}} 2"#),
        format!(r#"sluice_gateway_runs_total{{action="block",mode="run",{research}}} 1"#),
        format!(r#"sluice_gateway_requests_total{{code="ok",{support}}} 2"#),
        r#"sluice_gateway_requests_total{code="not_found",namespace="_unknown",target="_unknown",trigger_point="_unknown"} 3"#.to_string(),
        format!(r#"sluice_gateway_run_duration_seconds_count{{{support}}} 2"#),
        format!(r#"sluice_gateway_run_duration_seconds_count{{{research}}} 1"#),
        format!(r#"sluice_gateway_claim_wait_seconds_count{{{support}}} 2"#),
        format!(r#"sluice_gateway_claim_wait_seconds_count{{{research}}} 1"#),
        format!(
            r#"sluice_gateway_hook_errors_total{{chain="default/research-out",hook="flaky",{research}}} 1"#
        ),
        format!(r#"sluice_gateway_sandboxes_started_total{{{support}}}"#),
        format!(r#"sluice_gateway_sandboxes_started_total{{{research}}}"#),
        format!(r#"sluice_gateway_cells_prepared_total{{{support}}}"#),
        format!(r#"sluice_gateway_sandboxes{{{support},state="warm"}}"#),
        format!(r#"sluice_gateway_sandboxes{{{research},state="claimed"}} 0"#),
        "sluice_gateway_build_info{version=".to_string(),
        "sluice_gateway_process_resident_memory_bytes".to_string(),
        "sluice_gateway_process_cpu_seconds_total".to_string(),
    ] {
        // Series are written with their labels sorted: match on the name and the label set.
        assert!(has_series(&text, &want), "no series {want}\n{text}");
    }
    let claims = |chain: &str| -> u64 {
        ["warm", "cold"]
            .iter()
            .filter_map(|k| {
                value(
                    &text,
                    &format!(r#"sluice_gateway_claims_total{{{chain},result="{k}"}}"#),
                )
            })
            .sum()
    };
    assert_eq!(claims(support), 2, "{text}");
    assert_eq!(claims(research), 1, "{text}");
    assert!(
        !text.contains("made-up"),
        "made-up targets make no series:\n{text}"
    );
}

/// Whether a line of `text` starts with `want`'s series (labels in any order) and, when `want` ends
/// in a value, has that value.
fn has_series(text: &str, want: &str) -> bool {
    let (series, value) = match want.rsplit_once("} ") {
        Some((s, v)) => (format!("{s}}}"), Some(v)),
        None => (want.to_string(), None),
    };
    text.lines().any(|line| {
        let Some((name_labels, v)) = line.rsplit_once(' ') else {
            return false;
        };
        same_series(name_labels, &series) && value.is_none_or(|want| want == v)
    })
}

fn value(text: &str, series: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (s, v) = line.rsplit_once(' ')?;
        same_series(s, series).then(|| v.parse().ok())?
    })
}

/// `name{a="1",b="2"}` equals `name{b="2",a="1"}`; a `want` without `}` matches by prefix.
fn same_series(line: &str, want: &str) -> bool {
    if !want.ends_with('}') {
        return line.starts_with(want);
    }
    let split = |s: &str| -> Option<(String, Vec<String>)> {
        let (name, rest) = s.split_once('{')?;
        let mut labels: Vec<String> = rest
            .trim_end_matches('}')
            .split("\",")
            .map(|l| l.trim_end_matches('"').to_string())
            .collect();
        labels.sort();
        Some((name.to_string(), labels))
    };
    matches!((split(line), split(want)), (Some(a), Some(b)) if a == b)
}
