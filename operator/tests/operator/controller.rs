//! The whole controller (watches, caches, triggers, applier) against a mock API server: a malformed
//! HookChain in the list does not stop the watch or the valid chain beside it, nothing is created
//! before the pod cache has listed, a single-namespace operator keeps the platform namespace's
//! baselines too, and a stop lets the controller return.

use crate::common;

use common::{Call, mock_client, spawn};
use serde_json::{Value, json};
use sluice_operator::controller::{self, RunConfig};
use sluice_operator::metrics::Metrics;
use sluice_operator::reconcile::build::Settings;
use std::time::Duration;

/// The operator's node watch (one, whichever namespaces it watches).
const NODES: &str = "/api/v1/nodes";

fn list(kind: &str, items: Vec<Value>) -> Value {
    json!({"apiVersion": "v1", "kind": kind, "metadata": {"resourceVersion": "100"}, "items": items})
}

fn good_chain() -> Value {
    json!({
        "apiVersion": "sluice.dev/v1alpha1", "kind": "HookChain",
        "metadata": {"name": "good", "namespace": "team-a", "uid": "uid-good", "generation": 1, "resourceVersion": "7", "finalizers": ["sluice.dev/sandboxes"]},
        "spec": {"target": "bot", "triggerPoint": "input", "pool": {"warm": 2, "max": 5},
                 "hooks": [{"name": "h", "action": "block",
                            "code": "def execute(context, settings):\n    return {'action': 'pass'}\n"}]}
    })
}

fn malformed_chain() -> Value {
    json!({
        "apiVersion": "sluice.dev/v1alpha1", "kind": "HookChain",
        "metadata": {"name": "broken", "namespace": "team-b", "uid": "uid-broken", "generation": 1, "resourceVersion": "8", "finalizers": ["sluice.dev/sandboxes"]},
        "spec": {"target": "bot", "triggerPoint": "sideways", "hooks": []}
    })
}

fn bad_capability() -> Value {
    json!({
        "apiVersion": "sluice.dev/v1alpha1", "kind": "Capability",
        "metadata": {"name": "credit.check", "namespace": "team-c", "uid": "uid-cap", "resourceVersion": "9"},
        "spec": {"endpoint": {"http": "ftp://billing"}}
    })
}

