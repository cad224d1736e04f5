//! Fair sandbox scheduling across chains: boots for claims that are waiting go before warm-up
//! boots, chains take turns, and the gateway caps boots at once and warm sandboxes in all, so no
//! chain's pool can starve another's. Driven by a scripted backend whose boots take a while
//! without using the CPU.

use crate::common;

use common::scripted::{Chunk, ScriptedBackend, honest};
use common::{Harness, NS, chain, hook};
use serde_json::json;
use sluice_engine::Limits;
use std::sync::Arc;
use std::time::Duration;

fn backend(boot: Duration) -> Arc<ScriptedBackend> {
    Arc::new(
        ScriptedBackend::new(Arc::new(|c: &Chunk| honest(c, |t| t.to_string()))).boot_delay(boot),
    )
}

fn chain_for(target: &str, pool: serde_json::Value) -> sluice_crds::definition::Definition {
    chain(
        NS,
        target,
        target,
        "input",
        vec![hook("noop", "modify", "x")],
        json!({"pool": pool}),
    )
}

#[tokio::test]
async fn a_chain_asking_for_many_warm_sandboxes_does_not_starve_a_loaded_one() {
    // Every run of "busy" needs a fresh boot (reuse: None); "greedy" wants 40 warm sandboxes, which
    // take two seconds to boot two at a time: longer than a claim may wait.
    let limits = Limits {
        claim_timeout: Duration::from_secs(1),
        ..common::limits()
    };
    let h = Harness::with_boots(
        backend(Duration::from_millis(100)),
        vec![
            chain_for("greedy", json!({"warm": 40, "max": 40})),
            chain_for("busy", json!({"warm": 1, "max": 4, "reuse": "None"})),
        ],
        limits,
        2,
    )
    .await;
    let mut errors = Vec::new();
    for _ in 0..12 {
        if let Err(e) = h.run_at("busy", "input", json!("hi")).await {
            errors.push(e.to_string());
        }
    }
    assert!(
        errors.is_empty(),
        "{} of 12 runs failed: {errors:?}",
        errors.len()
    );
}

#[tokio::test]
async fn a_gateway_with_30_chains_answers_each_first_request_within_the_claim_timeout() {
    // 30 chains × 4 warm sandboxes, two boots at a time: six seconds to warm everything up, while
    // a claim waits at most four.
    let limits = Limits {
        claim_timeout: Duration::from_secs(4),
        ..common::limits()
    };
    let targets: Vec<String> = (0..30).map(|i| format!("bot-{i:02}")).collect();
    let h = Harness::with_boots(
        backend(Duration::from_millis(100)),
        targets
            .iter()
            .map(|t| chain_for(t, json!({"warm": 4, "max": 8})))
            .collect(),
        limits,
        2,
    )
    .await;
    let runs = targets.iter().map(|t| h.run_at(t, "input", json!("hi")));
    let results = futures::future::join_all(runs).await;
    let failed: Vec<String> = results
        .iter()
        .filter_map(|r| r.as_ref().err().map(|e| e.to_string()))
        .collect();
    assert!(
        failed.is_empty(),
        "{} of 30 failed: {failed:?}",
        failed.len()
    );
}

#[tokio::test]
async fn warm_sandboxes_are_capped_gateway_wide_and_shared_round_robin() {
    let limits = Limits {
        warm_sandboxes: 6,
        ..common::limits()
    };
    let h = Harness::with_boots(
        backend(Duration::from_millis(5)),
        vec![
            chain_for("a", json!({"warm": 10, "max": 10})),
            chain_for("b", json!({"warm": 10, "max": 10})),
            chain_for("c", json!({"warm": 1, "max": 10})),
        ],
        limits,
        2,
    )
    .await;
    assert!(
        h.engine.pools().wait_warm(Duration::from_secs(20)).await,
        "the pools never reached the cap"
    );
    // Nothing more is booted once the cap is reached.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let sizes = h.engine.pools().sizes();
    let total: usize = sizes.iter().map(|(_, warm, _)| warm).sum();
    assert_eq!(total, 6, "{sizes:?}");
    for (name, warm, _) in &sizes {
        assert!(*warm >= 1, "{name} got no warm sandbox: {sizes:?}");
    }
    // A chain still gets a sandbox for a request when the cap is reached.
    let r = h.run_at("c", "input", json!("hi")).await;
    assert!(r.is_ok(), "{r:?}");
}

