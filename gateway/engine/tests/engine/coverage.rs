//! The lines a hook ran, as sandboxes under `--trace-lines` report them: kept only by an engine
//! that asked (`record_coverage`), summed per hook, and never beyond the hook's own code.

use crate::common;

use common::scripted::{Chunk, ScriptedBackend};
use common::{Harness, NS, chain, hook};
use serde_json::{Value, json};
use std::sync::Arc;

/// Each call reports lines 1 and 3 run, 1 to 3 as code, and a line 40 its code does not have.
fn tracing_backend() -> ScriptedBackend {
    ScriptedBackend::new(Arc::new(|c: &Chunk| -> Vec<Value> {
        vec![
            json!({"type": "hook_result", "id": c.id, "index": 0, "name": "h", "action": "pass",
                   "lines": {"run": [1, 3, 40], "code": [1, 2, 3, 40]}}),
            json!({"type": "result", "id": c.id, "action": "pass", "terminal_index": null}),
        ]
    }))
}

fn bot() -> sluice_crds::definition::Definition {
    chain(
        NS,
        "bot",
        "bot",
        "input",
        vec![hook("h", "detect", "a = 1\nb = 2\nc = 3\n")],
        json!({}),
    )
}

#[tokio::test]
async fn lines_are_kept_only_when_asked_and_only_those_the_code_has() {
    let h = Harness::with_backend(Arc::new(tracing_backend()), vec![bot()], common::limits()).await;
    h.run_at("bot", "input", json!("hi")).await.unwrap();
    assert_eq!(h.engine.coverage(), None, "kept without being asked");

    h.engine.record_coverage();
    let before = h.engine.coverage().expect("asked for");
    assert_eq!(before.len(), 1);
    assert_eq!(
        before[0].calls, 0,
        "the run before it was asked is not counted"
    );
    h.run_at("bot", "input", json!("hi")).await.unwrap();
    h.run_at("bot", "input", json!("again")).await.unwrap();
    let after = h.engine.coverage().unwrap();
    assert_eq!(after.len(), 1);
    let hook = &after[0];
    assert_eq!((hook.chain.as_str(), hook.hook.as_str()), ("team/bot", "h"));
    assert_eq!(hook.calls, 2);
    assert_eq!(hook.code, [1, 2, 3].into(), "line 40 is not the hook's");
    assert_eq!(hook.run, [1, 3].into());
}