#[tokio::test]
async fn one_malformed_chain_does_not_stop_the_others_and_bad_capabilities_are_reported() {
    let (client, mut api) = mock_client();
    let config = RunConfig {
        settings: Settings::default(),
        claim_deadline: Duration::from_secs(300),
        start_deadline: Duration::from_secs(120),
        namespace: None,
        selector: None,
        platform_namespace: "sluice-system".into(),
        allowed_endpoints: Default::default(),
        identity: "operator-test".into(),
        watch_nodes: true,
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = spawn(async move {
        controller::run(client, &config, Metrics::new(), async move {
            let _ = stop_rx.await;
        })
        .await
    });

    let mut watches: Vec<Call> = Vec::new();
    let mut seen: Vec<String> = Vec::new();
    let mut created = 0;
    let mut pods_listed = false;
    let mut statuses = 0;
    let mut capability_warned = false;
    let mut capability_status = false;
    while statuses < 2 || !capability_warned || !capability_status {
        let call = api.next().await;
        let line = format!("{} {}", call.method, call.path);
        if call.query("watch") == Some("true") {
            // Watches stay open and silent.
            watches.push(call);
            continue;
        }
        seen.push(line.clone());
        match (call.method.as_str(), call.path.as_str()) {
            ("GET", "/apis/sluice.dev/v1alpha1/hookchains") => call.reply(
                200,
                list("HookChainList", vec![malformed_chain(), good_chain()]),
            ),
            ("GET", "/api/v1/pods") => {
                assert_eq!(
                    call.query("labelSelector"),
                    Some("app.kubernetes.io/managed-by=sluice-operator")
                );
                pods_listed = true;
                call.reply(200, list("PodList", vec![]))
            }
            ("GET", NODES) => call.reply(200, list("NodeList", vec![])),
            ("GET", "/apis/sluice.dev/v1alpha1/capabilities") => {
                call.reply(200, list("CapabilityList", vec![bad_capability()]))
            }
            ("POST", "/apis/events.k8s.io/v1/namespaces/team-c/events") => {
                assert_eq!(call.body["reason"], "InvalidCapability");
                assert_eq!(call.body["regarding"]["kind"], "Capability");
                let note = call.body["note"].as_str().unwrap_or_default();
                assert!(note.contains("ftp://billing"), "{note}");
                capability_warned = true;
                call.echo()
            }
            // The Capability's own status says it is unusable, and why.
            (
                "PATCH",
                "/apis/sluice.dev/v1alpha1/namespaces/team-c/capabilities/credit.check/status",
            ) => {
                assert_eq!(call.query("fieldManager"), Some("sluice-operator"));
                let conditions = &call.body["status"]["conditions"];
                assert_eq!(conditions[0]["type"], "SchemaValid");
                assert_eq!(conditions[0]["status"], "False");
                assert!(
                    conditions[0]["message"]
                        .as_str()
                        .is_some_and(|m| m.contains("ftp://billing")),
                    "{conditions}"
                );
                assert_eq!(
                    (&conditions[1]["type"], &conditions[1]["status"]),
                    (&"Ready".into(), &"False".into())
                );
                capability_status = true;
                let mut cap = bad_capability();
                cap["status"] = call.body["status"].clone();
                call.reply(200, cap)
            }
            (
                "PATCH",
                "/apis/networking.k8s.io/v1/namespaces/team-a/networkpolicies/sluice-good-deny-all",
            ) => call.echo(),
            ("POST", "/api/v1/namespaces/team-a/pods") => {
                assert!(
                    pods_listed,
                    "created a pod before the pod cache listed: {seen:?}"
                );
                created += 1;
                let mut pod = call.body.clone();
                pod["metadata"]["name"] = format!("good-{created:05}").into();
                call.reply(201, pod)
            }
            ("POST", "/apis/events.k8s.io/v1/namespaces/team-a/events")
            | ("POST", "/apis/events.k8s.io/v1/namespaces/team-b/events") => call.echo(),
            ("PATCH", "/apis/sluice.dev/v1alpha1/namespaces/team-a/hookchains/good/status") => {
                statuses += 1;
                let mut chain = good_chain();
                chain["status"] = call.body["status"].clone();
                call.reply(200, chain)
            }
            ("PATCH", "/apis/sluice.dev/v1alpha1/namespaces/team-b/hookchains/broken/status") => {
                statuses += 1;
                assert_eq!(
                    call.body["status"]["conditions"][0]["reason"],
                    "InvalidObject"
                );
                // The API server would refuse it too; the operator carries on.
                call.reply(422, common::status_error(422, "Invalid"))
            }
            _ => panic!("unexpected request {call:?} after {seen:?}"),
        }
    }
    assert_eq!(created, 2, "{seen:?}");
    assert!(
        seen.iter()
            .any(|s| s == "POST /apis/events.k8s.io/v1/namespaces/team-b/events"),
        "the malformed chain gets an Event: {seen:?}"
    );

    // Stop: the controller returns without further requests.
    stop_tx.send(()).unwrap();
    api.finish(run).await;
    drop(watches);
}

fn baseline_chain() -> Value {
    json!({
        "apiVersion": "sluice.dev/v1alpha1", "kind": "HookChain",
        "metadata": {"name": "platform-input", "namespace": "sluice-system", "uid": "uid-baseline", "generation": 1, "resourceVersion": "11", "finalizers": ["sluice.dev/sandboxes"]},
        "spec": {"enforced": true, "target": "*", "triggerPoint": "input", "pool": {"warm": 2, "max": 4},
                 "hooks": [{"name": "turn-limit", "action": "block",
                            "code": "def execute(context, settings):\n    return {'action': 'pass'}\n"}]}
    })
}

#[test]
fn the_platform_namespace_is_watched_beside_a_single_namespace_only() {
    let config = |namespace: Option<&str>| RunConfig {
        settings: Settings::default(),
        claim_deadline: Duration::from_secs(300),
        start_deadline: Duration::from_secs(120),
        namespace: namespace.map(Into::into),
        selector: None,
        platform_namespace: "sluice-system".into(),
        allowed_endpoints: Default::default(),
        identity: "operator-test".into(),
        watch_nodes: true,
    };
    assert_eq!(config(None).watched_namespaces(), vec![None]);
    assert_eq!(
        config(Some("team")).watched_namespaces(),
        vec![Some("team".to_string()), Some("sluice-system".to_string())]
    );
    assert_eq!(
        config(Some("sluice-system")).watched_namespaces(),
        vec![Some("sluice-system".to_string())]
    );
}

/// `--namespace team`: HookChains, pods and Capabilities are listed and watched in `team` and in the
/// platform namespace (never cluster-wide), and the baseline chain there gets its warm pods.
#[tokio::test]
async fn a_single_namespace_operator_keeps_the_platform_baselines_too() {
    let (client, mut api) = mock_client();
    let config = RunConfig {
        settings: Settings::default(),
        claim_deadline: Duration::from_secs(300),
        start_deadline: Duration::from_secs(120),
        namespace: Some("team".into()),
        selector: None,
        platform_namespace: "sluice-system".into(),
        allowed_endpoints: Default::default(),
        identity: "operator-test".into(),
        watch_nodes: true,
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = spawn(async move {
        controller::run(client, &config, Metrics::new(), async move {
            let _ = stop_rx.await;
        })
        .await
    });

    // Nodes once, for both namespaces' controllers (they are cluster-scoped).
    const LISTS: [&str; 7] = [
        NODES,
        "/apis/sluice.dev/v1alpha1/namespaces/team/hookchains",
        "/api/v1/namespaces/team/pods",
        "/apis/sluice.dev/v1alpha1/namespaces/team/capabilities",
        "/apis/sluice.dev/v1alpha1/namespaces/sluice-system/hookchains",
        "/api/v1/namespaces/sluice-system/pods",
        "/apis/sluice.dev/v1alpha1/namespaces/sluice-system/capabilities",
    ];
    let mut watches: Vec<Call> = Vec::new();
    let mut watched: Vec<String> = Vec::new();
    let mut listed: Vec<String> = Vec::new();
    let mut seen: Vec<String> = Vec::new();
    let mut created = 0;
    let mut status_written = false;
    while !status_written || created < 2 || watched.len() < LISTS.len() {
        let call = api.next().await;
        let line = format!("{} {}", call.method, call.path);
        if call.method == "GET" && call.query("watch") == Some("true") {
            assert!(
                LISTS.contains(&call.path.as_str()),
                "unexpected watch {call:?}"
            );
            watched.push(call.path.clone());
            watches.push(call);
            continue;
        }
        seen.push(line.clone());
        match (call.method.as_str(), call.path.as_str()) {
            ("GET", path) if LISTS.contains(&path) => {
                if path.ends_with("/pods") {
                    assert_eq!(
                        call.query("labelSelector"),
                        Some("app.kubernetes.io/managed-by=sluice-operator")
                    );
                }
                listed.push(path.to_string());
                let items = if path == LISTS[4] {
                    vec![baseline_chain()]
                } else {
                    vec![]
                };
                call.reply(200, list("List", items))
            }
            (
                "PATCH",
                "/apis/networking.k8s.io/v1/namespaces/sluice-system/networkpolicies/sluice-platform-input-deny-all",
            ) => call.echo(),
            ("POST", "/api/v1/namespaces/sluice-system/pods") => {
                assert!(
                    listed.iter().any(|p| p == LISTS[5]),
                    "created a pod before the platform pod cache listed: {seen:?}"
                );
                assert_eq!(call.body["metadata"]["namespace"], "sluice-system");
                assert_eq!(
                    call.body["metadata"]["labels"]["sluice.dev/chain"],
                    "platform-input"
                );
                created += 1;
                let mut pod = call.body.clone();
                pod["metadata"]["name"] = format!("platform-input-{created:05}").into();
                call.reply(201, pod)
            }
            ("POST", "/apis/events.k8s.io/v1/namespaces/sluice-system/events") => call.echo(),
            (
                "PATCH",
                "/apis/sluice.dev/v1alpha1/namespaces/sluice-system/hookchains/platform-input/status",
            ) => {
                status_written = true;
                let mut chain = baseline_chain();
                chain["status"] = call.body["status"].clone();
                call.reply(200, chain)
            }
            _ => panic!("unexpected request {call:?} after {seen:?}"),
        }
    }
    listed.sort();
    watched.sort();
    let mut want: Vec<String> = LISTS.iter().map(|p| p.to_string()).collect();
    want.sort();
    assert_eq!(listed, want, "each watched once, in both namespaces");
    assert_eq!(watched, want);
    assert_eq!(created, 2, "{seen:?}");

    // Stop: both namespaces' controllers return without further requests.
    stop_tx.send(()).unwrap();
    api.finish(run).await;
    drop(watches);
}

#[tokio::test]
async fn metrics_and_health_are_served() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let metrics = Metrics::new();
    metrics.pods_created.inc();
    metrics.set_pool("team-a", "good", 2, 1);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    spawn(metrics.serve_on(listener));
    let get = |path: &'static str| async move {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    };
    let body = get("/metrics").await;
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    assert!(
        body.contains("sluice_operator_pods_created_total 1"),
        "{body}"
    );
    assert!(
        body.contains("sluice_operator_pool_warm_pods{chain=\"good\",namespace=\"team-a\"} 2"),
        "{body}"
    );
    assert!(
        body.contains("sluice_operator_pool_claimed_pods{chain=\"good\",namespace=\"team-a\"} 1"),
        "{body}"
    );
    assert!(
        body.contains("sluice_operator_reconciles_total 0"),
        "{body}"
    );
    // Build and process metrics, as a platform team's dashboards expect them.
    for name in [
        "sluice_operator_build_info{version=",
        "sluice_operator_process_cpu_seconds_total",
        "sluice_operator_process_resident_memory_bytes",
    ] {
        assert!(body.contains(name), "no {name} in {body}");
    }
    assert!(get("/healthz").await.starts_with("HTTP/1.1 200"));
    assert!(get("/nope").await.starts_with("HTTP/1.1 404"));
}

fn lease(holder: &str, renewed: k8s_openapi::jiff::Timestamp) -> Value {
    json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "sluice-operator", "namespace": "sluice-system", "resourceVersion": "5"},
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15,
                 "renewTime": renewed.to_string(), "leaseTransitions": 1}
    })
}

