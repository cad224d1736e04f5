//! One chain's pool on tokio's paused clock: boots stay within the gateway's boot concurrency, a
//! claimed sandbox is replaced up to the warm target, and sandboxes past the warm target are retired
//! once idle for `idle_retire`, not before. Driven by the scripted backend, whose boots and chunks
//! take a set time on that clock, so every count below is exact.

use crate::common;

use common::scripted::{Chunk, ScriptedBackend, honest};
use common::{Harness, NS, chain, hook};
use serde_json::{Value, json};
use sluice_engine::Limits;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::sleep;

const BOOT: Duration = Duration::from_millis(100);

fn backend() -> ScriptedBackend {
    ScriptedBackend::new(Arc::new(|c: &Chunk| honest(c, |t| t.to_string()))).boot_delay(BOOT)
}

fn bot(pool: Value) -> sluice_crds::definition::Definition {
    chain(
        NS,
        "bot",
        "bot",
        "input",
        vec![hook("noop", "modify", "x")],
        json!({"pool": pool}),
    )
}

/// (warm, booting) across the pools right now.
fn now(h: &Harness) -> (usize, usize) {
    let p = h.engine.pools().warm_progress();
    (p.warm, p.booting)
}

/// `sluice_gateway_pool_warm_sandboxes` of the chain.
fn warm_gauge(h: &Harness) -> i64 {
    h.engine
        .metrics()
        .pool_warm
        .with_label_values(&[&format!("{NS}/bot")])
        .get()
}

#[tokio::test(start_paused = true)]
async fn boots_run_at_most_boot_concurrency_at_once() {
    let h = Harness::with_boots(
        Arc::new(backend()),
        vec![bot(json!({"warm": 5, "max": 5}))],
        common::limits(),
        2,
    )
    .await;
    // Sampled midway through each 100 ms boot: two at a time, then the last one alone.
    let mut seen = Vec::new();
    sleep(BOOT / 2).await;
    for _ in 0..4 {
        seen.push(now(&h));
        sleep(BOOT).await;
    }
    assert_eq!(seen, [(0, 2), (2, 2), (4, 1), (5, 0)]);
    assert_eq!(h.engine.metrics().boots(), 5);
    assert_eq!(warm_gauge(&h), 5);
}

#[tokio::test(start_paused = true)]
async fn a_claimed_sandbox_is_replaced_up_to_the_warm_target() {
    let h = Harness::with_boots(
        Arc::new(backend()),
        vec![bot(json!({"warm": 2, "max": 4, "reuse": "None"}))],
        common::limits(),
        2,
    )
    .await;
    assert!(h.engine.pools().wait_warm(Duration::from_secs(1)).await);
    assert_eq!((now(&h), warm_gauge(&h)), ((2, 0), 2));

    h.run_at("bot", "input", json!("hi")).await.unwrap();
    // The claimed one is retired (reuse: None) and its replacement boots for 100 ms.
    sleep(BOOT / 2).await;
    assert_eq!((now(&h), warm_gauge(&h)), ((1, 1), 1));
    sleep(BOOT * 2).await;
    assert_eq!((now(&h), warm_gauge(&h)), ((2, 0), 2));
    let m = h.engine.metrics();
    assert_eq!((m.boots(), m.retirements("reuse_none")), (3, 1));
}

