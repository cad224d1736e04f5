//! Rollouts in a cluster: the real operator keeps the revisions (ControllerRevisions) and
//! `status.rollout`, the real gateway serves what they say, a restarted gateway serves the live
//! revision (not the candidate in the spec), and a canary the gateway finds failing is rolled back
//! for everyone through the `sluice.dev/rollback` annotation. Against the fake API server, whose
//! pods are local runsc sandboxes.

use serde_json::{Value, json};
use sluice_crds::HookChainSpec;
use sluice_crds::rollout::revision_of;
use sluice_e2e::{Harness, chain_yaml, manifest_json, operator, text};
use sluice_fake_apiserver::{FakeApiServer, Resource};
use std::time::{Duration, Instant};

const CHAIN: &str = "bot-input";

fn tagging(tag: &str) -> String {
    format!(
        "def execute(context, settings):\n    return {{'action': 'modify', 'outgoing': context['outgoing'] + ' {tag}'}}\n"
    )
}

const FAILING: &str = "def execute(context, settings):\n    raise ValueError('broken')\n";

fn chain() -> Value {
    manifest_json(&chain_yaml(
        CHAIN,
        "bot",
        "input",
        "pool: {warm: 2, max: 4}\nfailurePolicy: Open",
        &[("tag", "modify", &tagging("v1"))],
    ))
}

/// Changes the chain as `kubectl apply` would: the spec (and annotations) change, status stays.
fn update(api: &FakeApiServer, change: impl FnOnce(&mut Value)) -> HookChainSpec {
    let mut hc = api
        .get(Resource::HookChains, "default", CHAIN)
        .expect("the chain");
    change(&mut hc);
    let spec = serde_json::from_value(hc["spec"].clone()).expect("a valid spec");
    api.apply(Resource::HookChains, hc);
    spec
}

