//! The real operator and the real gateway together against the fake API server, whose scheduler
//! and kubelet stand-ins start the operator's pods (after a node's start latency) as local runsc
//! sandboxes and probe them every period. What a cluster would pay is counted: pods created and API
//! writes per trigger point.

use sluice_e2e::{Harness, action, chain_yaml, manifest_json, operator, text};
use sluice_fake_apiserver::{FakeApiServer, Resource, Verb};
use sluice_proto::Action;
use std::time::{Duration, Instant};

const REDACT: &str = r##"import re
def execute(context, settings):
    out = re.sub(r"\d", "#", context["outgoing"])
    if out == context["outgoing"]:
        return {"action": "pass"}
    return {"action": "modify", "outgoing": out}"##;

/// Trigger points of the `reuse: None` test (a pod each).
const TRIGGER_POINTS: u64 = 20;
/// Trigger points of the `reuse: Recycle` test.
const RECYCLED_TRIGGER_POINTS: u64 = 500;
/// How often the gateway of the `reuse: Recycle` test renews a held pod's claim (`KubeConfig::
/// heartbeat`; a minute by default). Each renewal is a pod change that sets the operator
/// reconciling the chain: the hold below spans several of them.
const HEARTBEAT: Duration = Duration::from_secs(4);
/// How long the pods stay held and idle: five claim renewals, twenty periods of the kubelet
/// stand-in's probes (1 s) and four of the exec connection's pings (5 s).
const HOLD: Duration = Duration::from_secs(20);

