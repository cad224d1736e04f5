//! Caller-supplied strings (namespace, target, trigger point, session, context) never start a line
//! of their own in the gateway's text log: a newline in them is escaped, so nobody can forge a log
//! line by naming a target.

use crate::common;

use common::{Harness, py, tenant};
use serde_json::json;
use sluice_engine::{RunInput, StreamInput, StreamOpen};
use std::io::Write;
use std::sync::{Arc, Mutex};

/// A tracing writer that keeps everything written, as a text log would show it.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

const FORGED: &str = "x\n2030-01-01T00:00:00.000000Z ERROR FORGED line\r\u{1b}[2K";

#[tokio::test]
async fn a_newline_in_caller_strings_does_not_start_a_log_line() {
    let log = Captured::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::DEBUG)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let h = Harness::process(vec![tenant(
        "input",
        vec![py("noop", "detect", "return {'action': 'pass'}")],
        json!({}),
    )])
    .await;
    // Refused (no such chain), with every caller string carrying a forged line.
    let refused = h
        .engine
        .run(RunInput {
            namespace: format!("team{FORGED}"),
            target: format!("bot{FORGED}"),
            trigger_point: "input".into(),
            payload: Some(json!("hi")),
            context: [(format!("k{FORGED}"), format!("v{FORGED}"))].into(),
            session_id: format!("s{FORGED}"),
            ..Default::default()
        })
        .await;
    assert!(refused.is_err());
    // A bad trigger point is refused with the caller's string in the message.
    let bad = h
        .engine
        .run(RunInput {
            namespace: "team".into(),
            target: "bot".into(),
            trigger_point: format!("input{FORGED}"),
            payload: Some(json!("hi")),
            ..Default::default()
        })
        .await;
    assert!(bad.is_err());
    // A stream refused at open.
    let s = common::collect(h.engine.stream(common::Paced::new(vec![
        StreamInput::Open(StreamOpen {
            namespace: "team".into(),
            target: format!("bot{FORGED}"),
            trigger_point: "output".into(),
            context: Default::default(),
            session_id: format!("s{FORGED}"),
            ..Default::default()
        }),
        StreamInput::Finish,
    ])))
    .await;
    assert!(s.error.is_some());

    let text = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
    assert!(
        text.contains("run refused"),
        "the refusals were logged: {text}"
    );
    assert!(
        text.contains("bot") && text.contains("FORGED"),
        "the caller's strings are still in the log, escaped: {text}"
    );
    for line in text.lines() {
        assert!(
            !line.starts_with("2030-01-01") && !line.contains('\r') && !line.contains('\u{1b}'),
            "a caller string started or rewrote a log line: {line:?}\n--- the whole log:\n{text}"
        );
    }
}

/// Strings a tenant writes into its objects (namespace and name in a chain directory, target,
/// capability names, endpoints) reach the log on every reload and every run: none of them may start
/// a line either.
#[tokio::test]
async fn a_newline_in_tenant_written_fields_does_not_start_a_log_line() {
    let log = Captured::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::DEBUG)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let namespace = format!("team{FORGED}");
    let target = format!("bot{FORGED}");
    let mut hooks = vec![py("noop", "detect", "return {'action': 'pass'}")];
    hooks[0]["capabilities"] = json!([format!("cap{FORGED}")]);
    let forged = common::chain(
        &namespace,
        &format!("chain{FORGED}"),
        &target,
        "input",
        hooks,
        json!({}),
    );
    // A second chain for the same place is reported as a conflict, naming both.
    let conflicting = common::chain(
        &namespace,
        &format!("other{FORGED}"),
        &target,
        "input",
        vec![py("noop", "detect", "return {'action': 'pass'}")],
        json!({}),
    );
    let h = Harness::process(vec![forged.clone()]).await;
    sluice_engine::Registry::build_for(
        common::PLATFORM,
        vec![forged, conflicting],
        vec![],
        &sluice_crds::signing::Policy::default(),
    )
    .log_summary();
    h.engine.registry().log_summary();
    // A run of that chain: its claim and pool lines name the chain.
    let ran = h
        .engine
        .run(RunInput {
            namespace: namespace.clone(),
            target: target.clone(),
            trigger_point: "input".into(),
            payload: Some(json!("hi")),
            ..Default::default()
        })
        .await;
    assert!(ran.is_ok(), "{ran:?}");

    let text = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
    assert!(
        text.contains("registry loaded") && text.contains("FORGED"),
        "the summary names the tenant's chain, escaped: {text}"
    );
    for line in text.lines() {
        assert!(
            !line.starts_with("2030-01-01") && !line.contains('\r') && !line.contains('\u{1b}'),
            "a tenant-written string started or rewrote a log line: {line:?}\n--- the whole log:\n{text}"
        );
    }
}
