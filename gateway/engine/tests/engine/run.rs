//! `Engine::run` on the real supervisor (run as a plain child process): every action, the terminal
//! index, the failure policies, deadlines, host_calls, state, request checks and the audit.

use crate::common;

use common::{Harness, hook, py, tenant};
use serde_json::{Value, json};
use sluice_crds::Action;
use sluice_engine::EngineError;
use std::sync::Arc;

const PASS: &str = "return {'action': 'pass'}";
const UPPER: &str = "return {'action': 'modify', 'outgoing': context['outgoing'].upper()}";

#[tokio::test]
async fn a_pass_hook_leaves_the_payload_alone() {
    let h = Harness::process(vec![tenant(
        "input",
        vec![py("noop", "modify", PASS)],
        json!({}),
    )])
    .await;
    let r = h.run("input", json!("hello")).await.unwrap();
    assert_eq!(r.walk.action, Action::Pass);
    assert_eq!(r.walk.payload, json!("hello"));
    assert_eq!(r.walk.hooks.len(), 1);
    assert_eq!(r.walk.hooks[0].name, "noop");
    assert_eq!(r.walk.terminal_index, None);
}

#[tokio::test]
async fn a_modify_hook_rewrites_the_payload() {
    let h = Harness::process(vec![tenant(
        "input",
        vec![py("up", "modify", UPPER)],
        json!({}),
    )])
    .await;
    let r = h.run("input", json!("hello")).await.unwrap();
    assert_eq!(r.walk.action, Action::Modify);
    assert_eq!(r.walk.payload, json!("HELLO"));
}

#[tokio::test]
async fn a_block_ends_the_walk_at_its_index_with_its_message() {
    let h = Harness::process(vec![tenant(
        "input",
        vec![
            py("up", "modify", UPPER),
            py(
                "stop",
                "block",
                "return {'action': 'block', 'message': 'not today'}",
            ),
            py(
                "never",
                "modify",
                "return {'action': 'modify', 'outgoing': 'ran'}",
            ),
        ],
        json!({}),
    )])
    .await;
    let r = h.run("input", json!("hi")).await.unwrap();
    assert_eq!(r.walk.action, Action::Block);
    assert_eq!(r.walk.terminal_index, Some(1));
    assert_eq!(r.walk.message, "not today");
    let names: Vec<&str> = r.walk.hooks.iter().map(|h| h.name.as_str()).collect();
    assert_eq!(names, ["up", "stop"], "the hook after the block never runs");
}

#[tokio::test]
async fn a_skip_is_terminal_and_carries_its_answer() {
    let h = Harness::process(vec![tenant(
        "input",
        vec![
            py(
                "faq",
                "skip",
                "return {'action': 'skip', 'message': 'see the FAQ'}",
            ),
            py(
                "never",
                "modify",
                "return {'action': 'modify', 'outgoing': 'ran'}",
            ),
        ],
        json!({}),
    )])
    .await;
    let r = h.run("input", json!("where is my order?")).await.unwrap();
    assert_eq!(
        (
            r.walk.action,
            r.walk.terminal_index,
            r.walk.message.as_str()
        ),
        (Action::Skip, Some(0), "see the FAQ")
    );
    assert_eq!(r.walk.payload, json!("where is my order?"));
}

#[tokio::test]
async fn a_detect_reports_findings_and_changes_nothing() {
    let h = Harness::process(vec![tenant(
        "input",
        vec![py(
            "look",
            "detect",
            "return {'action': 'detect', 'findings': {'words': len(context['outgoing'].split())}}",
        )],
        json!({}),
    )])
    .await;
    let r = h.run("input", json!("one two three")).await.unwrap();
    assert_eq!(r.walk.action, Action::Detect);
    assert_eq!(r.walk.payload, json!("one two three"));
    assert_eq!(r.walk.hooks[0].findings, Some(json!({"words": 3})));
}