/// The operator as `sluice-operator run` runs it (leader election included), until `stop`.
fn start_operator(
    api: &FakeApiServer,
) -> (
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<()>,
) {
    operator::start(
        api.client(),
        operator::config("operator-e2e", Default::default()),
    )
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

/// A fake API server holding `chain`, with the real operator reconciling it until its pool has two
/// Ready warm pods.
async fn cluster_with(
    chain: &str,
    name: &str,
) -> (
    FakeApiServer,
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<()>,
) {
    // A node's realistic start latency (the default).
    let api = FakeApiServer::builder()
        .start()
        .await
        .expect("fake API server");
    api.apply(Resource::HookChains, manifest_json(chain));
    let (stop_operator, operator) = start_operator(&api);
    // The operator's own pods, started and probed by the kubelet stand-in, turn Ready.
    let mut warm = 0;
    for _ in 0..2400 {
        warm = ready_warm_pods(&api, name);
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
        .get(Resource::HookChains, "default", name)
        .expect("chain");
    assert!(
        hc["status"]["conditions"].is_array(),
        "the operator wrote no status: {hc}"
    );
    (api, stop_operator, operator)
}

async fn stop_operator(stop: tokio::sync::watch::Sender<bool>, task: tokio::task::JoinHandle<()>) {
    operator::stop((stop, task)).await;
}

async fn run_redacted(h: &Harness, i: u64) {
    let r = h
        .run_text("bot", "input", &format!("call 555-{:03}", i % 1000))
        .await
        .expect("run");
    assert_eq!(action(&r), Action::Modify, "{r:?}");
    assert_eq!(text(&r), "call ###-###");
    assert!(r.hooks.iter().all(|o| o.error.is_empty()), "{:?}", r.hooks);
}

/// Unhealthy events (failed probes) of the pods named.
fn unhealthy_events(api: &FakeApiServer, pods: &[String]) -> Vec<serde_json::Value> {
    api.list(Resource::Events, "default")
        .into_iter()
        .filter(|e| {
            e["reason"] == "Unhealthy"
                && pods
                    .iter()
                    .any(|p| e["involvedObject"]["name"].as_str() == Some(p.as_str()))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn recycled_pods_serve_hundreds_of_trigger_points_with_almost_no_api_writes() {
    let chain = chain_yaml(
        "op",
        "bot",
        "input",
        "pool: {warm: 2, max: 8, reuse: Recycle, maxUses: 200}",
        &[("digits", "modify", REDACT)],
    );
    let (api, stop, operator) = cluster_with(&chain, "op").await;
    let h = Harness::start_kube_with(&api, "gw-op", Duration::from_secs(90), |o| {
        o.kube.heartbeat = HEARTBEAT;
    })
    .await;
    let before = api.writes();
    for i in 0..RECYCLED_TRIGGER_POINTS {
        run_redacted(&h, i).await;
    }
    let during = api.writes().since(&before);
    let created = during.get(Verb::Create, "pods");
    let per_trigger_point = during.total() as f64 / RECYCLED_TRIGGER_POINTS as f64;
    println!("API writes while {RECYCLED_TRIGGER_POINTS} trigger points ran (Recycle):\n{during}");
    println!(
        "pods created while they ran: {created}; claims: {}; API writes per trigger point: {per_trigger_point:.3}",
        during.get(Verb::Patch, "pods")
    );
    // maxUses 200: 500 trigger points retire (and replace) a few pods, never one per trigger point,
    // and no run failed meanwhile (checked above).
    assert!(
        created <= 12,
        "{created} pods for {RECYCLED_TRIGGER_POINTS} trigger points\n{during}"
    );
    assert!(
        during.get(Verb::Delete, "pods") >= 2,
        "maxUses retired no pod\n{during}"
    );
    assert!(
        per_trigger_point < 0.5,
        "{per_trigger_point} writes per trigger point\n{during}"
    );

    // The pool full again first: a pod retired at maxUses near the end of the runs is replaced
    // (created, Ready, PoolReady back to True) before the hold, which is about held pods alone.
    // With sandboxes no longer throttled to their request, 500 runs take seconds, and the last
    // replacement used to fall into the hold (two PoolReady flips counted as held writes).
    let settled = Instant::now() + Duration::from_secs(120);
    loop {
        let pods = api.list(Resource::Pods, "default");
        let live: Vec<_> = pods
            .iter()
            .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
            .collect();
        let all_ready = live.iter().all(|p| {
            p["status"]["conditions"].as_array().is_some_and(|cs| {
                cs.iter()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True")
            })
        });
        let pool_ready = api
            .list(Resource::HookChains, "default")
            .iter()
            .filter(|c| c["metadata"]["name"] == "op")
            .any(|c| {
                c["status"]["warm"].as_u64().unwrap_or(0) >= 2
                    && c["status"]["conditions"].as_array().is_some_and(|cs| {
                        cs.iter()
                            .any(|c| c["type"] == "PoolReady" && c["status"] == "True")
                    })
            });
        if all_ready && pods.len() == live.len() && pool_ready {
            break;
        }
        assert!(
            Instant::now() < settled,
            "the pool did not settle after the runs: {live:#?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Held and idle for HOLD: attached pods are not probed (no Unhealthy event), and nothing
    // rewrites the HookChain's status meanwhile, though every held pod's claim is renewed (a pod
    // change the operator reconciles) several times. With the default heartbeat this took a
    // minute's hold to see one renewal.
    // The pods ready now; one retired at maxUses just before may be replaced meanwhile, and a new
    // pod's first probes may fail while it starts: only these pods are watched.
    let held_pods: Vec<String> = api
        .list(Resource::Pods, "default")
        .iter()
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .filter(|p| {
            p["status"]["conditions"].as_array().is_some_and(|cs| {
                cs.iter()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True")
            })
        })
        .filter_map(|p| p["metadata"]["name"].as_str().map(str::to_string))
        .collect();
    assert!(!held_pods.is_empty(), "no ready pod to watch");
    let claimed = api
        .list(Resource::Pods, "default")
        .iter()
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .filter(|p| p["metadata"]["labels"]["sluice.dev/pool"] == "claimed")
        .count() as u64;
    assert!(claimed >= 1, "the gateway holds no pod");
    let events_before = unhealthy_events(&api, &held_pods);
    let before_hold = api.writes();
    tokio::time::sleep(HOLD).await;
    let held = api.writes().since(&before_hold);
    let events_after = unhealthy_events(&api, &held_pods);
    assert_eq!(
        events_after.len(),
        events_before.len(),
        "a held pod failed probes: {events_after:#?}"
    );
    assert!(
        held.on("hookchains/status") <= 2 && held.get(Verb::Create, "pods/exec") == 0,
        "writes while pods were only held:\n{held}"
    );
    assert!(
        held.get(Verb::Patch, "pods") >= claimed,
        "the {claimed} held pods' claims were not renewed during the hold, so the operator had \
         nothing to react to:\n{held}"
    );
    run_redacted(&h, 0).await;
    h.stop_kube_and_check(&api).await;
    stop_operator(stop, operator).await;
    api.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_reuse_none_every_trigger_point_takes_a_pod_of_its_own() {
    let chain = chain_yaml(
        "op",
        "bot",
        "input",
        "pool: {warm: 2, max: 8, reuse: None}",
        &[("digits", "modify", REDACT)],
    );
    let (api, stop, operator) = cluster_with(&chain, "op").await;
    let h = Harness::start_kube(&api, "gw-op", Duration::from_secs(90)).await;
    let before = api.writes();
    for i in 0..TRIGGER_POINTS {
        run_redacted(&h, i).await;
    }
    let during = api.writes().since(&before);
    h.stop_kube_and_check(&api).await;
    stop_operator(stop, operator).await;

    let all = api.writes();
    let created = all.get(Verb::Create, "pods");
    let claims = during.get(Verb::Patch, "pods");
    println!("API writes while {TRIGGER_POINTS} trigger points ran (None):\n{during}");
    println!(
        "pods created: {created} in all ({} while the trigger points ran); API writes per trigger point: {:.1}",
        during.get(Verb::Create, "pods"),
        during.total() as f64 / TRIGGER_POINTS as f64
    );
    // Every trigger point takes a pod of its own: one claim each, and every pod it took had been
    // created by the operator.
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
