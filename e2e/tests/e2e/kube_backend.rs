//! The gateway's `kube` backend end to end without a cluster: a fake API server (real HTTP, list and
//! watch, resourceVersion preconditions) whose pods are real local runsc sandboxes, reached through
//! a fake exec endpoint that speaks the real websocket channel protocol (v5 and v4). The gateway
//! under test is the real one in kube mode; only the cluster around it is played.

use serde_json::Value;
use sluice_e2e::{Harness, action, chain_yaml, manifest_json, text};
use sluice_engine::SandboxBackend;
use sluice_engine::SandboxSpec;
use sluice_fake_apiserver::{ExecProtocol, FakeApiServer, Fault as Injected, Resource};
use sluice_proto::Action;
use sluice_sandbox_kube::{ExecKeepalive, KubeBackend, KubeConfig};
use std::time::Duration;

const REDACT: &str = r##"import re
def execute(context, settings):
    out = re.sub(r"\d", "#", context["outgoing"])
    if out == context["outgoing"]:
        return {"action": "pass"}
    return {"action": "modify", "outgoing": out}"##;

/// A hook that prints a lot on stdout: the stdout channel must not disturb the protocol on stderr.
const CHATTY: &str = r#"def execute(context, settings):
    for i in range(2000):
        print("noise " * 20)
    return {"action": "pass"}"#;

fn sandbox_of(yaml: &str) -> SandboxSpec {
    let hc: sluice_crds::HookChain = serde_saphyr::from_str(yaml).expect("chain YAML");
    let namespace = sluice_crds::manifest::namespace_of(&hc.metadata);
    let name = hc.metadata.name.clone().unwrap_or_default();
    sluice_engine::Chain::new(&namespace, &name, &hc.spec)
        .expect("valid chain")
        .sandbox
}

/// A fake cluster holding `chain` with `warm` pods kept warm, and a kube-mode gateway on it.
async fn cluster(protocol: ExecProtocol, chain: &str, warm: usize) -> (FakeApiServer, Harness) {
    cluster_with(protocol, chain, warm, |_| {}).await
}

/// The same, with the gateway's options changed by `tweak`.
async fn cluster_with(
    protocol: ExecProtocol,
    chain: &str,
    warm: usize,
    tweak: impl FnOnce(&mut sluice_gateway::KubeOptions),
) -> (FakeApiServer, Harness) {
    let api = FakeApiServer::start(protocol)
        .await
        .expect("fake API server");
    api.apply(Resource::HookChains, manifest_json(chain));
    if warm > 0 {
        api.keep_warm(sandbox_of(chain), warm);
    }
    let h = Harness::start_kube_with(&api, "gw-test", Duration::from_secs(30), tweak).await;
    (api, h)
}

/// The exec connection's heartbeat of the half-open tests: a ping every second, the connection
/// lost after 5 s without an answer (the default, 5 s and 15 s, is kubectl's). The gateway finds a
/// half-open connection within 6 s instead of 20.
fn quick_keepalive() -> ExecKeepalive {
    ExecKeepalive::new(Duration::from_secs(1), Duration::from_secs(5)).expect("valid heartbeat")
}

/// Pods deleted through the API (a pod deleted again while Terminating counts once, as it is
/// deleted once).
fn deletes_of_pods(api: &FakeApiServer) -> usize {
    api.requests()
        .iter()
        .filter(|r| r.method == "DELETE" && r.path.contains("/pods/"))
        .map(|r| r.path.clone())
        .collect::<std::collections::HashSet<_>>()
        .len()
}