#[tokio::test]
async fn modify_outranks_detect_and_each_hook_sees_the_last_output() {
    let h = Harness::process(vec![tenant(
        "input",
        vec![
            py(
                "look",
                "detect",
                "return {'action': 'detect', 'findings': [context['outgoing']]}",
            ),
            py("up", "modify", UPPER),
            py(
                "seen",
                "detect",
                "return {'action': 'detect', 'findings': [context['outgoing']]}",
            ),
        ],
        json!({}),
    )])
    .await;
    let r = h.run("input", json!("abc")).await.unwrap();
    assert_eq!(r.walk.action, Action::Modify);
    assert_eq!(r.walk.hooks[0].findings, Some(json!(["abc"])));
    assert_eq!(r.walk.hooks[2].findings, Some(json!(["ABC"])));
}

#[tokio::test]
async fn an_exception_under_closed_blocks_at_the_failing_hook() {
    let h = Harness::process(vec![tenant(
        "input",
        vec![
            py("up", "modify", UPPER),
            py("boom", "modify", "raise RuntimeError('broken hook')"),
            py(
                "never",
                "modify",
                "return {'action': 'modify', 'outgoing': 'ran'}",
            ),
        ],
        json!({"failurePolicy": "Closed"}),
    )])
    .await;
    let r = h.run("input", json!("hi")).await.unwrap();
    assert_eq!(
        (r.walk.action, r.walk.terminal_index),
        (Action::Block, Some(1))
    );
    assert!(r.walk.message.contains("\"boom\""), "{}", r.walk.message);
    let error = r.walk.hooks[1].error.as_deref().unwrap_or_default();
    assert!(error.contains("RuntimeError: broken hook"), "{error}");
    assert_eq!(r.walk.hooks.len(), 2);
}

#[tokio::test]
async fn an_exception_under_open_passes_the_payload_on() {
    let h = Harness::process(vec![tenant(
        "input",
        vec![
            py("up", "modify", UPPER),
            py("boom", "modify", "raise RuntimeError('broken hook')"),
            py(
                "exclaim",
                "modify",
                "return {'action': 'modify', 'outgoing': context['outgoing'] + '!'}",
            ),
        ],
        json!({"failurePolicy": "Open"}),
    )])
    .await;
    let r = h.run("input", json!("hi")).await.unwrap();
    assert_eq!(
        (r.walk.action, r.walk.terminal_index),
        (Action::Modify, None)
    );
    assert_eq!(
        r.walk.payload,
        json!("HI!"),
        "the failed hook changed nothing"
    );
    assert!(r.walk.hooks[1].error.is_some());
    assert_eq!(r.walk.hooks.len(), 3);
}

#[tokio::test]
async fn an_undeclared_action_is_a_hook_error() {
    let h = Harness::process(vec![tenant(
        "input",
        vec![py(
            "sneaky",
            "detect",
            "return {'action': 'block', 'message': 'no'}",
        )],
        json!({"failurePolicy": "Closed"}),
    )])
    .await;
    let r = h.run("input", json!("hi")).await.unwrap();
    assert_eq!(r.walk.action, Action::Block);
    let error = r.walk.hooks[0].error.as_deref().unwrap_or_default();
    assert!(error.contains("block"), "{error}");
    assert_ne!(
        r.walk.message, "no",
        "the hook's own message is not what the user sees"
    );
}

#[tokio::test]
async fn a_hook_past_its_deadline_is_killed_and_closed_blocks() {
    let h = Harness::process(vec![tenant(
        "input",
        vec![
            py("up", "modify", UPPER),
            hook(
                "slow",
                "modify",
                "import time\ndef execute(context, settings):\n    time.sleep(30)\n",
            ),
        ],
        json!({"failurePolicy": "Closed", "timeoutMs": 300}),
    )])
    .await;
    let began = std::time::Instant::now();
    let r = h.run("input", json!("hi")).await.unwrap();
    assert!(began.elapsed() < std::time::Duration::from_secs(10));
    assert_eq!(
        (r.walk.action, r.walk.terminal_index),
        (Action::Block, Some(1))
    );
    let error = r.walk.hooks[1].error.as_deref().unwrap_or_default();
    assert!(
        error.starts_with("timed out after 300 ms: an endless loop or slow code (the chain's spec.timeoutMs is 300 ms"),
        "{error}"
    );
}