/// Replica "operator-a" of an operator confined to team-a, and its Lease lock.
fn operator_a(client: &kube::Client) -> (sluice_operator::leader::LeaseLock, RunConfig) {
    let lock = sluice_operator::leader::LeaseLock::new(
        kube::Api::namespaced(client.clone(), "sluice-system"),
        "sluice-operator",
        "operator-a",
        Duration::from_secs(15),
    );
    let config = RunConfig {
        settings: Settings::default(),
        claim_deadline: Duration::from_secs(300),
        start_deadline: Duration::from_secs(120),
        namespace: Some("team-a".into()),
        selector: None,
        platform_namespace: "sluice-system".into(),
        allowed_endpoints: Default::default(),
        identity: "operator-a".into(),
        watch_nodes: true,
    };
    (lock, config)
}

#[tokio::test]
async fn only_the_lease_holder_reconciles() {
    use k8s_openapi::jiff::{SignedDuration, Timestamp};
    use sluice_operator::controller::LeaseTiming;
    const LEASE: &str =
        "/apis/coordination.k8s.io/v1/namespaces/sluice-system/leases/sluice-operator";

    let (client, mut api) = mock_client();
    let metrics = Metrics::new();
    let (lock, config) = operator_a(&client);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let timing = LeaseTiming {
        renew_every: Duration::from_millis(20),
        renew_deadline: Duration::from_secs(10),
        lease_duration: Duration::from_secs(15),
    };
    let task = spawn(sluice_operator::controller::run_when_leading(
        client,
        config,
        metrics.clone(),
        lock,
        timing,
        stop_rx,
    ));

    // A follower only ever asks about the Lease: the next request after a refusal is the Lease again.
    for _ in 0..3 {
        let call = api.next().await;
        call.is("GET", LEASE);
        call.reply(200, lease("operator-b", Timestamp::now()));
    }
    // The other replica stops renewing: once its record has stood still for its Lease duration (1 s
    // here) as this replica sees it, take over; then the watches start (namespaced).
    let mut stale = lease(
        "operator-b",
        Timestamp::now() - SignedDuration::from_secs(60),
    );
    stale["spec"]["leaseDurationSeconds"] = 1.into();
    let call = loop {
        let call = api.next().await;
        if call.method == "PUT" {
            break call;
        }
        call.is("GET", LEASE);
        call.reply(200, stale.clone());
    };
    call.is("PUT", LEASE);
    call.echo();
    let mut listed = Vec::new();
    let mut watches = Vec::new();
    let ours = |path: &str| {
        path.contains("/namespaces/team-a/")
            || path.contains("/namespaces/sluice-system/")
            || path == NODES
    };
    // Chains, pods and Capabilities, in team-a and in the platform namespace, and the nodes.
    while listed.len() < 7 {
        let call = api.next().await;
        match (call.method.as_str(), call.path.as_str()) {
            ("GET", LEASE) => {
                // Still ours.
                call.reply(200, lease("operator-a", Timestamp::now()))
            }
            ("PUT", LEASE) => call.echo(),
            ("GET", path) if call.query("watch") == Some("true") => {
                assert!(ours(path), "{call:?}");
                watches.push(call)
            }
            ("GET", path) => {
                assert!(ours(path), "{call:?}");
                listed.push(path.to_string());
                call.reply(200, list("List", vec![]))
            }
            _ => panic!("unexpected request {call:?}"),
        }
    }
    assert_eq!(metrics.leader.get(), 1);

    // Another replica took the Lease (say after a network partition): reconciling stops.
    loop {
        let call = api.next().await;
        match (call.method.as_str(), call.path.as_str()) {
            ("GET", LEASE) => {
                call.reply(200, lease("operator-b", Timestamp::now()));
                break;
            }
            ("PUT", LEASE) => call.echo(),
            ("GET", _) if call.query("watch") == Some("true") => watches.push(call),
            _ => panic!("unexpected request {call:?}"),
        }
    }
    // Back to following: Lease reads only, until the gauge shows the controller has returned.
    while metrics.leader.get() != 0 {
        tokio::select! {
            call = api.next() => {
                call.is("GET", LEASE);
                call.reply(200, lease("operator-b", Timestamp::now()));
            }
            _ = tokio::time::sleep(Duration::from_millis(10)) => {}
        }
    }
    // Stop: a follower has no Lease to hand back.
    stop_tx.send_replace(true);
    while let Some(call) = api.try_next().await {
        call.is("GET", LEASE);
        call.reply(200, lease("operator-b", Timestamp::now()));
    }
    task.await.unwrap();
    assert_eq!(metrics.leader.get(), 0);
    drop(watches);
}