async fn runs_and_streams_over(protocol: ExecProtocol) {
    let chain = chain_yaml(
        "redact",
        "bot",
        "output",
        // One pod per trigger point: what this test counts is a claim each.
        "streaming: {flushChars: 8, lookbackChars: 4}\npool: {warm: 1, max: 8, reuse: None}",
        &[("digits", "modify", REDACT), ("chatty", "detect", CHATTY)],
    );
    let (api, h) = cluster(protocol, &chain, 2).await;
    for i in 0..3 {
        let r = h
            .run_text("bot", "output", &format!("call 555-{i}00"))
            .await
            .expect("run");
        assert_eq!(action(&r), Action::Modify);
        assert_eq!(text(&r), "call ###-###");
        assert_eq!(r.hooks.len(), 2, "both hooks ran: {:?}", r.hooks);
        assert!(r.hooks.iter().all(|o| o.error.is_empty()), "{:?}", r.hooks);
    }
    let s = h
        .stream(
            "bot",
            "output",
            &["my number is 0".into(), "10-1234-5678, ok".into()],
        )
        .await;
    assert!(s.status.is_none(), "stream failed: {:?}", s.status);
    let final_ = s.final_.as_ref().expect("final answer");
    assert_eq!(text(final_), "my number is ###-####-####, ok");
    assert!(!s.committed().chars().any(|c| c.is_ascii_digit()));
    // Every claim was made with the precondition and every used pod was deleted afterwards.
    let claims: Vec<_> = api
        .requests()
        .into_iter()
        .filter(|r| r.method == "PATCH")
        .collect();
    assert!(claims.len() >= 4, "one claim per run and per stream path");
    for c in &claims {
        assert!(
            c.body["metadata"]["resourceVersion"].is_string(),
            "claim without precondition: {c:?}"
        );
        assert_eq!(c.body["metadata"]["labels"]["sluice.dev/pool"], "claimed");
        assert_eq!(
            c.body["metadata"]["annotations"]["sluice.dev/claimed-by"],
            "gw-test"
        );
    }
    h.stop_kube_and_check(&api).await;
    assert_eq!(deletes_of_pods(&api), claims.len());
    // Every exec used the contract's command (the attach relay) and stdin, stdout and stderr, no tty.
    for e in api.requests().iter().filter(|r| r.path.ends_with("/exec")) {
        assert!(e.query.contains("container=supervisor"), "{e:?}");
        assert!(e.query.contains("command=attach"), "{e:?}");
        assert!(e.query.contains("stdin=true"), "{e:?}");
        assert!(!e.query.contains("tty=true"), "{e:?}");
    }
    api.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn runs_and_streams_real_chains_over_exec_v5() {
    runs_and_streams_over(ExecProtocol::V5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn runs_and_streams_real_chains_over_exec_v4() {
    runs_and_streams_over(ExecProtocol::V4).await;
}

/// Lists the sandbox's processes: the second hook runs after the clean-up that follows the first.
/// What a hook finds of the sandbox's processes: in a WebAssembly cell there is no `/proc` (no
/// filesystem at all), so nothing of the supervisor, the relay or another hook.
const PROCESSES: &str = r#"import os
def execute(context, settings):
    try:
        seen = sorted(os.listdir("/proc"))
    except OSError as e:
        seen = type(e).__name__
    return {"action": "detect", "findings": {"proc": seen}}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_pods_supervisor_serves_through_the_relay_and_a_hook_sees_only_its_cell() {
    let chain = chain_yaml(
        "relay",
        "bot",
        "input",
        "",
        &[("first", "modify", REDACT), ("look", "detect", PROCESSES)],
    );
    let (api, h) = cluster(ExecProtocol::V5, &chain, 1).await;
    let r = h.run_text("bot", "input", "call 555").await.expect("run");
    assert_eq!(text(&r), "call ###");
    let seen = sluice_e2e::from_proto(r.hooks[1].findings.as_ref().expect("findings"));
    // The pod's supervisor (`--listen`, its runtime loaded before the claim) served the run through
    // the exec'd relay; the hook, in its WebAssembly cell, sees no process at all: not the
    // supervisor, not the relay, not the first hook.
    assert_eq!(seen["proc"], "FileNotFoundError", "{seen}");
    h.stop_kube_and_check(&api).await;
    api.stop().await;
}

/// Pods this gateway holds claimed (and attached) right now.
fn claimed_pods(api: &FakeApiServer) -> Vec<String> {
    api.list(Resource::Pods, "default")
        .iter()
        .filter(|p| p["metadata"]["labels"]["sluice.dev/pool"] == "claimed")
        .filter_map(|p| p["metadata"]["name"].as_str().map(str::to_string))
        .collect()
}

/// Warm (unclaimed) pods that are Ready.
fn ready_warm_pods(api: &FakeApiServer) -> usize {
    api.list(Resource::Pods, "default")
        .iter()
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

async fn a_held_pod_other_than(api: &FakeApiServer, seen: &[String]) -> String {
    for _ in 0..1200 {
        if let Some(p) = claimed_pods(api).into_iter().find(|p| !seen.contains(p)) {
            return p;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the gateway never held a pod: {:?}", claimed_pods(api));
}

/// A fake cluster keeping `warm` pods of `chain` warm, and a gateway holding one pod ahead of demand.
async fn holding_cluster(chain: &str, warm: usize) -> (FakeApiServer, Harness) {
    cluster_with(ExecProtocol::V5, chain, warm, |o| o.kube.hold = 1).await
}

/// Waits until the gateway attached to held pod `pod` (its exec open) and, a moment later, put it
/// in its pool, past `ready`, with a cell open for the next trigger point.
async fn attached_and_waiting(api: &FakeApiServer, pod: &str) {
    let exec = format!("/pods/{pod}/exec");
    for _ in 0..1200 {
        if api.requests().iter().any(|r| r.path.ends_with(&exec)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn held_pods_serve_runs_claimed_ahead_and_a_held_pod_that_dies_is_never_used() {
    let chain = chain_yaml(
        "held",
        "bot",
        "input",
        // One pod per trigger point: the held pod is deleted after the run it served.
        "pool: {warm: 2, max: 8, reuse: None}",
        &[("digits", "modify", REDACT), ("look", "detect", PROCESSES)],
    );
    let (api, h) = holding_cluster(&chain, 2).await;
    // With nothing asked yet, the gateway claims one pod and attaches to it.
    let held = a_held_pod_other_than(&api, &[]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        claimed_pods(&api),
        std::slice::from_ref(&held),
        "exactly `hold` pods held"
    );
    let r = h.run_text("bot", "input", "call 555").await.expect("run");
    assert_eq!(text(&r), "call ###");
    // The run was served by the pod held before it began: that is the one deleted after it.
    for _ in 0..200 {
        if sluice_e2e::pod_deleted(&api, "default", &held) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        sluice_e2e::pod_deleted(&api, "default", &held),
        "the held pod did not serve the run"
    );
    // The next held pod dies while it waits (evicted, its exec connection broken): the next run
    // must not get it (under failurePolicy Closed a dead sandbox would block the run).
    let next = a_held_pod_other_than(&api, std::slice::from_ref(&held)).await;
    attached_and_waiting(&api, &next).await;
    api.kill_pod("default", &next).await;
    // The death reaches the gateway within milliseconds (the exec ends); a loaded machine gets slack.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let r = h.run_text("bot", "input", "call 777").await.expect("run");
    assert_eq!(action(&r), Action::Modify, "{r:?}");
    assert_eq!(text(&r), "call ###");
    assert!(r.hooks.iter().all(|o| o.error.is_empty()), "{:?}", r.hooks);
    h.stop_kube_and_check(&api).await;
    api.stop().await;
}

/// Trigger points of a Recycle chain served by the pod the gateway holds (`--kube-hold 1`) cost
/// the API server nothing: the held pod serves them one after another over its exec stream, and
/// serving one is no reason to claim another (a claim PATCH, then a pod the operator makes, binds
/// and starts: some twenty writes, and a pod held twice over). What the cluster bench's "API writes
/// per trigger point (Recycle)" row measures, pinned here where every write is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn recycled_trigger_points_on_a_held_pod_write_nothing() {
    let chain = chain_yaml(
        "held-recycle",
        "bot",
        "input",
        "pool: {warm: 2, max: 4, reuse: Recycle}",
        &[("digits", "modify", REDACT)],
    );
    let (api, h) = holding_cluster(&chain, 2).await;
    let held = a_held_pod_other_than(&api, &[]).await;
    attached_and_waiting(&api, &held).await;
    // The pod the fake's "operator" made in place of the held one is up: the cluster is quiet.
    for _ in 0..1200 {
        if ready_warm_pods(&api) == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(ready_warm_pods(&api), 2, "the warm pool never refilled");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = api.writes();
    for i in 0..20 {
        let r = h
            .run_text("bot", "input", &format!("call 555-{i:03}"))
            .await
            .expect("run");
        assert_eq!(text(&r), "call ###-###", "{r:?}");
    }
    // A replacement claim would go out 25 ms after a run takes the held pod: give it time.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let during = api.writes().since(&before);
    println!("API writes while 20 trigger points ran on a held pod (Recycle):\n{during}");
    assert_eq!(
        during.total(),
        0,
        "writes per 20 trigger points:\n{during}\nsandboxes retired, by reason: {:?}",
        h.retirements()
    );
    assert_eq!(
        claimed_pods(&api),
        std::slice::from_ref(&held),
        "exactly `hold` pods held"
    );
    h.stop_kube_and_check(&api).await;
    api.stop().await;
}

/// A held pod's exec connection goes half-open while the pod waits (the API server's node gone
/// without a FIN or RST): nothing tells the gateway, whose reads would simply never end. The
/// gateway's keepalive notices the missing answer and replaces the pod before any run is handed
/// it; without it, the next run takes the dead sandbox and fails at its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_pod_whose_connection_went_half_open_is_replaced_before_a_run_takes_it() {
    let chain = chain_yaml(
        "halfopen",
        "bot",
        "input",
        "pool: {warm: 1, max: 4, reuse: Recycle}",
        &[("digits", "modify", REDACT)],
    );
    // The pool pings a held sandbox silent for 3 s (`Limits::keepalive`; 30 s in kube mode by
    // default, which this test waited out), over an exec connection whose own heartbeat gives up
    // after 5 s without a pong.
    let (api, h) = cluster_with(ExecProtocol::V5, &chain, 1, |o| {
        o.kube.hold = 1;
        o.kube.exec_keepalive = quick_keepalive();
        o.limits.keepalive = Some(Duration::from_secs(3));
    })
    .await;
    let held = a_held_pod_other_than(&api, &[]).await;
    // Nothing is said on its stream until a run comes.
    attached_and_waiting(&api, &held).await;
    api.half_open("default", &held);
    for _ in 0..(120 * 20) {
        if sluice_e2e::pod_deleted(&api, "default", &held) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        sluice_e2e::pod_deleted(&api, "default", &held),
        "the pod behind a half-open connection is still held"
    );
    let r = h.run_text("bot", "input", "call 777").await.expect("run");
    assert_eq!(action(&r), Action::Modify, "{r:?}");
    assert_eq!(text(&r), "call ###");
    h.stop_kube_and_check(&api).await;
    api.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_claimers_one_warm_pod_exactly_one_wins() {
    let api = FakeApiServer::start(ExecProtocol::V5)
        .await
        .expect("fake API");
    let chain = chain_yaml("race", "bot", "input", "", &[("d", "modify", REDACT)]);
    let spec = sandbox_of(&chain);
    let pod = api.add_warm_pod(&spec).await.expect("pod");
    let backend = |who: &str| {
        let mut cfg = KubeConfig::new(who);
        cfg.claim_timeout = Duration::from_millis(1500);
        KubeBackend::new(
            api.client(),
            cfg,
            sluice_engine::Metrics::new().pod_claims,
            Duration::from_secs(10),
        )
    };
    let (a, b) = (
        backend("gw-a").await.unwrap(),
        backend("gw-b").await.unwrap(),
    );
    let (ra, rb) = tokio::join!(a.start(&spec), b.start(&spec));
    let (winner, loser, won) = match (ra, rb) {
        (Ok(s), Err(e)) => (s, e, "gw-a"),
        (Err(e), Ok(s)) => (s, e, "gw-b"),
        (Ok(_), Ok(_)) => panic!("both gateways claimed the one pod"),
        (Err(a), Err(b)) => panic!("nobody claimed the pod: {a}; {b}"),
    };
    assert!(
        loser.to_string().contains("no warm pod"),
        "the loser is told why: {loser}"
    );
    let stored = api
        .get(Resource::Pods, "default", &pod)
        .expect("pod still there");
    assert_eq!(stored["metadata"]["labels"]["sluice.dev/pool"], "claimed");
    assert_eq!(
        stored["metadata"]["annotations"]["sluice.dev/claimed-by"],
        won
    );
    winner.handle.destroy(true).await;
    assert!(sluice_e2e::pod_deleted(&api, "default", &pod));
    assert!(a.live().await.is_empty() && b.live().await.is_empty());
    api.stop().await;
}

/// Waits (up to 10 s) until `done`, or panics naming `what`.
async fn until(done: impl Fn() -> bool, what: &str) {
    for _ in 0..100 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(done(), "{what}: not within 10 s");
}

/// A fake with one warm pod of a one-hook chain, and a backend claiming as `gw-a` (2 s claim timeout).
async fn one_warm_pod() -> (FakeApiServer, KubeBackend, SandboxSpec, String) {
    one_warm_pod_with(|_| {}).await
}

/// The same, with the backend's settings changed by `tweak`.
async fn one_warm_pod_with(
    tweak: impl FnOnce(&mut KubeConfig),
) -> (FakeApiServer, KubeBackend, SandboxSpec, String) {
    let api = FakeApiServer::start(ExecProtocol::V5)
        .await
        .expect("fake API");
    let chain = chain_yaml("faulty", "bot", "input", "", &[("d", "modify", REDACT)]);
    let spec = sandbox_of(&chain);
    let pod = api.add_warm_pod(&spec).await.expect("pod");
    let backend = claiming_backend_with(&api, tweak).await;
    (api, backend, spec, pod)
}

/// A backend on `api` claiming as `gw-a`, with a 2 s claim timeout.
async fn claiming_backend(api: &FakeApiServer) -> KubeBackend {
    claiming_backend_with(api, |_| {}).await
}

async fn claiming_backend_with(
    api: &FakeApiServer,
    tweak: impl FnOnce(&mut KubeConfig),
) -> KubeBackend {
    let mut cfg = KubeConfig::new("gw-a");
    cfg.claim_timeout = Duration::from_secs(2);
    tweak(&mut cfg);
    KubeBackend::new(
        api.client(),
        cfg,
        sluice_engine::Metrics::new().pod_claims,
        Duration::from_secs(10),
    )
    .await
    .expect("backend")
}

/// Far more than any claim or boot deadline here (2 s, 5 s, 20 s): a start still going then hangs
/// on the API server's say (kube's own retries follow `Retry-After` for up to 15 tries).
const HANGS: Duration = Duration::from_secs(90);

/// A claim the API server keeps answering 429 or 503 (API Priority and Fairness, a rollout; an
/// hour's `Retry-After`) ends at the claim deadline with the reason, instead of waiting an hour;
/// the pod was never taken, and once the API server answers it is claimed.
async fn a_claim_refused_with(code: u16) {
    let (api, backend, spec, pod) = one_warm_pod().await;
    api.inject(Injected::answer("PATCH", "/pods/", code).retry_after(3600));
    let started = tokio::time::timeout(HANGS, backend.start(&spec)).await;
    let e = match started {
        Err(_) => panic!("a claim under {code} was still waiting after {HANGS:?}"),
        Ok(Ok(_)) => panic!("a claim the API server refused cannot succeed"),
        Ok(Err(e)) => e.to_string(),
    };
    assert!(e.contains(&pod) && e.contains("claim"), "{e}");
    api.clear_faults();
    let stored = api.get(Resource::Pods, "default", &pod).expect("pod");
    assert_eq!(stored["metadata"]["labels"]["sluice.dev/pool"], "warm");
    let s = tokio::time::timeout(HANGS, backend.start(&spec))
        .await
        .expect("a claim with the API server back")
        .expect("the pod is claimed once the API server answers");
    s.handle.destroy(true).await;
    assert!(sluice_e2e::pod_deleted(&api, "default", &pod));
    assert!(backend.live().await.is_empty());
    api.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_under_429_ends_at_its_deadline() {
    a_claim_refused_with(429).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_under_503_ends_at_its_deadline() {
    a_claim_refused_with(503).await;
}

/// A claim while the pod watch is failing (its connection dropped and every new watch refused: the
/// API server answers lists but not watches) reads the chain's pods from the API server: a warm pod
/// made meanwhile is claimed. The cache stopped at the drop, and a claim that trusted it refused
/// runs although the pool was Ready (after an API server restart, until the watch was back). The
/// refusal is a 500: kube's client retries a 503 or 429 itself, and the watch would not fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_while_the_pod_watch_fails_finds_a_pod_made_meanwhile() {
    let api = FakeApiServer::start(ExecProtocol::V5)
        .await
        .expect("fake API");
    let chain = chain_yaml("stale", "bot", "input", "", &[("d", "modify", REDACT)]);
    let spec = sandbox_of(&chain);
    let backend = claiming_backend(&api).await;
    let pod_watches = |since: usize| {
        api.requests()[since..]
            .iter()
            .filter(|r| r.path.ends_with("/pods") && r.query.contains("watch=true"))
            .count()
    };
    // The watch is up before it is cut, and asks again (refused) after.
    until(|| pod_watches(0) > 0, "the pod watch started").await;
    let before = api.requests().len();
    api.inject(Injected::answer("GET", "/pods", 500).watches_only());
    api.restart();
    until(|| pod_watches(before) > 0, "the pod watch tried again").await;
    let pod = api.add_warm_pod(&spec).await.expect("pod");
    let s = tokio::time::timeout(HANGS, backend.start(&spec))
        .await
        .expect("a claim ends by its deadline")
        .expect("the pod made while the watch was failing is claimed");
    assert_eq!(s.id, format!("default/{pod}"));
    s.handle.destroy(true).await;
    assert!(sluice_e2e::pod_deleted(&api, "default", &pod));
    api.stop().await;
}

/// A claim PATCH that was applied but answered 504 (the API server timed out on etcd, which
/// committed anyway) is ours: the client's retry of it meets a 409, and the pod must not be lost
/// until the operator's claim deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_applied_but_answered_504_is_still_ours() {
    let (api, backend, spec, pod) = one_warm_pod().await;
    api.inject(
        Injected::answer("PATCH", "/pods/", 504)
            .after_commit()
            .times(1),
    );
    let s = tokio::time::timeout(HANGS, backend.start(&spec))
        .await
        .expect("the claim ends")
        .expect("the claim that took the pod is ours");
    let stored = api.get(Resource::Pods, "default", &pod).expect("pod");
    assert_eq!(stored["metadata"]["labels"]["sluice.dev/pool"], "claimed");
    assert_eq!(
        stored["metadata"]["annotations"]["sluice.dev/claimed-by"],
        "gw-a"
    );
    s.handle.destroy(true).await;
    assert!(sluice_e2e::pod_deleted(&api, "default", &pod));
    api.stop().await;
}

/// The exec into a claimed pod meets 503s (an API server rollout): the boot ends at its deadline
/// instead of following an hour's `Retry-After`, and the pod it claimed is given back (deleted).
/// The deadline is the backend's `exec_timeout`, 5 s here (20 s by default).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_exec_under_503_ends_at_its_deadline_and_gives_the_pod_back() {
    let (api, backend, spec, pod) =
        one_warm_pod_with(|c| c.exec_timeout = Duration::from_secs(5)).await;
    api.inject(Injected::answer("GET", "/exec", 503).retry_after(3600));
    let started = tokio::time::timeout(HANGS, backend.start(&spec)).await;
    let e = match started {
        Err(_) => panic!("an exec under 503 was still waiting after {HANGS:?}"),
        Ok(Ok(_)) => panic!("an exec the API server refused cannot succeed"),
        Ok(Err(e)) => e.to_string(),
    };
    assert!(e.contains(&pod) && e.contains("exec"), "{e}");
    assert!(sluice_e2e::pod_deleted(&api, "default", &pod));
    assert!(backend.live().await.is_empty());
    api.stop().await;
}

const SLOW: &str = r#"import time
def execute(context, settings):
    time.sleep(8)
    return {"action": "pass"}"#;

const MARK: &str = r#"def execute(context, settings):
    return {"action": "modify", "outgoing": context["outgoing"] + " [checked]"}"#;

/// Waits until some pod of the fake is claimed and returns its name.
async fn claimed_pod(api: &FakeApiServer) -> String {
    for _ in 0..600 {
        if let Some(p) = api
            .list(Resource::Pods, "default")
            .into_iter()
            .find(|p| p["metadata"]["labels"]["sluice.dev/pool"] == "claimed")
        {
            return p["metadata"]["name"].as_str().unwrap().to_string();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no pod was claimed");
}

#[derive(Clone, Copy)]
enum Fault {
    /// The pod's container dies.
    PodDies,
    /// The API server restarts: every connection, the exec's included, drops.
    ApiRestarts,
}

async fn fault_mid_run(policy: &str, fault: Fault) -> (sluice_proto::RunResponse, FakeApiServer) {
    let chain = chain_yaml(
        "dying",
        "bot",
        "input",
        &format!("failurePolicy: {policy}\ntimeoutMs: 60000"),
        &[("slow", "detect", SLOW), ("mark", "modify", MARK)],
    );
    let (api, h) = cluster(ExecProtocol::V5, &chain, 1).await;
    let run = {
        let h = &h;
        async move { h.run_text("bot", "input", "hello").await }
    };
    let kill = async {
        let pod = claimed_pod(&api).await;
        // Once the payload went in, the supervisor is inside the slow hook.
        for _ in 0..1200 {
            if api.stdin_of("default", &pod).contains("\"chunk\"") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(api.stdin_of("default", &pod).contains("\"chunk\""));
        tokio::time::sleep(Duration::from_millis(300)).await;
        match fault {
            Fault::PodDies => api.kill_pod("default", &pod).await,
            Fault::ApiRestarts => api.restart(),
        }
    };
    let (r, ()) = tokio::join!(run, kill);
    let r = r.expect("a dying pod is a failed hook, not a failed request");
    h.stop_kube_and_check(&api).await;
    (r, api)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pod_dying_mid_run_blocks_under_closed() {
    let (r, api) = fault_mid_run("Closed", Fault::PodDies).await;
    assert_eq!(action(&r), Action::Block, "{r:?}");
    assert!(
        !r.hooks[0].error.is_empty(),
        "the slow hook's error is reported: {r:?}"
    );
    api.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pod_dying_mid_run_passes_on_under_open() {
    let (r, api) = fault_mid_run("Open", Fault::PodDies).await;
    // The slow hook is retried once in a fresh pod (where it meets its death or its deadline no
    // more: the test only kills the first pod), so it either passes or fails; the rest still runs.
    let mark = r
        .hooks
        .iter()
        .find(|o| o.name == "mark")
        .expect("the next hook ran");
    assert!(mark.error.is_empty(), "{r:?}");
    assert_eq!(text(&r), "hello [checked]");
    api.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_api_server_restart_mid_run_is_a_hook_failure_and_leaves_no_pod() {
    let (r, api) = fault_mid_run("Closed", Fault::ApiRestarts).await;
    assert_eq!(action(&r), Action::Block, "{r:?}");
    assert!(!r.hooks[0].error.is_empty(), "{r:?}");
    // stop_kube_and_check (inside) found no claimed pod left: the delete went through after the
    // restart. The fake's own sandbox of that pod went with the pod.
    api.stop().await;
}

/// The exec connection of a claimed pod goes half-open in the middle of a walk (open, but nothing
/// gets through either way), under a chain deadline of a minute. The gateway's heartbeat on the
/// exec websocket finds the silence: the run ends long before its deadline, its error says the
/// connection to the sandbox was lost (not that a hook was slow), the pod is retired and deleted,
/// and the next run is served by another. Without the heartbeat the run waits out its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_connection_gone_half_open_mid_walk_is_reported_lost_and_the_pod_replaced() {
    let chain = chain_yaml(
        "halfwalk",
        "bot",
        "input",
        "failurePolicy: Closed\ntimeoutMs: 60000",
        &[("slow", "detect", SLOW), ("mark", "modify", MARK)],
    );
    let (api, h) = cluster_with(ExecProtocol::V5, &chain, 1, |o| {
        o.kube.exec_keepalive = quick_keepalive();
    })
    .await;
    let run = {
        let h = &h;
        async move {
            // Well short of the chain's minute: this heartbeat needs at most 6 s (the default 20).
            tokio::time::timeout(Duration::from_secs(45), h.run_text("bot", "input", "hello")).await
        }
    };
    let cut = async {
        let pod = claimed_pod(&api).await;
        for _ in 0..1200 {
            if api.stdin_of("default", &pod).contains("\"chunk\"") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(api.stdin_of("default", &pod).contains("\"chunk\""));
        api.half_open("default", &pod);
        pod
    };
    let (r, pod) = tokio::join!(run, cut);
    let r = r
        .expect("the run still waited on a half-open connection after 45 s")
        .expect("a lost connection is a failed hook, not a failed request");
    assert_eq!(action(&r), Action::Block, "{r:?}");
    let error = &r.hooks[0].error;
    assert!(
        error.contains("connection to the sandbox was lost") && error.contains(&pod),
        "the error says what happened: {error}"
    );
    // Retired: the pod behind the dead connection is deleted, never handed to another run.
    for _ in 0..200 {
        if sluice_e2e::pod_deleted(&api, "default", &pod) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(sluice_e2e::pod_deleted(&api, "default", &pod));
    api.clear_faults();
    let r = h.run_text("bot", "input", "hello").await.expect("run");
    assert_eq!(text(&r), "hello [checked]", "{r:?}");
    assert!(r.hooks.iter().all(|o| o.error.is_empty()), "{:?}", r.hooks);
    h.stop_kube_and_check(&api).await;
    api.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_registry_follows_the_cluster_and_survives_a_malformed_object() {
    let chain = chain_yaml("marker", "bot", "input", "", &[("mark", "modify", MARK)]);
    let (api, h) = cluster(ExecProtocol::V5, &chain, 2).await;
    // An object the API server would hold but that is not a valid HookChain for us.
    let mut bad = manifest_json(&chain_yaml("broken", "other", "input", "", &[]));
    bad["spec"]["hooks"] = Value::String("not a list".into());
    api.apply(Resource::HookChains, bad);
    let r = h.run_text("bot", "input", "hi").await.expect("run");
    assert_eq!(text(&r), "hi [checked]");
    // New code, same pool: the next run uses it; no pod template changed, so nothing else does.
    let updated = chain.replace("[checked]", "[checked v2]");
    api.apply(Resource::HookChains, manifest_json(&updated));
    let mut seen = String::new();
    for _ in 0..100 {
        let r = h.run_text("bot", "input", "hi").await.expect("run");
        seen = text(&r).to_string();
        if seen == "hi [checked v2]" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(seen, "hi [checked v2]");
    // The malformed chain is simply not served.
    let e = h.run_text("other", "input", "hi").await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
    h.stop_kube_and_check(&api).await;
    // The only pods that went are those runs used: nothing was rolled for a code change.
    let claims = api
        .requests()
        .iter()
        .filter(|r| r.method == "PATCH")
        .count();
    assert_eq!(deletes_of_pods(&api), claims);
    api.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_warm_pod_in_time_is_unavailable() {
    let chain = chain_yaml("cold", "bot", "input", "", &[("mark", "modify", MARK)]);
    let api = FakeApiServer::start(ExecProtocol::V5)
        .await
        .expect("fake API");
    api.apply(Resource::HookChains, manifest_json(&chain));
    let h = Harness::start_kube(&api, "gw-test", Duration::from_millis(700)).await;
    let e = h.run_text("bot", "input", "hi").await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    assert!(e.message().contains("no warm pod"), "{}", e.message());
    h.stop_kube_and_check(&api).await;
    api.stop().await;
}

const PLATFORM_BASELINE: &str = r#"apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: platform-input, namespace: sluice-system}
spec:
  enforced: true
  target: "*"
  triggerPoint: input
  pool: {warm: 1, max: 8}
  hooks:
    - name: stamp
      action: modify
      code: |
        def execute(context, settings):
            # Idempotent, as baseline rewrites must be: the baseline may see its own output again.
            if "[platform]" in context["outgoing"]:
                return {"action": "pass"}
            return {"action": "modify", "outgoing": context["outgoing"] + " [platform]"}
"#;

/// A gateway confined to one namespace still serves the platform's baseline: it watches the
/// platform namespace's chains and pods too, and claims the baseline's pod there.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_namespaced_gateway_still_runs_the_platform_baseline() {
    let api = FakeApiServer::start(ExecProtocol::V5)
        .await
        .expect("fake API");
    let tenant = chain_yaml("marker", "bot", "input", "", &[("mark", "modify", MARK)]);
    api.apply(Resource::HookChains, manifest_json(&tenant));
    api.apply(Resource::HookChains, manifest_json(PLATFORM_BASELINE));
    api.keep_warm(sandbox_of(&tenant), 1);
    api.keep_warm(sandbox_of(PLATFORM_BASELINE), 1);
    let h = Harness::start_kube_with(&api, "gw-test", Duration::from_secs(30), |o| {
        o.kube.namespaces = vec!["default".into()];
    })
    .await;
    let r = h.run_text("bot", "input", "hi").await.expect("run");
    assert_eq!(text(&r), "hi [platform] [checked]");
    let names: Vec<&str> = r.hooks.iter().map(|o| o.name.as_str()).collect();
    assert_eq!(names, ["baseline/stamp", "mark"]);
    // The baseline's pod was claimed (and deleted) in the platform namespace.
    assert!(
        api.requests()
            .iter()
            .any(|q| q.method == "PATCH" && q.path.contains("/namespaces/sluice-system/pods/")),
        "no claim in the platform namespace"
    );
    h.stop_kube_and_check(&api).await;
    api.stop().await;
}

/// Waits until the gateway's registry has `n` chains served from an older generation.
async fn until_superseded(h: &Harness, n: i64) {
    let gauge = &h.gateway().engine.metrics().chains_superseded;
    for _ in 0..400 {
        if gauge.get() == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "the registry never had {n} superseded chain(s): {}",
        gauge.get()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_broken_generation_keeps_the_previous_one_serving() {
    let chain = chain_yaml("marker", "bot", "input", "", &[("mark", "modify", MARK)]);
    let (api, h) = cluster(ExecProtocol::V5, &chain, 2).await;
    assert_eq!(
        text(&h.run_text("bot", "input", "hi").await.expect("run")),
        "hi [checked]"
    );

    // Generation 2: a syntax error. Generation 1 keeps answering, and its runs say why.
    let broken = chain
        .replace("[checked]", "[checked v2]")
        .replace("return {", "return {{");
    api.apply(Resource::HookChains, manifest_json(&broken));
    until_superseded(&h, 1).await;
    let r = h.run_text("bot", "input", "hi").await.expect("run");
    assert_eq!(text(&r), "hi [checked]");
    assert!(r.hooks.iter().all(|o| o.error.is_empty()), "{r:?}");
    let audit = h.audit();
    let note = audit.last().expect("an audit line")["superseded"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        note.contains("serving generation 1") && note.contains("generation 2 fails"),
        "{note}"
    );
    assert_eq!(
        h.gateway().engine.metrics().definitions_invalid.get(),
        1,
        "the broken generation is counted"
    );

    // Generation 3: an action the hook does not declare. Still generation 1.
    let undeclared = chain.replace("\"modify\", \"outgoing\"", "\"block\", \"message\"");
    api.apply(Resource::HookChains, manifest_json(&undeclared));
    let mut said = None;
    for _ in 0..400 {
        let errors = h.gateway().engine.registry().errors().to_vec();
        if let Some(e) = errors.iter().find(|e| e.message.contains("generation 3")) {
            said = Some(e.to_string());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let said = said.expect("generation 3 was judged");
    assert!(
        said.contains("declares") && said.contains("generation 1 keeps serving"),
        "{said}"
    );
    assert_eq!(
        text(&h.run_text("bot", "input", "hi").await.expect("run")),
        "hi [checked]"
    );

    // Generation 4 is valid: it serves, and its runs are not marked.
    let fixed = chain.replace("[checked]", "[checked v4]");
    api.apply(Resource::HookChains, manifest_json(&fixed));
    until_superseded(&h, 0).await;
    assert_eq!(
        text(&h.run_text("bot", "input", "hi").await.expect("run")),
        "hi [checked v4]"
    );
    assert!(
        h.audit()
            .last()
            .expect("an audit line")
            .get("superseded")
            .is_none()
    );
    h.stop_kube_and_check(&api).await;
    api.stop().await;
}
