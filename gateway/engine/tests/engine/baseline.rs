//! Platform baselines on the real supervisor: the baseline runs first, ends the walk for the tenant
//! when it blocks, and a tenant cannot undo what it did.

use crate::common;

use common::{Harness, baseline, baseline_with, py, tenant};
use serde_json::json;
use sluice_crds::Action;

const REDACT_SECRET: &str =
    "return {'action': 'modify', 'outgoing': context['outgoing'].replace('secret', '[x]')}";

#[tokio::test]
async fn the_baseline_runs_first_and_the_tenant_sees_its_output() {
    let h = Harness::process(vec![
        baseline("input", vec![py("redact", "modify", REDACT_SECRET)]),
        tenant(
            "input",
            vec![py(
                "look",
                "detect",
                "return {'action': 'detect', 'findings': [context['outgoing']]}",
            )],
            json!({}),
        ),
    ])
    .await;
    let r = h.run("input", json!("my secret")).await.unwrap();
    let names: Vec<String> = r.walk.hooks.iter().map(|h| h.shown_name()).collect();
    assert_eq!(names, ["baseline/redact", "look"]);
    assert_eq!(r.walk.hooks[1].findings, Some(json!(["my [x]"])));
    assert_eq!(r.walk.action, Action::Modify);
    let events = h.audit.events();
    assert_eq!(events[0]["baseline"]["chain"], "sluice-system/baseline");
}

#[tokio::test]
async fn a_baseline_block_means_the_tenant_never_runs() {
    let h = Harness::process(vec![
        baseline(
            "input",
            vec![py(
                "deny",
                "block",
                "return {'action': 'block', 'message': 'platform says no'}",
            )],
        ),
        tenant(
            "input",
            vec![py(
                "never",
                "modify",
                "return {'action': 'modify', 'outgoing': 'ran'}",
            )],
            json!({}),
        ),
    ])
    .await;
    let r = h.run("input", json!("hi")).await.unwrap();
    assert_eq!(
        (r.walk.action, r.walk.terminal_index),
        (Action::Block, Some(0))
    );
    assert_eq!(r.walk.message, "platform says no");
    assert_eq!(r.walk.hooks.len(), 1);
}

#[tokio::test]
async fn a_tenant_cannot_undo_what_the_baseline_did() {
    let h = Harness::process(vec![
        baseline("input", vec![py("redact", "modify", REDACT_SECRET)]),
        tenant(
            "input",
            vec![py("undo", "modify", "return {'action': 'modify', 'outgoing': context['outgoing'].replace('[x]', 'secret')}")],
            json!({}),
        ),
    ])
    .await;
    let r = h.run("input", json!("my secret")).await.unwrap();
    assert_eq!(
        r.walk.payload,
        json!("my [x]"),
        "the baseline re-checks the tenant's output"
    );
    let names: Vec<String> = r.walk.hooks.iter().map(|h| h.shown_name()).collect();
    assert_eq!(
        names,
        ["baseline/redact", "undo", "baseline-recheck/redact"]
    );
}

#[tokio::test]
async fn a_baseline_alone_serves_a_target_without_a_chain() {
    let h = Harness::process(vec![baseline(
        "input",
        vec![py("redact", "modify", REDACT_SECRET)],
    )])
    .await;
    let r = h.run("input", json!("a secret")).await.unwrap();
    assert_eq!(r.walk.payload, json!("a [x]"));
    assert_eq!(r.walk.hooks[0].shown_name(), "baseline/redact");
}

const REDACT_PHONE: &str = "import re\nreturn {'action': 'modify', 'outgoing': re.sub(r'010-\\d{4}-\\d{4}', '[phone]', context['outgoing'])}";

#[tokio::test]
async fn a_tenants_streaming_window_cannot_shrink_the_baselines() {
    let h = Harness::process(vec![
        baseline_with(
            "output",
            vec![py("phone", "modify", REDACT_PHONE)],
            json!({"streaming": {"flushChars": 8, "lookbackChars": 16}}),
        ),
        tenant(
            "output",
            vec![py("noop", "detect", "return {'action': 'pass'}")],
            json!({"streaming": {"flushChars": 1, "lookbackChars": 0}}),
        ),
    ])
    .await;
    let s = h
        .stream(&["call me at 010-", "12", "34-", "5678", " or not"])
        .await;
    assert!(s.error.is_none(), "{:?}", s.error);
    let shown = s.commits.concat();
    for part in ["010-", "1234", "5678"] {
        assert!(
            !shown.contains(part),
            "{part:?} was committed: {:?}",
            s.commits
        );
    }
    assert_eq!(shown, "call me at [phone] or not");
    let f = s.final_.expect("a final");
    assert_eq!(f.walk.payload, json!("call me at [phone] or not"));
}

