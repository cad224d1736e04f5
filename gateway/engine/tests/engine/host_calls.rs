//! host_call limits are the gateway's, not the sandbox's: whatever a supervisor sends, at most
//! `host_calls_per_run` calls of a chain reach the capabilities in one run (every flush of a stream
//! and its final pass together), within a time and a byte budget; a host_call may only speak for
//! the hook the walk is at; and a flood leaves a bounded audit line. A scripted supervisor sends
//! what an honest one never would (a budget it did not keep, another hook's calls).

use crate::common;

use common::scripted::{Chunk, Script, ScriptedBackend};
use common::{Harness, baseline, hook, py, tenant};
use serde_json::{Value, json};
use sluice_crds::Action;
use sluice_engine::Limits;
use std::sync::{Arc, Mutex};
use std::time::Duration;

fn host_call(c: &Chunk, id: u64, hook: usize, name: &str, payload: Value) -> Value {
    json!({"type": "host_call", "id": id, "run": c.id, "hook": hook, "name": name, "payload": payload})
}

fn passed(c: &Chunk, index: usize) -> Value {
    json!({"type": "hook_result", "id": c.id, "index": index, "name": c.hooks[index]["name"], "action": "pass"})
}

fn done(c: &Chunk) -> Value {
    json!({"type": "result", "id": c.id, "action": "pass", "terminal_index": null})
}

/// A supervisor whose first hook makes `calls` host_calls of `name` with `payload`, then passes.
fn flood(calls: u64, name: &'static str, payload: Value) -> Script {
    Arc::new(move |c: &Chunk| {
        let mut lines: Vec<Value> = (1..=calls)
            .map(|id| host_call(c, id, 0, name, payload.clone()))
            .collect();
        lines.extend((0..c.hooks.len()).map(|i| passed(c, i)));
        lines.push(done(c));
        lines
    })
}

struct Scripted {
    h: Harness,
    host_results: Arc<Mutex<Vec<Value>>>,
}

async fn scripted(script: Script, hooks: Vec<Value>, policy: &str, limits: Limits) -> Scripted {
    let backend = ScriptedBackend::new(script);
    let host_results = backend.host_results();
    let chain = tenant("input", hooks, json!({"failurePolicy": policy}));
    let h = Harness::with_backend(Arc::new(backend), vec![chain], limits).await;
    Scripted { h, host_results }
}

fn caller_of(name: &str) -> Value {
    json!({"name": name, "action": "detect", "capabilities": ["echo", "sleep"], "code": "x"})
}

fn refusals(results: &Mutex<Vec<Value>>) -> Vec<String> {
    results
        .lock()
        .unwrap()
        .iter()
        .filter(|r| r["ok"] == json!(false))
        .map(|r| r["error"].as_str().unwrap_or_default().to_string())
        .collect()
}

#[tokio::test]
async fn a_supervisor_that_does_not_keep_the_budget_cannot_exceed_the_limit() {
    // What a hook that reset its budget inside the sandbox looks like from the gateway: 40 calls.
    let s = scripted(
        flood(40, "echo", json!({})),
        vec![caller_of("ask")],
        "Closed",
        common::limits(),
    )
    .await;
    let r = s.h.run("input", json!("hi")).await.expect("a verdict");
    assert_eq!(r.walk.action, Action::Pass);
    assert_eq!(
        s.h.capabilities.seen.lock().unwrap().len(),
        16,
        "only the first 16 reach the capabilities"
    );
    let answers = s.host_results.lock().unwrap().len();
    assert_eq!(answers, 40, "every host_call is answered");
    let refused = refusals(&s.host_results);
    assert_eq!(refused.len(), 24);
    assert!(
        refused.iter().all(|e| e.contains("at most 16 host_calls")),
        "{refused:?}"
    );
    let event = &s.h.audit.events()[0];
    assert_eq!(event["host_call_summary"]["total"], 40, "{event}");
    let over: u64 = event["host_call_summary"]["by"]
        .as_array()
        .expect("counts")
        .iter()
        .filter(|c| c["result"] == "over_limit")
        .map(|c| c["count"].as_u64().unwrap_or_default())
        .sum();
    assert_eq!(over, 24, "{event}");
}