#[tokio::test]
async fn a_leader_that_cannot_renew_abandons_a_hung_reconcile_before_the_lease_expires() {
    use k8s_openapi::jiff::Timestamp;
    use sluice_operator::controller::LeaseTiming;
    use std::time::Instant;
    const LEASE: &str =
        "/apis/coordination.k8s.io/v1/namespaces/sluice-system/leases/sluice-operator";

    let (client, mut api) = mock_client();
    let metrics = Metrics::new();
    let (lock, config) = operator_a(&client);
    // Scaled down from 5 s / 10 s / 15 s: the grace is then 250 ms.
    let timing = LeaseTiming {
        renew_every: Duration::from_millis(50),
        renew_deadline: Duration::from_millis(500),
        lease_duration: Duration::from_millis(1000),
    };
    let (_stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let task = spawn(sluice_operator::controller::run_when_leading(
        client,
        config,
        metrics.clone(),
        lock,
        timing,
        stop_rx,
    ));

    // Lead, list, and let the reconcile of `good` hang on its first write.
    let mut held: Vec<Call> = Vec::new();
    let mut last_renewal = Instant::now();
    loop {
        let call = api.next().await;
        match (call.method.as_str(), call.path.as_str()) {
            ("GET", LEASE) => call.reply(200, lease("operator-a", Timestamp::now())),
            ("PUT", LEASE) => {
                last_renewal = Instant::now();
                call.echo()
            }
            (_, path) if path.contains("/networkpolicies/") => {
                // The API server goes silent: this write, and every Lease call from now on.
                held.push(call);
                break;
            }
            ("GET", _) if call.query("watch") == Some("true") => held.push(call),
            ("GET", path) if path.contains("/namespaces/team-a/hookchains") => {
                call.reply(200, list("HookChainList", vec![good_chain()]))
            }
            ("GET", _) => call.reply(200, list("List", vec![])),
            _ => panic!("unexpected request {call:?}"),
        }
    }
    assert_eq!(metrics.leader.get(), 1);
    let returned = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            tokio::select! {
                call = api.next() => {
                    // Only Lease traffic (a read, or a renewal that was on its way when the API
                    // went silent and is never answered).
                    assert_eq!(call.path, LEASE, "{call:?}");
                    assert!(matches!(call.method.as_str(), "GET" | "PUT"), "{call:?}");
                    held.push(call);
                }
                _ = tokio::time::sleep(Duration::from_millis(5)) => {
                    if metrics.leader.get() == 0 {
                        break Instant::now();
                    }
                }
            }
        }
    })
    .await
    .expect("a leader that cannot renew must stop reconciling");
    // The renewal the Lease was last written with started before `last_renewal`: by the time
    // another replica may take the Lease, this one has stopped writing.
    let after = returned - last_renewal;
    assert!(
        after < timing.lease_duration - Duration::from_millis(100),
        "stopped {after:?} after the last renewal"
    );
    // Only Lease calls follow: no write of the abandoned reconcile.
    tokio::time::sleep(Duration::from_millis(200)).await;
    while let Ok(Some(call)) = tokio::time::timeout(Duration::from_millis(50), api.try_next()).await
    {
        assert_eq!(call.path, LEASE, "{call:?}");
        assert!(matches!(call.method.as_str(), "GET" | "PUT"), "{call:?}");
        held.push(call);
    }
    task.abort();
    drop(held);
}