#[tokio::test]
async fn a_tenants_larger_window_is_kept() {
    // Tighten-only works both ways: a tenant asking for a larger lookback than the baseline's gets it.
    let h = Harness::process(vec![
        baseline_with(
            "output",
            vec![py("noop", "detect", "return {'action': 'pass'}")],
            json!({"streaming": {"flushChars": 1, "lookbackChars": 0}}),
        ),
        tenant(
            "output",
            vec![py("phone", "modify", REDACT_PHONE)],
            json!({"streaming": {"flushChars": 8, "lookbackChars": 16}}),
        ),
    ])
    .await;
    let s = h.stream(&["call me at 010-", "1234-", "5678 or not"]).await;
    assert_eq!(s.commits.concat(), "call me at [phone] or not");
}

/// A tenant's block or skip message reaches the user too: the baseline sees it before it leaves,
/// on Run and on the stream path alike.
#[tokio::test]
async fn a_tenants_block_or_skip_message_goes_through_the_baseline() {
    for action in ["block", "skip"] {
        let h = Harness::process(vec![
            baseline("output", vec![py("redact", "modify", REDACT_SECRET)]),
            tenant(
                "output",
                vec![py(
                    "stop",
                    action,
                    &format!("return {{'action': '{action}', 'message': 'the secret is 42'}}"),
                )],
                json!({"streaming": {"flushChars": 4, "lookbackChars": 0}}),
            ),
        ])
        .await;
        let r = h.run("output", json!("hello")).await.unwrap();
        assert!(r.walk.is_terminal(), "{:?}", r.walk);
        assert_eq!(r.walk.message, "the [x] is 42", "{action}: {:?}", r.walk);
        let s = h.stream(&["hello there"]).await;
        let (blocked, _hook) = s
            .blocked
            .clone()
            .unwrap_or_else(|| panic!("{action}: the stream was not stopped: {:?}", s.error));
        assert_eq!(blocked, "the [x] is 42", "{action}");
        let events = h.audit.events();
        assert!(
            events.iter().all(|e| !e.to_string().contains("secret is")),
            "{action}: the audit shows what the user saw: {events:?}"
        );
    }
}