#[tokio::test]
async fn a_streams_flushes_and_final_pass_share_one_budget() {
    // Each call of the hook makes 6 host_calls: 3 flushes and the final pass ask for 24 in all.
    let h = Harness::process(vec![tenant(
        "output",
        vec![json!({"name": "ask", "action": "detect", "capabilities": ["echo"], "code":
            "def execute(context, settings):\n    ok = 0\n    for i in range(6):\n        try:\n            context.host_call('echo', {'i': i})\n            ok += 1\n        except HostCallError:\n            pass\n    return {'action': 'detect', 'findings': {'ok': ok}}\n"})],
        json!({"streaming": {"flushChars": 4, "lookbackChars": 0}}),
    )])
    .await;
    let s = h.stream(&["aaaa", "bbbb", "cccc"]).await;
    assert!(s.error.is_none(), "{:?}", s.error);
    assert!(s.final_.is_some());
    assert_eq!(
        h.capabilities.seen.lock().unwrap().len(),
        16,
        "one budget for the whole stream"
    );
    let event = &h.audit.events()[0];
    let listed = event["host_calls"].as_array().expect("listed");
    assert_eq!(listed.len(), 24, "{event}");
    let over = listed
        .iter()
        .filter(|c| {
            c["error"]
                .as_str()
                .is_some_and(|e| e.contains("at most 16"))
        })
        .count();
    assert_eq!(over, 8, "{event}");
}

#[tokio::test]
async fn a_host_call_for_another_hook_blocks_the_run_under_both_policies() {
    for policy in ["Closed", "Open"] {
        // Hook 0 is running, and a host_call says it comes from hook 1.
        let script: Script = Arc::new(|c: &Chunk| {
            vec![
                host_call(c, 1, 1, "echo", json!({})),
                passed(c, 0),
                passed(c, 1),
                done(c),
            ]
        });
        let s = scripted(
            script,
            vec![caller_of("a"), caller_of("b")],
            policy,
            common::limits(),
        )
        .await;
        let r = s.h.run("input", json!("hi")).await.expect("a verdict");
        assert_eq!(r.walk.action, Action::Block, "{policy}: {:?}", r.walk);
        assert!(
            r.walk.message.contains("invalid result") && r.walk.message.contains("hook #1"),
            "{policy}: {}",
            r.walk.message
        );
        assert!(
            s.h.capabilities.seen.lock().unwrap().is_empty(),
            "{policy}: the forged call never reached a capability"
        );
    }
}

