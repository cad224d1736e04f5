//! Pools and cells: `reuse: Recycle` serves trigger point after trigger point from one sandbox, each
//! in a fresh cell, and retires it after `maxUses`, a deadline kill or a dirty verdict; `reuse: None`
//! boots one per trigger point; a supervisor of another protocol is refused with a clear error.

use crate::common;

use common::scripted::{Chunk, ScriptedBackend, honest};
use common::{Harness, py, tenant};
use serde_json::json;
use sluice_crds::Action;
use sluice_engine::EngineError;
use std::sync::Arc;
use std::time::Duration;

const UPPER: &str = "return {'action': 'modify', 'outgoing': context['outgoing'].upper()}";
/// Reports the process's own pid namespace and a counter kept in a global: a fresh cell starts the
/// counter over, and is pid 1 of a pid namespace of its own.
const WHO: &str = "import builtins\nCOUNT = [0]\ndef execute(context, settings):\n    COUNT[0] += 1\n    builtins.SEEN = getattr(builtins, 'SEEN', 0) + 1\n    return {'action': 'modify', 'outgoing': str(builtins.SEEN) + ' ' + str(COUNT[0])}\n";

fn pool(extra: serde_json::Value) -> serde_json::Value {
    json!({"pool": extra})
}

async fn retirements(h: &Harness, reason: &str) -> u64 {
    h.engine.metrics().retirements(reason)
}

/// Waits until the pool has a sandbox ready again (the recycling happens after the answer).
async fn settle(h: &Harness) {
    assert!(
        h.engine.pools().wait_warm(Duration::from_secs(20)).await,
        "the pool never refilled"
    );
}

#[tokio::test]
async fn recycle_serves_every_trigger_point_from_one_sandbox_in_a_fresh_cell() {
    let h = Harness::process(vec![tenant(
        "input",
        vec![common::hook("who", "modify", WHO)],
        pool(json!({"warm": 1, "max": 1, "reuse": "Recycle"})),
    )])
    .await;
    let mut seen = Vec::new();
    for _ in 0..4 {
        settle(&h).await;
        let r = h.run("input", json!("x")).await.unwrap();
        seen.push(r.walk.payload.as_str().unwrap().to_string());
    }
    assert_eq!(h.engine.metrics().boots(), 1, "{seen:?}");
    // Globals and the interpreter's builtins start over: a fresh instance each time.
    assert!(seen.iter().all(|s| s == "1 1"), "{seen:?}");
}

#[tokio::test]
async fn none_boots_a_sandbox_per_trigger_point() {
    let h = Harness::process(vec![tenant(
        "input",
        vec![py("up", "modify", UPPER)],
        pool(json!({"warm": 1, "max": 2, "reuse": "None"})),
    )])
    .await;
    for _ in 0..3 {
        settle(&h).await;
        assert_eq!(
            h.run("input", json!("x")).await.unwrap().walk.payload,
            json!("X")
        );
    }
    settle(&h).await;
    assert!(h.engine.metrics().boots() >= 4);
    assert_eq!(retirements(&h, "reuse_none").await, 3);
}

#[tokio::test]
async fn max_uses_retires_the_sandbox_without_a_failed_run() {
    let h = Harness::process(vec![tenant(
        "input",
        vec![py("up", "modify", UPPER)],
        pool(json!({"warm": 1, "max": 1, "reuse": "Recycle", "maxUses": 2})),
    )])
    .await;
    for _ in 0..5 {
        settle(&h).await;
        let r = h.run("input", json!("x")).await.unwrap();
        assert_eq!(r.walk.action, Action::Modify, "{:?}", r.walk);
    }
    settle(&h).await;
    // Uses 1-2, 3-4, then 5: two sandboxes reached maxUses.
    assert_eq!(retirements(&h, "max_uses").await, 2);
    assert_eq!(h.engine.metrics().boots(), 3);
}

#[tokio::test]
async fn a_deadline_kill_retires_the_sandbox_and_the_next_run_gets_a_fresh_one() {
    // A supervisor that never answers a walk (the real one stops every hook at its deadline, so
    // it stands in for one that cannot): the gateway's backstop kills it.
    let backend = ScriptedBackend::new(Arc::new(|c: &Chunk| {
        if c.outgoing == "slow" {
            Vec::new()
        } else {
            honest(c, |t| t.to_uppercase())
        }
    }));
    let h = Harness::with_backend(
        Arc::new(backend),
        vec![tenant(
            "input",
            vec![py("slow", "modify", UPPER)],
            json!({"timeoutMs": 300, "pool": {"warm": 1, "max": 1, "reuse": "Recycle"}}),
        )],
        common::limits(),
    )
    .await;
    settle(&h).await;
    let r = h.run("input", json!("slow")).await.unwrap();
    assert_eq!(r.walk.action, Action::Block, "Closed: a timeout blocks");
    settle(&h).await;
    assert_eq!(retirements(&h, "broken").await, 1);
    let r = h.run("input", json!("fast")).await.unwrap();
    assert_eq!(r.walk.payload, json!("FAST"));
    assert_eq!(h.engine.metrics().boots(), 2);
}

#[tokio::test]
async fn a_dirty_verdict_retires_the_sandbox() {
    // A scripted supervisor that reports every cell's end as dirty.
    let backend = ScriptedBackend::new(Arc::new(|c: &Chunk| honest(c, |t| t.to_uppercase())))
        .dirty("1 process(es) started by hooks outlived their hook (killed)");
    let h = two_trigger_points_of_one_recycled_chain(backend).await;
    assert_eq!(retirements(&h, "dirty").await, 2);
    assert_eq!(h.engine.metrics().boots(), 3);
}