/// Waits until the pool holds a sandbox again (a used one is recycled or retired after the answer).
async fn settle(h: &Harness) {
    assert!(
        h.engine
            .pools()
            .wait_warm(std::time::Duration::from_secs(20))
            .await,
        "the pool never refilled"
    );
}

#[tokio::test]
async fn under_open_a_sleeping_hook_is_stopped_at_its_deadline_and_the_sandbox_serves_on() {
    // A hook waiting in `time.sleep` runs no code; its wait still ends at the deadline, so the
    // supervisor reports it as the hook's error and the gateway's backstop never fires.
    let h = Harness::process(vec![tenant(
        "input",
        vec![
            py("up", "modify", UPPER),
            hook(
                "slow",
                "modify",
                "import time\ndef execute(context, settings):\n    time.sleep(30)\n",
            ),
            py(
                "exclaim",
                "modify",
                "return {'action': 'modify', 'outgoing': context['outgoing'] + '!'}",
            ),
        ],
        json!({"failurePolicy": "Open", "timeoutMs": 300, "pool": {"warm": 1, "max": 1}}),
    )])
    .await;
    settle(&h).await;
    let r = h.run("input", json!("hi")).await.unwrap();
    assert_eq!(
        (r.walk.action, r.walk.terminal_index),
        (Action::Modify, None)
    );
    assert_eq!(
        r.walk.payload,
        json!("HI!"),
        "the hook after the stopped one ran"
    );
    let names: Vec<&str> = r.walk.hooks.iter().map(|h| h.name.as_str()).collect();
    assert_eq!(names, ["up", "slow", "exclaim"]);
    let error = r.walk.hooks[1].error.as_deref().unwrap_or_default();
    assert!(
        error.starts_with("timed out after 300 ms: an endless loop or slow code (the chain's spec.timeoutMs is 300 ms"),
        "{error}"
    );
    settle(&h).await;
    assert_eq!(
        h.engine.metrics().retirements("broken"),
        0,
        "the sleeping hook cost the sandbox"
    );
    assert_eq!(h.engine.metrics().boots(), 1);
}

#[tokio::test]
async fn under_open_two_hooks_out_of_time_cost_two_hook_errors_never_the_sandbox() {
    // A user text that makes two regex detectors backtrack: each runs out of the chain's deadline,
    // the one after the first with a fresh deadline on both sides, so the gateway's backstop
    // (each hook's deadline plus its grace) never fires and the sandbox serves on.
    let backtrack =
        "import re\nre.match(r'(a+)+$', context['outgoing'])\nreturn {'action': 'pass'}";
    let h = Harness::process(vec![tenant(
        "input",
        vec![
            py("regex-1", "detect", backtrack),
            py("regex-2", "detect", backtrack),
            py(
                "exclaim",
                "modify",
                "return {'action': 'modify', 'outgoing': context['outgoing'][-1] + '!'}",
            ),
        ],
        json!({"failurePolicy": "Open", "timeoutMs": 1000, "pool": {"warm": 1, "max": 1}}),
    )])
    .await;
    settle(&h).await;
    let text = format!("{}b", "a".repeat(64));
    let r = h.run("input", json!(text)).await.unwrap();
    assert_eq!(r.walk.payload, json!("b!"), "{:?}", r.walk);
    for hook in &r.walk.hooks[..2] {
        let error = hook.error.as_deref().unwrap_or_default();
        assert!(error.starts_with("timed out after 1000 ms"), "{error}");
    }
    settle(&h).await;
    assert_eq!(
        h.engine.metrics().retirements("broken"),
        0,
        "two timeouts cost the sandbox"
    );
    assert_eq!(h.engine.metrics().boots(), 1);
}

