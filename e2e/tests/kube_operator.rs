//! The real operator and the real gateway together against the fake API server, whose scheduler
//! and kubelet stand-ins start the operator's pods (after a node's start latency) as local runsc
//! sandboxes and probe them every period. What a cluster would pay is counted: pods created and API
//! writes per trigger point.

use sluice_e2e::{Harness, action, chain_yaml, manifest_json, text};
use sluice_fake_apiserver::{FakeApiServer, Resource, Verb};
use sluice_operator::build::Settings;
use sluice_operator::controller::{self, LeaseTiming, RunConfig};
use sluice_operator::leader::{self, LeaseLock};
use sluice_operator::metrics::Metrics;
use sluice_proto::Action;
use std::time::Duration;

const REDACT: &str = r##"import re
def execute(context, settings):
    out = re.sub(r"\d", "#", context["outgoing"])
    if out == context["outgoing"]:
        return {"action": "pass"}
    return {"action": "modify", "outgoing": out}"##;

const TRIGGER_POINTS: u64 = 20;

/// The operator as `sluice-operator run` runs it (leader election included), until `stop`.
fn start_operator(
    api: &FakeApiServer,
) -> (
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<()>,
) {
    let client = api.client();
    let config = RunConfig {
        settings: Settings::default(),
        claim_deadline: Duration::from_secs(300),
        start_deadline: Duration::from_secs(120),
        namespace: None,
        platform_namespace: "sluice-system".into(),
        identity: "operator-e2e".into(),
    };
    let lock = LeaseLock::new(
        kube::Api::namespaced(client.clone(), "sluice-system"),
        "sluice-operator",
        &config.identity,
        leader::LEASE_DURATION,
    );
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(controller::run_when_leading(
        client,
        config,
        Metrics::new(),
        lock,
        LeaseTiming::default(),
        stopped,
    ));
    (stop, task)
}

fn ready_warm_pods(api: &FakeApiServer, chain: &str) -> usize {
    api.list(Resource::Pods, "default")
        .iter()
        .filter(|p| p["metadata"]["labels"]["sluice.dev/chain"] == chain)
        .filter(|p| p["metadata"]["labels"]["sluice.dev/pool"] == "warm")
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .filter(|p| {
            p["status"]["conditions"].as_array().is_some_and(|cs| {
                cs.iter()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True")
            })
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_operator_keeps_the_pool_the_gateway_runs_on() {
    // A node's realistic start latency (the default).
    let api = FakeApiServer::builder()
        .start()
        .await
        .expect("fake API server");
    let chain = chain_yaml(
        "op",
        "bot",
        "input",
        "pool: {warm: 2, max: 8}",
        &[("digits", "modify", REDACT)],
    );
    api.apply(Resource::HookChains, manifest_json(&chain));
    let (stop_operator, operator) = start_operator(&api);

    // The operator's own pods, started and probed by the kubelet stand-in, turn Ready.
    let mut warm = 0;
    for _ in 0..2400 {
        warm = ready_warm_pods(&api, "op");
        if warm >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        warm >= 2,
        "the operator's pool never turned Ready: {:#?}",
        api.list(Resource::Pods, "default")
    );
    let hc = api
        .get(Resource::HookChains, "default", "op")
        .expect("chain");
    assert!(
        hc["status"]["conditions"].is_array(),
        "the operator wrote no status: {hc}"
    );

    let h = Harness::start_kube(&api, "gw-op", Duration::from_secs(90)).await;
    let before = api.writes();
    for i in 0..TRIGGER_POINTS {
        let r = h
            .run_text("bot", "input", &format!("call 555-{i:03}"))
            .await
            .expect("run");
        assert_eq!(action(&r), Action::Modify, "{r:?}");
        assert_eq!(text(&r), "call ###-###");
        assert!(r.hooks.iter().all(|o| o.error.is_empty()), "{:?}", r.hooks);
    }
    let during = api.writes().since(&before);
    h.stop_kube_and_check(&api).await;
    stop_operator.send_replace(true);
    tokio::time::timeout(Duration::from_secs(60), operator)
        .await
        .expect("the operator stops")
        .expect("the operator did not panic");

    let all = api.writes();
    let created = all.get(Verb::Create, "pods");
    let claims = during.get(Verb::Patch, "pods");
    println!("API writes while {TRIGGER_POINTS} trigger points ran:\n{during}");
    println!(
        "pods created: {created} in all ({} while the trigger points ran); API writes per trigger point: {:.1}",
        during.get(Verb::Create, "pods"),
        during.total() as f64 / TRIGGER_POINTS as f64
    );
    // Today every trigger point takes a pod of its own: one claim each, and every pod it took had
    // been created by the operator.
    assert!(claims >= TRIGGER_POINTS, "{during}");
    assert!(
        created >= TRIGGER_POINTS,
        "{created} pods created for {TRIGGER_POINTS} trigger points"
    );
    assert!(
        during.get(Verb::Create, "pods/exec") >= TRIGGER_POINTS,
        "{during}"
    );
    assert!(
        during.total() >= claims + during.get(Verb::Delete, "pods"),
        "{during}"
    );
    // The writes came from both: the gateway's claims and deletes, the operator's creates and status.
    assert!(
        all.on("hookchains/status") >= 1 && all.on("leases") >= 1,
        "{all}"
    );
    api.stop().await;
}