/// An engine on `backend` serving one `Recycle` chain of one hook (upper case), after two trigger
/// points through it, settled.
async fn two_trigger_points_of_one_recycled_chain(backend: ScriptedBackend) -> Harness {
    let h = Harness::with_backend(
        Arc::new(backend),
        vec![tenant(
            "input",
            vec![py("up", "modify", UPPER)],
            pool(json!({"warm": 1, "max": 1, "reuse": "Recycle"})),
        )],
        common::limits(),
    )
    .await;
    for _ in 0..2 {
        settle(&h).await;
        assert_eq!(
            h.run("input", json!("x")).await.unwrap().walk.payload,
            json!("X")
        );
    }
    settle(&h).await;
    h
}

/// Recycling a sandbox is one exchange with it: `end` and the next cell's `init` go out together, so
/// a supervisor far away (through the exec path of a cluster) costs one round trip between trigger
/// points, not two. The scripted supervisor answers `end` only once the next request is in: the
/// gateway must not be waiting for that answer before it sends `init`.
#[tokio::test]
async fn recycling_sends_the_next_init_without_waiting_for_ended() {
    let backend = ScriptedBackend::new(Arc::new(|c: &Chunk| honest(c, |t| t.to_uppercase())))
        .end_waits_for_next();
    let exchange = backend.exchange();
    let h = two_trigger_points_of_one_recycled_chain(backend).await;
    let seen = exchange.lock().unwrap().clone();
    let ends = seen.iter().filter(|e| *e == "got end").count();
    let early = seen
        .iter()
        .filter(|e| *e == "got init (before ended went out)")
        .count();
    assert_eq!(ends, 2, "{seen:?}");
    assert_eq!(
        early, ends,
        "every init must go out before its end is answered: {seen:?}"
    );
    assert_eq!(h.engine.metrics().boots(), 1, "{seen:?}");
    assert_eq!(retirements(&h, "broken").await, 0, "{seen:?}");
}

/// After an upgrade the backend says the sandboxes it started before are outdated: each serves the
/// trigger point it is in, and is then retired instead of recycled; no run fails.
#[tokio::test]
async fn outdated_sandboxes_are_retired_after_their_trigger_point() {
    let backend = Arc::new(ScriptedBackend::new(Arc::new(|c: &Chunk| {
        honest(c, |t| t.to_uppercase())
    })));
    let h = Harness::with_backend(
        backend.clone(),
        vec![tenant(
            "input",
            vec![py("up", "modify", UPPER)],
            pool(json!({"warm": 1, "max": 2, "reuse": "Recycle"})),
        )],
        common::limits(),
    )
    .await;
    settle(&h).await;
    assert_eq!(
        h.run("input", json!("a")).await.unwrap().walk.payload,
        json!("A")
    );
    settle(&h).await;
    assert_eq!(
        retirements(&h, "outdated").await,
        0,
        "current sandboxes are recycled"
    );
    let boots = h.engine.metrics().boots();
    backend.upgrade();
    for text in ["b", "c", "d"] {
        assert_eq!(
            h.run("input", json!(text)).await.unwrap().walk.payload,
            json!(text.to_uppercase())
        );
        settle(&h).await;
    }
    assert_eq!(
        retirements(&h, "outdated").await,
        1,
        "the one old sandbox, once"
    );
    // At least one new sandbox replaced it. Not exactly one: a claim is backfilled 25 ms after it
    // (unless the run is back by then), and on a loaded machine a run can take longer; such a
    // spare is new, so the count of outdated retirements above stays 1 either way.
    assert!(
        h.engine.metrics().boots() > boots,
        "replaced by a new sandbox"
    );
}

#[tokio::test]
async fn a_supervisor_of_another_protocol_is_refused_with_a_clear_error() {
    let backend =
        ScriptedBackend::new(Arc::new(|c: &Chunk| honest(c, |t| t.to_string()))).protocol(1);
    let mut limits = common::limits();
    limits.claim_timeout = Duration::from_secs(2);
    let h = Harness::with_backend(
        Arc::new(backend),
        vec![tenant("input", vec![py("up", "modify", UPPER)], json!({}))],
        limits,
    )
    .await;
    match h.run("input", json!("x")).await {
        Err(EngineError::Unavailable(message)) => assert!(
            message.contains("speaks protocol 1, this gateway speaks 3"),
            "{message}"
        ),
        other => panic!("expected UNAVAILABLE naming the protocols, got {other:?}"),
    }
}

/// What hooks print is drained and discarded per trigger point: a hook that printed just over the
/// output limit in one trigger point leaves nothing behind for the next one in the same sandbox,
/// whose honest (chatty) hook runs and is not blamed.
#[tokio::test]
async fn output_is_counted_per_trigger_point_and_always_drained() {
    let chatty = "import sys\nif context['outgoing'] == 'flood':\n    sys.stdout.write('x' * ((8 << 20) + 4096))\nelse:\n    sys.stdout.write('y' * (1 << 20))\nsys.stdout.flush()\nreturn {'action': 'modify', 'outgoing': 'done'}";
    let h = Harness::process(vec![tenant(
        "input",
        vec![py("chatty", "modify", chatty)],
        json!({"timeoutMs": 5000, "pool": {"warm": 1, "max": 1, "reuse": "Recycle"}}),
    )])
    .await;
    settle(&h).await;
    let flood = h.run("input", json!("flood")).await.unwrap();
    assert_eq!(flood.walk.payload, json!("done"), "{:?}", flood.walk);
    for i in 0..3 {
        settle(&h).await;
        let r = h.run("input", json!("honest")).await.unwrap();
        assert_eq!(
            r.walk.payload,
            json!("done"),
            "trigger point {i} after the flood: {:?}",
            r.walk
        );
    }
    assert_eq!(h.engine.metrics().boots(), 1, "one sandbox served them all");
}
