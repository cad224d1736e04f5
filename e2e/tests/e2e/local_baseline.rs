//! Baselines stay tighten-only after the tenant's chain: the figures a baseline judges (turn, spend)
//! cannot be forged by a tenant hook, and what the tenant raises is judged again.

use serde_json::json;
use sluice_e2e::{Harness, action, from_proto};
use sluice_proto::{Action, run_response::Payload};

const TURN_BASELINE: &str = r#"apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: platform-limits, namespace: sluice-system}
spec:
  enforced: true
  target: "*"
  triggerPoint: before_model
  pool: {warm: 1, max: 8}
  hooks:
    - name: limits
      action: block
      code: |
        def execute(context, settings):
            p = context["outgoing"]
            spent = p["usage_so_far"].get("output_tokens", 0)
            if p["turn"] > 5:
                return {"action": "block", "message": "turn limit"}
            if spent + p["max_tokens"] > 1000:
                return {"action": "block", "message": "token budget"}
            return {"action": "pass"}
"#;

const FORGER: &str = r#"apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: forger, namespace: default}
spec:
  target: forger-bot
  triggerPoint: before_model
  pool: {warm: 1, max: 8}
  hooks:
    - name: forge
      action: modify
      code: |
        def execute(context, settings):
            p = dict(context["outgoing"])
            p["turn"] = 1
            p["usage_so_far"] = {}
            p["max_tokens"] = p["max_tokens"] * 10
            return {"action": "modify", "outgoing": p}
"#;

fn payload(turn: u32, spent: u32, max_tokens: u32) -> serde_json::Value {
    json!({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [],
        "max_tokens": max_tokens, "usage_so_far": {"output_tokens": spent}, "turn": turn,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_cannot_forge_the_figures_a_baseline_judges() {
    let h = Harness::start(&[("baseline.yaml", TURN_BASELINE), ("tenant.yaml", FORGER)]).await;
    // Within the limits before the tenant; the tenant's tenfold max_tokens crosses the budget, and
    // its reset counters do not hide that: the recheck judges the true spend and blocks.
    let r = h
        .run_value("forger-bot", "before_model", payload(3, 850, 100))
        .await
        .unwrap();
    assert_eq!(action(&r), Action::Block, "{r:?}");
    assert_eq!(r.message, "token budget");
    assert_eq!(
        r.hooks.last().map(|o| o.name.as_str()),
        Some("baseline-recheck/limits")
    );
    // Room for the raised max_tokens: the call goes ahead, with the true turn and spend.
    let r = h
        .run_value("forger-bot", "before_model", payload(3, 0, 50))
        .await
        .unwrap();
    assert_eq!(action(&r), Action::Modify, "{r:?}");
    let Some(Payload::Value(v)) = &r.payload else {
        panic!("value payload expected: {r:?}")
    };
    let out = from_proto(v);
    assert_eq!(
        (&out["turn"], &out["usage_so_far"], &out["max_tokens"]),
        (&json!(3), &json!({"output_tokens": 0}), &json!(500))
    );
    h.stop_and_check_leaks().await;
}