/// `--namespace team --sandbox-namespace sluice-sandboxes`: chains and Capabilities are watched in
/// `team` and the platform namespace, pods in the sandbox namespace only (one watch per controller,
/// each selecting its namespace's chains by label), and the baseline's pods and policy go there.
#[tokio::test]
async fn with_a_sandbox_namespace_pods_are_watched_and_made_there_only() {
    let (client, mut api) = mock_client();
    let config = RunConfig {
        settings: Settings {
            sandbox_namespace: Some("sluice-sandboxes".into()),
            ..Settings::default()
        },
        claim_deadline: Duration::from_secs(300),
        start_deadline: Duration::from_secs(120),
        namespace: Some("team".into()),
        selector: None,
        platform_namespace: "sluice-system".into(),
        allowed_endpoints: Default::default(),
        identity: "operator-test".into(),
        watch_nodes: true,
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = spawn(async move {
        controller::run(client, &config, Metrics::new(), async move {
            let _ = stop_rx.await;
        })
        .await
    });

    const PODS: &str = "/api/v1/namespaces/sluice-sandboxes/pods";
    let selector = |ns: &str| {
        format!("app.kubernetes.io/managed-by=sluice-operator,sluice.dev/chain-namespace={ns}")
    };
    let mut watches: Vec<Call> = Vec::new();
    let mut pod_selectors: Vec<String> = Vec::new();
    let mut seen: Vec<String> = Vec::new();
    let mut created = 0;
    let mut status_written = false;
    while !status_written || created < 2 {
        let call = api.next().await;
        if call.method == "GET" && call.query("watch") == Some("true") {
            assert!(
                !call.path.ends_with("/pods") || call.path == PODS,
                "a pod watch outside the sandbox namespace: {call:?}"
            );
            watches.push(call);
            continue;
        }
        seen.push(format!("{} {}", call.method, call.path));
        match (call.method.as_str(), call.path.as_str()) {
            ("GET", PODS) => {
                pod_selectors.push(call.query("labelSelector").unwrap_or_default().to_string());
                call.reply(200, list("PodList", vec![]))
            }
            ("GET", NODES) => call.reply(200, list("NodeList", vec![])),
            ("GET", "/apis/sluice.dev/v1alpha1/namespaces/sluice-system/hookchains") => {
                call.reply(200, list("HookChainList", vec![baseline_chain()]))
            }
            ("GET", "/apis/sluice.dev/v1alpha1/namespaces/team/hookchains")
            | ("GET", "/apis/sluice.dev/v1alpha1/namespaces/team/capabilities")
            | ("GET", "/apis/sluice.dev/v1alpha1/namespaces/sluice-system/capabilities") => {
                call.reply(200, list("List", vec![]))
            }
            (
                "PATCH",
                "/apis/networking.k8s.io/v1/namespaces/sluice-sandboxes/networkpolicies/sluice-sluice-system.platform-input-deny-all",
            ) => call.echo(),
            ("POST", PODS) => {
                assert_eq!(
                    call.body["metadata"]["labels"]["sluice.dev/chain-namespace"],
                    "sluice-system"
                );
                assert!(call.body["metadata"].get("ownerReferences").is_none());
                created += 1;
                let mut pod = call.body.clone();
                pod["metadata"]["name"] =
                    format!("sluice-system-platform-input-{created:05}").into();
                call.reply(201, pod)
            }
            ("POST", "/apis/events.k8s.io/v1/namespaces/sluice-system/events") => call.echo(),
            (
                "PATCH",
                "/apis/sluice.dev/v1alpha1/namespaces/sluice-system/hookchains/platform-input/status",
            ) => {
                status_written = true;
                let mut chain = baseline_chain();
                chain["status"] = call.body["status"].clone();
                call.reply(200, chain)
            }
            _ => panic!("unexpected request {call:?} after {seen:?}"),
        }
    }
    pod_selectors.sort();
    assert_eq!(
        pod_selectors,
        [selector("sluice-system"), selector("team")],
        "one pod watch per controller, each of its namespace's chains"
    );
    stop_tx.send(()).unwrap();
    api.finish(run).await;
    drop(watches);
}