/// The baseline's pool serves every tenant: a run holds a baseline sandbox only while the baseline
/// walks (and again for its recheck), not while the tenant's own chain runs. Tenant A's slow hook
/// (waiting on a host_call) no longer keeps tenant B from the baseline's only sandbox.
#[tokio::test]
async fn a_slow_tenant_does_not_hold_the_baselines_sandbox() {
    let slow = json!({"name": "slow", "action": "detect", "capabilities": ["sleep"], "code":
        "def execute(context, settings):\n    context.host_call('sleep', {'ms': 30000})\n    return {'action': 'pass'}\n"});
    let quick = py("quick", "detect", "return {'action': 'pass'}");
    let limits = sluice_engine::Limits {
        claim_timeout: std::time::Duration::from_secs(10),
        host_call_time_per_run: std::time::Duration::from_secs(60),
        ..common::limits()
    };
    let backend = common::process_backend();
    let h = Harness::with_backend(
        std::sync::Arc::new(backend),
        vec![
            common::baseline_with(
                "input",
                vec![py("mark", "detect", "return {'action': 'pass'}")],
                json!({"pool": {"warm": 1, "max": 1}}),
            ),
            common::chain(
                "team-a",
                "a",
                "bot",
                "input",
                vec![slow],
                json!({"timeoutMs": 60000}),
            ),
            common::chain("team-b", "b", "bot", "input", vec![quick], json!({})),
        ],
        limits,
    )
    .await;
    let input = |ns: &str| sluice_engine::RunInput {
        namespace: ns.into(),
        target: "bot".into(),
        trigger_point: "input".into(),
        payload: Some(json!("hi")),
        ..Default::default()
    };
    let engine = h.engine.clone();
    let a_input = input("team-a");
    let a = tokio::spawn(async move { engine.run(a_input).await });
    // Until tenant A's hook is inside its host_call, after the baseline's walk.
    while !h
        .capabilities
        .seen
        .lock()
        .unwrap()
        .iter()
        .any(|c| c.name == "sleep")
    {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let b = h.engine.run(input("team-b")).await;
    assert!(b.is_ok(), "tenant B was kept from the baseline: {b:?}");
    a.abort();
}

/// Tenants take turns in the baseline's pool, which every tenant's runs go through: a tenant that
/// floods it gets its turn, not the whole queue. Tenant B's one run, sent after tenant A's flood,
/// is served at the next free sandbox; in arrival order it would wait behind all of A's.
#[tokio::test]
async fn a_flooding_tenant_cannot_queue_others_out_of_the_baselines_pool() {
    let limits = sluice_engine::Limits {
        claim_timeout: std::time::Duration::from_millis(2500),
        ..common::limits()
    };
    let backend = common::process_backend();
    let h = Harness::with_backend(
        std::sync::Arc::new(backend),
        vec![
            common::baseline_with(
                "input",
                vec![py(
                    "slow-mark",
                    "detect",
                    "import time\ntime.sleep(1.0)\nreturn {'action': 'pass'}",
                )],
                json!({"pool": {"warm": 2, "max": 2}}),
            ),
            common::chain(
                "team-a",
                "a",
                "bot",
                "input",
                vec![py("qa", "detect", "return {'action': 'pass'}")],
                json!({}),
            ),
            common::chain(
                "team-b",
                "b",
                "bot",
                "input",
                vec![py("qb", "detect", "return {'action': 'pass'}")],
                json!({}),
            ),
        ],
        limits,
    )
    .await;
    let input = |ns: &str| sluice_engine::RunInput {
        namespace: ns.into(),
        target: "bot".into(),
        trigger_point: "input".into(),
        payload: Some(json!("hi")),
        ..Default::default()
    };
    // Both tenants' own pools warm, so that only the baseline's is contended.
    assert!(h.engine.run(input("team-a")).await.is_ok());
    assert!(h.engine.run(input("team-b")).await.is_ok());
    // Two of A's runs hold both sandboxes for 1 s, six wait; B's one run comes next. In arrival
    // order B would get a sandbox at 3 s, past its 2.5 s claim timeout; taking turns, at 1 s.
    let flood: Vec<_> = (0..8)
        .map(|_| {
            let engine = h.engine.clone();
            let i = input("team-a");
            tokio::spawn(async move { engine.run(i).await })
        })
        .collect();
    // Until A's flood is queued behind the baseline's two sandboxes.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let b = h.engine.run(input("team-b")).await;
    assert!(
        b.is_ok(),
        "tenant B was queued out of the baseline by A's flood: {b:?}"
    );
    for f in flood {
        let _ = f.await;
    }
}

/// A run holds the baseline's sandbox only around the baseline's walks: a tenant whose own chain is
/// waiting for a sandbox (`reuse: None`, slow module code, its only sandbox busy) does not sit on
/// the baseline's meanwhile, keeping every other tenant from it.
#[tokio::test]
async fn a_tenant_waiting_for_its_own_sandbox_does_not_hold_the_baselines() {
    let slow = json!({"name": "slow", "action": "detect", "code":
        "import time\ntime.sleep(2)\ndef execute(context, settings):\n    return {'action': 'pass'}\n"});
    let limits = sluice_engine::Limits {
        claim_timeout: std::time::Duration::from_secs(30),
        ..common::limits()
    };
    let backend = common::process_backend();
    let h = Harness::with_backend(
        std::sync::Arc::new(backend),
        vec![
            common::baseline_with(
                "input",
                vec![py("mark", "detect", "return {'action': 'pass'}")],
                json!({"pool": {"warm": 1, "max": 1}}),
            ),
            common::chain(
                "team-a",
                "a",
                "bot",
                "input",
                vec![slow],
                json!({"timeoutMs": 8000, "pool": {"warm": 1, "max": 1, "reuse": "None"}}),
            ),
        ],
        limits,
    )
    .await;
    let input = || sluice_engine::RunInput {
        namespace: "team-a".into(),
        target: "bot".into(),
        trigger_point: "input".into(),
        payload: Some(json!("hi")),
        ..Default::default()
    };
    // Two runs at once: one walks in A's only sandbox (2 s of module code), the other waits for
    // it to be replaced.
    let runs: Vec<_> = (0..2)
        .map(|_| {
            let engine = h.engine.clone();
            let i = input();
            tokio::spawn(async move { engine.run(i).await })
        })
        .collect();
    tokio::time::sleep(std::time::Duration::from_millis(700)).await;
    let held: usize = h
        .engine
        .pools()
        .sizes()
        .iter()
        .filter(|(name, ..)| name.starts_with(common::PLATFORM))
        .map(|(_, _, claimed)| claimed)
        .sum();
    assert_eq!(
        held, 0,
        "a run waiting for its own sandbox holds the baseline's"
    );
    for r in runs {
        assert!(r.await.unwrap().is_ok());
    }
}