#[tokio::test(start_paused = true)]
async fn sandboxes_past_the_warm_target_retire_once_idle_for_idle_retire() {
    let limits = Limits {
        idle_retire: Duration::from_secs(30),
        ..common::limits()
    };
    let h = Harness::with_boots(
        Arc::new(backend().chunk_delay(Duration::from_secs(1))),
        vec![bot(json!({"warm": 1, "max": 4, "reuse": "Recycle"}))],
        limits,
        2,
    )
    .await;
    assert!(h.engine.pools().wait_warm(Duration::from_secs(1)).await);

    // Three runs at once hold three sandboxes for a second: the warm one and two booted for them;
    // meanwhile a fourth boots to keep one warm. All four come back.
    let runs = futures::future::join_all((0..3).map(|_| h.run_at("bot", "input", json!("hi"))));
    for run in runs.await {
        run.unwrap();
    }
    sleep(Duration::from_secs(1)).await;
    assert_eq!((now(&h), warm_gauge(&h)), ((4, 0), 4));
    assert_eq!(h.engine.metrics().boots(), 4);

    // Not before `idle_retire`...
    sleep(Duration::from_secs(20)).await;
    assert_eq!(now(&h), (4, 0));
    assert_eq!(h.engine.metrics().retirements("idle"), 0);
    // ...but within one shrink round (5 s) after it, down to the warm target.
    sleep(Duration::from_secs(15)).await;
    assert_eq!((now(&h), warm_gauge(&h)), ((1, 0), 1));
    assert_eq!(h.engine.metrics().retirements("idle"), 3);
    assert_eq!(
        h.engine.metrics().boots(),
        4,
        "nothing booted to replace them"
    );
}

/// A run that reaches the engine after its pools shut down (a proxy task that outlived its
/// connection) is refused at once and boots nothing: no sandbox may be started after the gateway's
/// shutdown has torn its sandboxes down (a local end-to-end test found one left running).
#[tokio::test(start_paused = true)]
async fn a_run_after_shutdown_is_refused_and_boots_no_sandbox() {
    let h = Harness::with_boots(
        Arc::new(backend()),
        vec![bot(json!({"warm": 1, "max": 2}))],
        common::limits(),
        2,
    )
    .await;
    assert!(h.engine.pools().wait_warm(Duration::from_secs(1)).await);
    h.run_at("bot", "input", json!("hi")).await.unwrap();
    h.engine.pools().shutdown(Duration::from_secs(5)).await;
    let boots = h.engine.metrics().boots();
    let refused = tokio::time::timeout(
        Duration::from_secs(1),
        h.run_at("bot", "input", json!("late")),
    )
    .await
    .expect("refused at once, not after the claim timeout");
    assert!(refused.is_err(), "{refused:?}");
    sleep(BOOT * 5).await;
    assert_eq!(
        h.engine.metrics().boots(),
        boots,
        "a sandbox booted after shutdown"
    );
    assert_eq!(now(&h), (0, 0));
}

/// A run that comes while the only held sandbox's last answer is on its way back (answered, not yet
/// handed back: the client already has it and asks again) waits for that sandbox instead of
/// booting another: in a cluster a boot is a claim, a pod for the operator to replace and a pod
/// held twice over (`kube_backend::recycled_trigger_points_on_a_held_pod_write_nothing` met it).
#[tokio::test(start_paused = true)]
async fn a_run_waits_for_a_sandbox_whose_answer_is_on_its_way_instead_of_booting_another() {
    let h = Harness::with_boots(
        Arc::new(backend().holds(1)),
        vec![bot(json!({"warm": 1, "max": 4, "reuse": "Recycle"}))],
        common::limits(),
        2,
    )
    .await;
    assert!(h.engine.pools().wait_warm(Duration::from_secs(1)).await);
    let boots = h.engine.metrics().boots();
    let input = |text: &str| sluice_engine::RunInput {
        namespace: NS.into(),
        target: "bot".into(),
        trigger_point: "input".into(),
        payload: Some(json!(text)),
        ..Default::default()
    };
    let (first, handback) = h.engine.run_holding(input("one")).await.unwrap();
    assert_eq!(first.walk.payload, json!("one"));
    let engine = h.engine.clone();
    let next = tokio::spawn(async move { engine.run(input("two")).await });
    // The answer is written a little later; meanwhile the next run waits.
    sleep(Duration::from_millis(10)).await;
    drop(handback);
    let second = next.await.unwrap().unwrap();
    assert_eq!(second.walk.payload, json!("two"));
    sleep(BOOT * 5).await;
    assert_eq!(
        h.engine.metrics().boots(),
        boots,
        "a sandbox booted for a run that its pool's own sandbox was coming back for"
    );
}