async fn wait_for(api: &FakeApiServer, what: &str, f: impl Fn(&Value) -> bool) -> Value {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let hc = api
            .get(Resource::HookChains, "default", CHAIN)
            .expect("the chain");
        if f(&hc) {
            return hc;
        }
        assert!(Instant::now() < until, "never {what}: {:#}", hc["status"]);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A fake API server holding the chain, and the real operator (named `name`) reconciling it.
async fn with_operator(name: &str) -> (FakeApiServer, operator::Running) {
    let api = FakeApiServer::builder()
        .start()
        .await
        .expect("fake API server");
    api.apply(Resource::HookChains, chain());
    let running = operator::start(api.client(), operator::config(name, Default::default()));
    (api, running)
}

async fn run(h: &Harness, session: &str) -> String {
    let r = h
        .run_in_session("bot", "input", "hi", session)
        .await
        .expect("the run succeeds");
    text(&r).to_string()
}

/// Waits until the gateway serves `candidate` as the canary the operator's status says it is.
async fn gateway_follows(h: &Harness, candidate: &str) {
    let until = Instant::now() + Duration::from_secs(30);
    while !h
        .gateway()
        .engine
        .rollouts()
        .iter()
        .any(|r| r.candidate_revision.as_deref() == Some(candidate) && r.phase == "Progressing")
    {
        assert!(
            Instant::now() < until,
            "the gateway never followed the canary: {:?}",
            h.gateway().engine.rollouts()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs sessions until both versions have answered (the gateway follows the status after a watch
/// event); each session answers alike twice. Returns what each session got.
async fn both_versions(h: &Harness, prefix: &str, a: &str, b: &str) -> Vec<(String, String)> {
    let until = Instant::now() + Duration::from_secs(20);
    let mut seen = Vec::new();
    let mut i = 0;
    loop {
        let session = format!("{prefix}-{i}");
        let first = run(h, &session).await;
        assert_eq!(run(h, &session).await, first, "{session} changed version");
        seen.push((session, first));
        i += 1;
        let has = |x: &str| seen.iter().any(|(_, t)| t == x);
        if has(a) && has(b) {
            return seen;
        }
        assert!(
            Instant::now() < until,
            "never saw both {a:?} and {b:?} in {} sessions; the gateway's rollouts: {:?}",
            seen.len(),
            h.gateway().engine.rollouts()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_canary_in_a_cluster_survives_a_gateway_restart_and_a_failing_one_is_rolled_back_for_everyone()
 {
    // RUST_LOG=sluice_engine=debug,... shows what the gateways and the operator decided.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let (api, running) = with_operator("operator-rollout").await;
    let v1: HookChainSpec = serde_json::from_value(chain()["spec"].clone()).expect("a valid spec");
    let hc = wait_for(&api, "rolled out", |hc| {
        hc["status"]["rollout"]["phase"] == "RolledOut"
            && hc["status"]["conditions"].as_array().is_some_and(|cs| {
                cs.iter()
                    .any(|c| c["type"] == "RolledOut" && c["status"] == "True")
            })
    })
    .await;
    assert_eq!(hc["status"]["rollout"]["liveRevision"], revision_of(&v1));
    let h = Harness::start_kube(&api, "gw-1", Duration::from_secs(30)).await;
    assert!(
        h.gateway()
            .engine
            .pools()
            .wait_warm(Duration::from_secs(60))
            .await,
        "no warm pod"
    );
    assert_eq!(run(&h, "s").await, "hi v1");

    // A canary at 50 %: both revisions are kept, and sessions split, each on one side.
    let v2 = update(&api, |hc| {
        hc["spec"]["hooks"][0]["code"] = json!(tagging("v2"));
        hc["spec"]["rollout"] =
            json!({"strategy": "Canary", "steps": [50], "stepDuration": "1h", "minRuns": 3});
    });
    wait_for(&api, "progressing", |hc| {
        hc["status"]["rollout"]["phase"] == "Progressing"
            && hc["status"]["rollout"]["candidateRevision"] == revision_of(&v2)
    })
    .await;
    let revisions: Vec<String> = api
        .list(Resource::ControllerRevisions, "default")
        .iter()
        .filter(|r| r["metadata"]["labels"]["sluice.dev/hookchain"] == CHAIN)
        .map(|r| {
            r["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    assert_eq!(revisions.len(), 2, "{revisions:?}");
    // The gateway follows the status a moment later (a watch event): until then every session is
    // on the live revision.
    gateway_follows(&h, &revision_of(&v2)).await;
    let seen = both_versions(&h, "c", "hi v1", "hi v2").await;

    // A new gateway sees the candidate in the spec, and still serves the live revision to the
    // sessions that had it (its hooks from the ControllerRevision).
    h.stop_kube_and_check(&api).await;
    let h = Harness::start_kube(&api, "gw-2", Duration::from_secs(30)).await;
    gateway_follows(&h, &revision_of(&v2)).await;
    for (session, before) in seen.iter().take(6) {
        assert_eq!(
            &run(&h, session).await,
            before,
            "{session} changed version across a restart"
        );
    }

    // A failing candidate: the gateway rolls it back, the operator follows, everyone is on v1.
    let v3 = update(&api, |hc| {
        hc["spec"]["hooks"][0]["code"] = json!(FAILING);
    });
    wait_for(&api, "a failing canary", |hc| {
        hc["status"]["rollout"]["candidateRevision"] == revision_of(&v3)
    })
    .await;
    let until = Instant::now() + Duration::from_secs(60);
    let mut i = 0;
    loop {
        run(&h, &format!("f-{i}")).await;
        i += 1;
        let hc = api
            .get(Resource::HookChains, "default", CHAIN)
            .expect("the chain");
        if hc["status"]["rollout"]["phase"] == "RolledBack" {
            assert_eq!(
                hc["metadata"]["annotations"]["sluice.dev/rollback"],
                revision_of(&v3),
                "the gateway's order"
            );
            assert_eq!(hc["status"]["rollout"]["liveRevision"], revision_of(&v1));
            break;
        }
        assert!(
            Instant::now() < until,
            "never rolled back: {:#}",
            hc["status"]
        );
    }
    wait_for(&api, "the event", |_| {
        api.list(Resource::EventsV1, "default")
            .iter()
            .any(|e| e["reason"] == "RolledBack")
    })
    .await;
    for i in 0..6 {
        assert_eq!(run(&h, &format!("after-{i}")).await, "hi v1");
    }

    // Promoted by removing spec.rollout: v3's code replaced by v2's, live for everyone.
    let v2_again = update(&api, |hc| {
        hc["spec"]["hooks"][0]["code"] = json!(tagging("v2"));
        hc["spec"].as_object_mut().map(|s| s.remove("rollout"));
    });
    wait_for(&api, "promoted", |hc| {
        hc["status"]["rollout"]["phase"] == "RolledOut"
            && hc["status"]["rollout"]["liveRevision"] == revision_of(&v2_again)
    })
    .await;
    let until = Instant::now() + Duration::from_secs(30);
    while run(&h, "after-0").await != "hi v2" {
        assert!(
            Instant::now() < until,
            "the gateway never served the promoted revision"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for i in 0..6 {
        assert_eq!(run(&h, &format!("after-{i}")).await, "hi v2");
    }
    h.stop_kube_and_check(&api).await;
    operator::stop(running).await;
}

/// The gateway's requests to the chain's status (its shadow comparisons), so far.
fn status_writes(api: &FakeApiServer) -> usize {
    api.requests()
        .iter()
        .filter(|l| {
            l.client.as_deref() == Some("gateway")
                && l.method == "PATCH"
                && l.path
                    .ends_with(&format!("/namespaces/default/hookchains/{CHAIN}/status"))
        })
        .count()
}

/// A chain deleted while the gateway shadows it: the gateway stops writing its comparison into
/// the gone chain's status. (It once kept trying every period for as long as it ran, a failed
/// request and a warning per deleted chain, piling up with every chain deleted mid-shadow.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_chain_deleted_mid_shadow_is_not_written_to_again() {
    let (api, running) = with_operator("operator-shadow").await;
    wait_for(&api, "rolled out", |hc| {
        hc["status"]["rollout"]["phase"] == "RolledOut"
    })
    .await;
    let period = Duration::from_millis(200);
    let gateway_client = api.client_as("gateway");
    let h = Harness::start_kube_with(&api, "gw-shadow", Duration::from_secs(30), |opts| {
        opts.client = gateway_client;
        opts.kube.shadow_status_every = period;
    })
    .await;
    update(&api, |hc| {
        hc["spec"]["hooks"][0]["code"] = json!(tagging("v2"));
        hc["spec"]["rollout"] = json!({"strategy": "Shadow"});
    });
    let until = Instant::now() + Duration::from_secs(60);
    let mut i = 0;
    loop {
        assert_eq!(
            run(&h, &format!("s-{i}")).await,
            "hi v1",
            "the live revision answers"
        );
        i += 1;
        let hc = api
            .get(Resource::HookChains, "default", CHAIN)
            .expect("the chain");
        let compared = hc["status"]["rollout"]["shadow"]
            .as_array()
            .is_some_and(|entries| {
                entries
                    .iter()
                    .any(|e| e["gateway"] == "gw-shadow" && e["runs"].as_u64() >= Some(1))
            });
        if compared {
            break;
        }
        assert!(
            Instant::now() < until,
            "the gateway never wrote its comparison: {:#}",
            hc["status"]
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    assert!(api.delete(Resource::HookChains, "default", CHAIN).await);
    let until = Instant::now() + Duration::from_secs(60);
    while api.get(Resource::HookChains, "default", CHAIN).is_some() {
        assert!(Instant::now() < until, "the chain was never deleted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The gateway learns of the deletion from its watch and may try once more before it does.
    tokio::time::sleep(period * 5).await;
    let before = status_writes(&api);
    tokio::time::sleep(period * 15).await;
    let after = status_writes(&api);
    assert!(
        after - before <= 1,
        "the gateway wrote to the deleted chain's status {} times in {:?}",
        after - before,
        period * 15
    );
    h.stop_kube_and_check(&api).await;
    operator::stop(running).await;
}

/// The shadow entries, `(gateway, updatedAt)`, in the chain's status now.
fn shadow_entries(api: &FakeApiServer) -> Vec<(String, String)> {
    let hc = api
        .get(Resource::HookChains, "default", CHAIN)
        .expect("the chain");
    hc["status"]["rollout"]["shadow"]
        .as_array()
        .map(|entries| {
            entries
                .iter()
                .map(|e| {
                    (
                        e["gateway"].as_str().unwrap_or_default().to_string(),
                        e["updatedAt"].as_str().unwrap_or_default().to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// A gateway that stops without taking its shadow comparison away (killed, or its node lost) left
/// it in the chain's status for good, read by `kubectl get hc -o yaml` and `sluice rollout status`
/// as a live gateway's. The operator takes away an entry its gateway has not renewed within the
/// claim deadline (as a claim not renewed in that time expires), and leaves a renewed one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gone_gateways_shadow_comparison_is_taken_out_of_the_status_after_the_claim_deadline() {
    let api = FakeApiServer::builder()
        .start()
        .await
        .expect("fake API server");
    api.apply(Resource::HookChains, chain());
    let deadline = Duration::from_secs(3);
    let mut config = operator::config("operator-prune", Default::default());
    config.claim_deadline = deadline;
    let running = operator::start(api.client(), config);
    wait_for(&api, "rolled out", |hc| {
        hc["status"]["rollout"]["phase"] == "RolledOut"
    })
    .await;
    let chains: kube::Api<sluice_crds::HookChain> =
        kube::Api::namespaced(api.client_as("gateway"), "default");
    let entry = |gateway: &str| {
        json!({
            "gateway": gateway, "candidateRevision": "abc", "runs": 3, "agreed": 3,
            "actionDiffers": 0, "outputDiffers": 0, "errors": 0, "dropped": 0,
            "disagreementPercent": "0.0", "updatedAt": k8s_openapi::jiff::Timestamp::now().to_string(),
        })
    };
    chains
        .patch_status(
            CHAIN,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(
                json!({"status": {"rollout": {"shadow": [entry("gw-live"), entry("gw-killed")]}}}),
            ),
        )
        .await
        .expect("the entries written");
    let written = Instant::now();
    // gw-live renews its entry every half second; gw-killed is gone.
    let renew_live = || async {
        let entries = shadow_entries(&api);
        let live = entries
            .iter()
            .position(|(g, _)| g == "gw-live")
            .unwrap_or_else(|| panic!("the renewed entry was taken away: {entries:?}"));
        let renew = json!([
            {"op": "test", "path": format!("/status/rollout/shadow/{live}/gateway"), "value": "gw-live"},
            {"op": "replace", "path": format!("/status/rollout/shadow/{live}/updatedAt"), "value": k8s_openapi::jiff::Timestamp::now().to_string()},
        ]);
        let renew: json_patch::Patch = serde_json::from_value(renew).expect("a JSON patch");
        // A renewal may meet the operator's removal in between (a failed test): next turn.
        let _ = chains
            .patch_status(
                CHAIN,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::<()>::Json(renew),
            )
            .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        entries
    };
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let entries = renew_live().await;
        if !entries.iter().any(|(g, _)| g == "gw-killed") {
            break;
        }
        assert!(
            Instant::now() < until,
            "the gone gateway's entry stayed: {entries:?}"
        );
    }
    let after = written.elapsed();
    assert!(
        after >= deadline - Duration::from_millis(500),
        "an entry was taken away {after:?} after it was written, before the claim deadline ({deadline:?})"
    );
    // Renewed past several deadlines, the live entry stays (renew_live panics otherwise).
    let until = Instant::now() + deadline * 3;
    while Instant::now() < until {
        renew_live().await;
    }
    println!(
        "the gone gateway's entry was removed {after:?} after it was written (claim deadline {deadline:?})"
    );
    operator::stop(running).await;
}
