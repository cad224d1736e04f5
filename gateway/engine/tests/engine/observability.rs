//! What a platform team reads off the engine: the audit says why a run was blocked (message,
//! failure reason, what the failure policy did), NOT_FOUND requests are counted in full but sampled
//! in the audit, and per-chain metrics stay bounded when callers make up targets.

use crate::common;

use common::{Harness, NS, py, tenant};
use serde_json::json;
use sluice_engine::RunInput;

fn scrape(h: &Harness) -> String {
    use prometheus::Encoder;
    let mut out = Vec::new();
    prometheus::TextEncoder::new()
        .encode(&h.engine.metrics().registry.gather(), &mut out)
        .unwrap();
    String::from_utf8(out).unwrap()
}

#[tokio::test]
async fn the_audit_says_why_a_run_was_blocked_and_what_the_policy_did() {
    let h = Harness::process(vec![
        tenant(
            "input",
            vec![py("crash", "modify", "raise RuntimeError('boom')")],
            json!({"failurePolicy": "Closed"}),
        ),
        common::chain(
            NS,
            "open",
            "open-bot",
            "input",
            vec![
                py("crash", "modify", "raise RuntimeError('bang')"),
                py(
                    "stop",
                    "block",
                    "return {'action': 'block', 'message': 'not today'}",
                ),
            ],
            json!({"failurePolicy": "Open"}),
        ),
    ])
    .await;
    let closed = h.run("input", json!("hi")).await.unwrap();
    assert_eq!(closed.walk.action.as_str(), "block");
    let open = h.run_at("open-bot", "input", json!("hi")).await.unwrap();
    assert_eq!(open.walk.action.as_str(), "block");

    let events = h.audit.events();
    let closed_event = events
        .iter()
        .find(|e| e["run_id"] == closed.run_id)
        .unwrap();
    assert_eq!(closed_event["policy_outcome"], "blocked", "{closed_event}");
    let reason = closed_event["failure_reason"].as_str().unwrap();
    assert!(
        reason.contains("crash") && reason.contains("boom"),
        "{closed_event}"
    );
    assert_eq!(closed_event["message"], closed_event["failure_reason"]);

    let open_event = events.iter().find(|e| e["run_id"] == open.run_id).unwrap();
    assert_eq!(open_event["message"], "not today", "{open_event}");
    assert_eq!(open_event["policy_outcome"], "passed_over", "{open_event}");
    assert!(
        open_event["failure_reason"]
            .as_str()
            .unwrap()
            .contains("bang"),
        "{open_event}"
    );

    let text = scrape(&h);
    for series in [
        r#"sluice_gateway_hook_errors_total{chain="team/tenant",hook="crash",namespace="team",target="bot",trigger_point="input"} 1"#,
        r#"sluice_gateway_hook_errors_total{chain="team/open",hook="crash",namespace="team",target="open-bot",trigger_point="input"} 1"#,
        r#"sluice_gateway_runs_total{action="block",mode="run",namespace="team",target="open-bot",trigger_point="input"} 1"#,
        r#"sluice_gateway_requests_total{code="ok",namespace="team",target="bot",trigger_point="input"} 1"#,
        // Per hook: what each did (a failure is `error`), and how long it took.
        r#"sluice_gateway_hook_actions_total{action="error",chain="team/open",hook="crash",namespace="team",target="open-bot",trigger_point="input"} 1"#,
        r#"sluice_gateway_hook_actions_total{action="block",chain="team/open",hook="stop",namespace="team",target="open-bot",trigger_point="input"} 1"#,
        r#"sluice_gateway_hook_duration_seconds_count{chain="team/open",hook="stop",namespace="team",target="open-bot",trigger_point="input"} 1"#,
    ] {
        assert!(text.contains(series), "missing {series}:\n{text}");
    }
}

#[tokio::test]
async fn not_found_requests_are_counted_together_and_sampled_in_the_audit() {
    let h = Harness::process(vec![tenant(
        "input",
        vec![py("noop", "detect", "return {'action': 'pass'}")],
        json!({}),
    )])
    .await;
    for i in 0..25 {
        let refused = h
            .engine
            .run(RunInput {
                namespace: format!("made-up-{i}"),
                target: format!("nobody-{i}"),
                trigger_point: "input".into(),
                payload: Some(json!("hi")),
                ..Default::default()
            })
            .await;
        assert!(refused.is_err());
    }
    h.run("input", json!("hi")).await.unwrap();

    let events = h.audit.events();
    let not_found: Vec<_> = events
        .iter()
        .filter(|e| {
            e["error"]
                .as_str()
                .is_some_and(|m| m.contains("no HookChain"))
        })
        .collect();
    assert_eq!(
        not_found.len(),
        1,
        "one sampled line for 25 refusals: {events:?}"
    );
    assert_eq!(not_found[0]["not_found_unwritten"], 0);
    assert_eq!(events.len(), 2, "the sample and the one real run");

    let text = scrape(&h);
    assert!(
        text.contains(r#"sluice_gateway_requests_total{code="not_found",namespace="_unknown",target="_unknown",trigger_point="_unknown"} 25"#),
        "{text}"
    );
    assert!(
        text.contains("sluice_gateway_audit_sampled_out_total 24"),
        "{text}"
    );
    assert!(
        !text.contains("made-up") && !text.contains("nobody-"),
        "made-up targets make no series of their own:\n{text}"
    );
    assert!(
        text.contains(r#"sluice_gateway_build_info{version=""#),
        "{text}"
    );
    assert!(
        text.contains("sluice_gateway_process_cpu_seconds_total"),
        "{text}"
    );
    // The pool is read at scrape time: the one warm sandbox of the chain.
    assert!(
        text.contains(r#"sluice_gateway_sandboxes{namespace="team",state="claimed",target="bot",trigger_point="input"} 0"#),
        "{text}"
    );
    assert!(
        text.contains(r#"sluice_gateway_claim_wait_seconds_count{namespace="team",target="bot",trigger_point="input"} 1"#),
        "{text}"
    );
}