#[tokio::test]
async fn a_host_call_for_a_hook_that_already_returned_blocks_the_run() {
    let script: Script = Arc::new(|c: &Chunk| {
        vec![
            passed(c, 0),
            host_call(c, 1, 0, "echo", json!({})),
            passed(c, 1),
            done(c),
        ]
    });
    let s = scripted(
        script,
        vec![caller_of("a"), caller_of("b")],
        "Open",
        common::limits(),
    )
    .await;
    let r = s.h.run("input", json!("hi")).await.expect("a verdict");
    assert_eq!(r.walk.action, Action::Block, "{:?}", r.walk);
    assert!(s.h.capabilities.seen.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_flood_of_host_calls_leaves_a_bounded_audit_line() {
    let s = scripted(
        flood(2000, "echo", json!({"x": "y"})),
        vec![caller_of("ask")],
        "Closed",
        common::limits(),
    )
    .await;
    s.h.run("input", json!("hi")).await.expect("a verdict");
    let raw = s.h.audit.raw();
    assert_eq!(raw.lines().count(), 1);
    assert!(
        raw.len() < 16 * 1024,
        "the audit line is {} bytes",
        raw.len()
    );
    let event = &s.h.audit.events()[0];
    let listed = event["host_calls"].as_array().expect("listed").len();
    assert_eq!(listed, Limits::default().audit_host_calls, "{event}");
    let summary = &event["host_call_summary"];
    assert_eq!(summary["total"], 2000);
    assert_eq!(summary["listed"], listed);
    let by: Vec<(String, String, u64)> = summary["by"]
        .as_array()
        .expect("counts")
        .iter()
        .map(|c| {
            (
                c["capability"].as_str().unwrap_or_default().into(),
                c["result"].as_str().unwrap_or_default().into(),
                c["count"].as_u64().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        by,
        [
            ("echo".to_string(), "ok".to_string(), 16),
            ("echo".to_string(), "over_limit".to_string(), 1984)
        ]
    );
}

#[tokio::test]
async fn many_distinct_capability_names_do_not_grow_the_summary() {
    let script: Script = Arc::new(|c: &Chunk| {
        let mut lines: Vec<Value> = (1..=500)
            .map(|id| {
                host_call(
                    c,
                    id,
                    0,
                    &format!("cap-{id}-{}", "x".repeat(200)),
                    json!({}),
                )
            })
            .collect();
        lines.push(passed(c, 0));
        lines.push(done(c));
        lines
    });
    let s = scripted(script, vec![caller_of("ask")], "Closed", common::limits()).await;
    s.h.run("input", json!("hi")).await.expect("a verdict");
    let raw = s.h.audit.raw();
    assert!(
        raw.len() < 32 * 1024,
        "the audit line is {} bytes",
        raw.len()
    );
    assert_eq!(s.h.audit.events()[0]["host_call_summary"]["total"], 500);
}

#[tokio::test]
async fn host_calls_past_the_byte_budget_are_refused() {
    let limits = Limits {
        host_call_bytes_per_run: 1000,
        ..common::limits()
    };
    let payload = json!({"blob": "b".repeat(400)});
    let s = scripted(
        flood(10, "echo", payload),
        vec![caller_of("ask")],
        "Closed",
        limits,
    )
    .await;
    s.h.run("input", json!("hi")).await.expect("a verdict");
    // Each call moves ~400 bytes out and ~400 back: the second one's answer no longer fits.
    assert!(
        s.h.capabilities.seen.lock().unwrap().len() <= 2,
        "{}",
        s.h.capabilities.seen.lock().unwrap().len()
    );
    let refused = refusals(&s.host_results);
    assert!(refused.len() >= 8, "{refused:?}");
    assert!(
        refused.iter().all(|e| e.contains("1000 bytes")),
        "{refused:?}"
    );
}

#[tokio::test]
async fn host_calls_past_the_time_budget_are_refused() {
    let limits = Limits {
        host_call_time_per_run: Duration::from_millis(200),
        ..common::limits()
    };
    let s = scripted(
        flood(6, "sleep", json!({"ms": 100})),
        vec![caller_of("ask")],
        "Closed",
        limits,
    )
    .await;
    s.h.run("input", json!("hi")).await.expect("a verdict");
    // Two calls of at least 100 ms each spend the budget: nothing after them reaches a capability.
    assert!(s.h.capabilities.seen.lock().unwrap().len() <= 2);
    let refused = refusals(&s.host_results);
    assert!(refused.len() >= 4, "{refused:?}");
    assert!(refused.iter().all(|e| e.contains("200 ms")), "{refused:?}");
}

#[tokio::test]
async fn the_real_supervisor_still_gets_its_answers_within_the_limit() {
    let h = Harness::process(vec![tenant(
        "input",
        vec![json!({"name": "ask", "action": "detect", "capabilities": ["echo"], "code":
            "def execute(context, settings):\n    errors = []\n    for i in range(20):\n        try:\n            context.host_call('echo', {'i': i})\n        except HostCallError as e:\n            errors.append(str(e))\n    return {'action': 'detect', 'findings': {'errors': len(errors)}}\n"}),
            py("after", "detect", "return {'action': 'pass'}"),
            hook("unused", "detect", "def execute(context, settings):\n    return {'action': 'pass'}\n")],
        json!({}),
    )])
    .await;
    let r = h.run("input", json!("hi")).await.unwrap();
    assert_eq!(r.walk.action, Action::Detect, "{:?}", r.walk);
    assert_eq!(r.walk.hooks[0].findings, Some(json!({"errors": 4})));
    assert_eq!(h.capabilities.seen.lock().unwrap().len(), 16);
}

/// The limit holds per run for everything a stream does: flushes, the final pass, walks resumed in a
/// fresh sandbox after a failure under `Open`, beside a baseline that rechecks each change.
#[tokio::test]
async fn a_stream_with_failures_and_a_baseline_stays_within_one_budget() {
    let h = Harness::process(vec![
        baseline(
            "output",
            vec![py(
                "tidy",
                "modify",
                "return {'action': 'modify', 'outgoing': context['outgoing'].replace('!', '.')}",
            )],
        ),
        tenant(
            "output",
            vec![
                json!({"name": "ask", "action": "modify", "capabilities": ["echo"], "code":
                    "def execute(context, settings):\n    for i in range(6):\n        try:\n            context.host_call('echo', {'i': i})\n        except HostCallError:\n            pass\n    if len(context['outgoing']) % 2:\n        raise RuntimeError('odd')\n    return {'action': 'modify', 'outgoing': context['outgoing'] + '!'}\n"}),
                json!({"name": "again", "action": "detect", "capabilities": ["echo"], "code":
                    "def execute(context, settings):\n    for i in range(6):\n        try:\n            context.host_call('echo', {'j': i})\n        except HostCallError:\n            pass\n    return {'action': 'pass'}\n"}),
            ],
            json!({"failurePolicy": "Open", "streaming": {"flushChars": 4, "lookbackChars": 0}}),
        ),
    ])
    .await;
    let s = h.stream(&["aaaa", "bbbbb", "cccc", "ddddd"]).await;
    assert!(s.error.is_none(), "{:?}", s.error);
    let tenant_calls = h
        .capabilities
        .seen
        .lock()
        .unwrap()
        .iter()
        .filter(|c| c.chain == "team/tenant")
        .count();
    assert_eq!(tenant_calls, 16, "one budget for the whole stream");
}

/// A long stream: a hook that calls a capability on each of 200 flushes and again on the final pass
/// gets the run's 16 host_calls in all, not 16 for the stream path and 16 more for the final pass.
#[tokio::test]
async fn a_long_streams_flushes_and_final_pass_make_one_runs_host_calls() {
    let h = Harness::process(vec![tenant(
        "output",
        vec![json!({"name": "ask", "action": "detect", "capabilities": ["echo"], "code":
            "def execute(context, settings):\n    try:\n        context.host_call('echo', {'n': len(context['outgoing'])})\n        ok = 1\n    except HostCallError:\n        ok = 0\n    return {'action': 'detect', 'findings': {'ok': ok}}\n"})],
        json!({"streaming": {"flushChars": 4, "lookbackChars": 0}}),
    )])
    .await;
    let chunks = vec!["abcd"; 200];
    let s = h.stream(&chunks).await;
    assert!(s.error.is_none(), "{:?}", s.error);
    let final_ = s.final_.expect("a final");
    assert_eq!(
        h.capabilities.seen.lock().unwrap().len(),
        16,
        "one budget for the stream path and the final pass together"
    );
    assert_eq!(
        final_.walk.hooks[0].findings,
        Some(json!({"ok": 0})),
        "the final pass finds the budget spent by the flushes"
    );
    let event = &h.audit.events()[0];
    assert_eq!(event["host_call_summary"]["total"], json!(201), "{event}");
}