/// A boot holds its gateway-wide slot only until the sandbox is up, not through the chain's module
/// code: one chain whose module sleeps cannot keep another chain from booting.
#[tokio::test]
async fn slow_module_code_does_not_hold_a_boot_slot() {
    let backend = common::process_backend();
    let sleepy = common::hook(
        "sleepy",
        "detect",
        "import time\ntime.sleep(30)\ndef execute(context, settings):\n    return {'action': 'pass'}\n",
    );
    let quick = common::py(
        "quick",
        "modify",
        "return {'action': 'modify', 'outgoing': 'ok'}",
    );
    let limits = Limits {
        claim_timeout: Duration::from_secs(10),
        boot_timeout: Duration::from_secs(60),
        ..common::limits()
    };
    let h = Harness::with_boots(
        Arc::new(backend),
        vec![
            chain(
                NS,
                "sleepy",
                "sleepy",
                "input",
                vec![sleepy],
                json!({"timeoutMs": 60000, "pool": {"warm": 2, "max": 2}}),
            ),
            chain(
                NS,
                "quick",
                "quick",
                "input",
                vec![quick],
                json!({"pool": {"warm": 1, "max": 1, "reuse": "None"}}),
            ),
        ],
        limits,
        1,
    )
    .await;
    // Every run of the quick chain needs a boot of its own (reuse: None), while the sleepy chain's
    // boots sit in their module code.
    for i in 0..3 {
        let r = h.run_at("quick", "input", json!("x")).await;
        assert!(r.is_ok(), "run {i} of the quick chain: {r:?}");
    }
}

/// A backend whose every start fails, counting the attempts.
#[derive(Default)]
struct Broken {
    starts: std::sync::atomic::AtomicU64,
}

#[async_trait::async_trait]
impl sluice_engine::SandboxBackend for Broken {
    async fn start(
        &self,
        spec: &sluice_engine::SandboxSpec,
    ) -> Result<sluice_engine::Sandbox, sluice_engine::StartError> {
        self.starts
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let failure = sluice_engine::StartFailure::Runtime("the runtime is broken".into());
        Err(sluice_engine::StartError::new(spec, failure))
    }
    async fn clean_leftovers(&self) -> usize {
        0
    }
    async fn live(&self) -> Vec<String> {
        Vec::new()
    }
}

// On tokio's paused clock (as pools.rs): the backend fails at once, so the 4.2 s below pass in no
// time and the count of boots is exact.
#[tokio::test(start_paused = true)]
async fn a_chain_whose_boots_fail_backs_off() {
    // Boots that fail again and again are retried ever more slowly (0.5 s, 1 s, 2 s, ...), not
    // every half second for as long as the runtime is broken.
    let broken = Arc::new(Broken::default());
    let h = Harness::with_boots(
        broken.clone(),
        vec![chain_for("doomed", json!({"warm": 1, "max": 2}))],
        Limits {
            claim_timeout: Duration::from_secs(1),
            ..common::limits()
        },
        2,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(4200)).await;
    let starts = broken.starts.load(std::sync::atomic::Ordering::Relaxed);
    // At 0, 0.5, 1.5 and 3.5 s; a fixed half-second retry would have made nine.
    assert!(
        (2..=5).contains(&starts),
        "{starts} boots in 4.2 s of a broken runtime"
    );
    // A run says why, instead of waiting for a boot that cannot come.
    let error = h.run_at("doomed", "input", json!("hi")).await.unwrap_err();
    assert!(
        error.to_string().contains("the runtime is broken"),
        "{error}"
    );
    // And names the chain it could not start a sandbox for.
    assert!(
        error
            .to_string()
            .contains("cannot start a sandbox for chain team/doomed"),
        "{error}"
    );
}