#[tokio::test]
async fn after_a_hook_that_ran_out_the_gateway_gives_the_next_the_whole_deadline_as_the_supervisor_does()
 {
    // The supervisor's clock for a walk starts when it reads the chunk, the gateway's when it
    // writes it; a gateway descheduled in between starts counting later. Here the first hook runs
    // out 950 ms into the gateway's 1000 ms deadline by its own count (the supervisor's ran out):
    // the gateway must start afresh when told (`ran_out`), not wait 50 ms plus its grace for a
    // second hook the supervisor gives the whole deadline, and end a healthy sandbox.
    let script: common::scripted::Script = Arc::new(|chunk: &common::scripted::Chunk| {
        let id = chunk.id;
        vec![
            json!({"type": "pause", "ms": 950}),
            json!({"type": "hook_result", "id": id, "index": 0, "name": "slow-1", "action": "pass",
                "error": "timed out after 1000 ms", "ran_out": true}),
            json!({"type": "pause", "ms": 800}),
            json!({"type": "hook_result", "id": id, "index": 1, "name": "slow-2", "action": "pass"}),
            json!({"type": "result", "id": id, "action": "pass", "terminal_index": null}),
        ]
    });
    let h = Harness::with_backend(
        Arc::new(common::scripted::ScriptedBackend::new(script)),
        vec![tenant(
            "input",
            vec![py("slow-1", "detect", PASS), py("slow-2", "detect", PASS)],
            json!({"failurePolicy": "Open", "timeoutMs": 1000, "pool": {"warm": 1, "max": 1}}),
        )],
        common::limits(),
    )
    .await;
    settle(&h).await;
    let r = h.run("input", json!("hi")).await.unwrap();
    assert_eq!(r.walk.hooks.len(), 2, "{:?}", r.walk);
    assert!(
        r.walk.hooks[1].error.is_none(),
        "the second hook answered within its fresh deadline: {:?}",
        r.walk.hooks[1]
    );
    settle(&h).await;
    assert_eq!(
        h.engine.metrics().retirements("broken"),
        0,
        "the gateway ended a sandbox whose supervisor kept to the deadline"
    );
    assert_eq!(h.engine.metrics().boots(), 1);
}

#[tokio::test]
async fn host_calls_reach_the_capabilities_with_the_trusted_caller() {
    let h = Harness::process(vec![tenant(
        "input",
        vec![json!({"name": "ask", "action": "modify", "capabilities": ["echo"], "code":
            "def execute(context, settings):\n    r = context.host_call('echo', {'q': context['outgoing']})\n    return {'action': 'modify', 'outgoing': r['echo']['q'] + '?'}\n"})],
        json!({}),
    )])
    .await;
    let r = h.run("input", json!("hi")).await.unwrap();
    assert_eq!(r.walk.payload, json!("hi?"));
    let seen = h.capabilities.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    assert_eq!((seen[0].hook, seen[0].name.as_str()), (0, "echo"));
    assert_eq!(seen[0].payload, json!({"q": "hi"}));
    let caller = &seen[0].caller.0;
    assert_eq!(caller["namespace"], "team");
    assert_eq!(caller["user_id"], "u-1");
    assert_eq!(caller["run_id"], r.run_id);
}

#[tokio::test]
async fn a_refused_host_call_raises_in_the_hook_with_the_reason() {
    let h = Harness::process(vec![tenant(
        "input",
        vec![json!({"name": "ask", "action": "modify", "capabilities": ["deny"], "code":
            "def execute(context, settings):\n    try:\n        context.host_call('deny', {})\n    except HostCallError as e:\n        return {'action': 'modify', 'outgoing': str(e)}\n    return {'action': 'pass'}\n"})],
        json!({}),
    )])
    .await;
    let r = h.run("input", json!("hi")).await.unwrap();
    assert_eq!(r.walk.payload, json!("denied by the test: deny"));
}

#[tokio::test]
async fn each_hook_gets_its_own_state_slot_and_a_run_starts_fresh() {
    let h = Harness::process(vec![tenant(
        "input",
        vec![
            py("a", "detect", "return {'action': 'detect', 'findings': {'saw': context['state']}, 'state': {'a': 1}}"),
            py("b", "detect", "return {'action': 'detect', 'findings': {'saw': context['state']}, 'state': {'b': 2}}"),
        ],
        json!({}),
    )])
    .await;
    for _ in 0..2 {
        let r = h.run("input", json!("hi")).await.unwrap();
        assert_eq!(r.walk.hooks[0].findings, Some(json!({"saw": null})));
        assert_eq!(
            r.walk.hooks[1].findings,
            Some(json!({"saw": null})),
            "hook b never sees hook a's slot"
        );
    }
}

