//! A sandbox that reports what no honest supervisor would is not trusted, under either failure
//! policy: the run ends as `block`. Driven by a scripted supervisor speaking PROTOCOL.md.

use crate::common;

use common::scripted::{Chunk, Script, ScriptedBackend, honest};
use common::{Harness, hook, tenant};
use serde_json::{Value, json};
use sluice_crds::Action;
use std::sync::Arc;

async fn harness(policy: &str, script: Script) -> Harness {
    let chain = tenant(
        "input",
        vec![hook("a", "modify", "x"), hook("b", "detect", "x")],
        json!({"failurePolicy": policy}),
    );
    Harness::with_backend(
        Arc::new(ScriptedBackend::new(script)),
        vec![chain],
        common::limits(),
    )
    .await
}

fn result(c: &Chunk, index: usize, action: &str) -> Value {
    json!({"type": "hook_result", "id": c.id, "index": index, "name": c.hooks[index]["name"], "action": action})
}

async fn refused(policy: &str, script: Script) -> sluice_engine::Walk {
    let h = harness(policy, script).await;
    let r = h.run("input", json!("hi")).await.expect("a verdict");
    assert_eq!(r.walk.action, Action::Block, "{policy}: {:?}", r.walk);
    assert!(
        r.walk.message.contains("invalid result"),
        "{policy}: {}",
        r.walk.message
    );
    r.walk
}

#[tokio::test]
async fn an_honest_script_passes() {
    let h = harness(
        "Open",
        Arc::new(|c: &Chunk| honest(c, |t| t.to_uppercase())),
    )
    .await;
    let r = h.run("input", json!("hi")).await.unwrap();
    assert_eq!(
        (r.walk.action, r.walk.payload),
        (Action::Modify, json!("HI"))
    );
}

#[tokio::test]
async fn a_summary_that_disagrees_with_the_results_blocks_under_both_policies() {
    for policy in ["Closed", "Open"] {
        let script: Script = Arc::new(|c: &Chunk| {
            vec![
                result(c, 0, "pass"),
                result(c, 1, "pass"),
                json!({"type": "result", "id": c.id, "action": "modify", "terminal_index": null}),
            ]
        });
        refused(policy, script).await;
    }
}

#[tokio::test]
async fn an_undeclared_action_the_supervisor_let_through_blocks_under_both_policies() {
    for policy in ["Closed", "Open"] {
        let script: Script = Arc::new(|c: &Chunk| {
            let mut r = result(c, 0, "block");
            r["message"] = json!("let me through");
            vec![
                r,
                json!({"type": "result", "id": c.id, "action": "block", "terminal_index": 0}),
            ]
        });
        let walk = refused(policy, script).await;
        assert_eq!(walk.terminal_index, Some(0));
    }
}

#[tokio::test]
async fn results_out_of_order_or_for_another_hook_block_under_open() {
    let script: Script = Arc::new(|c: &Chunk| {
        vec![
            result(c, 1, "pass"),
            json!({"type": "result", "id": c.id, "action": "pass", "terminal_index": null}),
        ]
    });
    refused("Open", script).await;
}

#[tokio::test]
async fn a_modify_of_the_wrong_type_blocks_under_open() {
    let script: Script = Arc::new(|c: &Chunk| {
        let mut r = result(c, 0, "modify");
        r["outgoing"] = json!({"not": "text"});
        vec![
            r,
            result(c, 1, "pass"),
            json!({"type": "result", "id": c.id, "action": "modify", "terminal_index": null}),
        ]
    });
    let walk = refused("Open", script).await;
    assert_eq!(
        walk.payload,
        json!("hi"),
        "nothing of the refused result is kept"
    );
}