#[tokio::test]
async fn payloads_of_the_wrong_type_or_size_are_refused() {
    let h = Harness::process(vec![
        tenant("input", vec![py("noop", "modify", PASS)], json!({})),
        common::chain(
            "team",
            "tools",
            "bot",
            "before_tool",
            vec![py("noop", "modify", PASS)],
            json!({}),
        ),
    ])
    .await;
    let refused = |r: Result<sluice_engine::RunResult, EngineError>| match r {
        Err(EngineError::InvalidArgument(m)) => m,
        other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
    };
    let m = refused(h.run("input", json!({"text": "hi"})).await);
    assert!(m.contains("carries text"), "{m}");
    let m = refused(h.run("before_tool", json!("a string")).await);
    assert!(m.contains("structured payload"), "{m}");
    let big = "x".repeat(h.engine.limits().payload_bytes + 1);
    let m = refused(h.run("input", Value::String(big)).await);
    assert!(m.contains("over the limit"), "{m}");
    let m = refused(h.run("sideways", json!("hi")).await);
    assert!(m.contains("is not one of"), "{m}");
}

#[tokio::test]
async fn an_unknown_chain_is_not_found() {
    let h = Harness::process(vec![tenant(
        "input",
        vec![py("noop", "modify", PASS)],
        json!({}),
    )])
    .await;
    match h.run("output", json!("hi")).await {
        Err(EngineError::NotFound(m)) => assert!(m.contains("\"bot\""), "{m}"),
        other => panic!("expected NOT_FOUND, got {other:?}"),
    }
}

#[tokio::test]
async fn every_run_writes_exactly_one_audit_event_refusals_included() {
    let h = Harness::process(vec![tenant(
        "input",
        vec![py("up", "modify", UPPER)],
        json!({}),
    )])
    .await;
    let r = h.run("input", json!("hi")).await.unwrap();
    let _ = h.run("output", json!("hi")).await.unwrap_err();
    let events = h.audit.events();
    assert_eq!(events.len(), 2, "{events:?}");
    assert_eq!(events[0]["run_id"], json!(r.run_id));
    assert_eq!(events[0]["action"], "modify");
    assert_eq!(events[0]["chain"], "team/tenant");
    assert_eq!(events[0]["hooks"][0]["name"], "up");
    assert_eq!(events[1]["action"], "none");
    assert!(
        events[1]["error"]
            .as_str()
            .unwrap_or_default()
            .contains("no HookChain")
    );
}

#[tokio::test]
async fn what_a_hook_prints_is_carried_only_when_asked_and_only_its_end() {
    let printing = vec![
        py(
            "chatty",
            "modify",
            "print('x' * 50, 'seen', context['outgoing'])\nreturn {'action': 'pass'}",
        ),
        py("quiet", "modify", PASS),
    ];
    // By default an answer carries none of it: it is the author's debugging.
    let h = Harness::process(vec![tenant("input", printing.clone(), json!({}))]).await;
    let r = h.run("input", json!("hello")).await.unwrap();
    assert!(r.walk.hooks.iter().all(|o| o.output.is_none()), "{r:?}");

    let limits = sluice_engine::Limits {
        hook_output_bytes: 11,
        ..common::limits()
    };
    let backend = common::process_backend();
    let h = Harness::with_backend(
        std::sync::Arc::new(backend),
        vec![tenant("input", printing, json!({}))],
        limits,
    )
    .await;
    let r = h.run("input", json!("hello")).await.unwrap();
    assert_eq!(
        r.walk.hooks[0].output.as_deref(),
        Some("seen hello\n"),
        "{r:?}"
    );
    assert_eq!(r.walk.hooks[1].output, None);
}
