//! The leader Lease against a mock API server: acquire when free, wait while another replica holds
//! an unexpired Lease, take over an expired one, lose a race by conflict, renew, release.

mod common;

use common::{mock_client, spawn, status_error};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Api;
use serde_json::{Value, json};
use sluice_operator::leader::LeaseLock;
use std::time::Duration;

const LEASE: &str = "/apis/coordination.k8s.io/v1/namespaces/sluice-system/leases/sluice-operator";
const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/sluice-system/leases";

fn now() -> Timestamp {
    "2026-03-01T10:00:00Z".parse().unwrap()
}

fn lock(client: kube::Client) -> LeaseLock {
    LeaseLock::new(
        Api::<Lease>::namespaced(client, "sluice-system"),
        "sluice-operator",
        "operator-a",
        Duration::from_secs(15),
    )
}

fn lease(holder: &str, renewed_secs_ago: i64, transitions: i32) -> Value {
    let renewed = now() - SignedDuration::from_secs(renewed_secs_ago);
    json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "sluice-operator", "namespace": "sluice-system", "resourceVersion": "42"},
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15,
                 "acquireTime": "2026-03-01T09:00:00.000000Z",
                 "renewTime": renewed.to_string(),
                 "leaseTransitions": transitions}
    })
}

#[tokio::test]
async fn a_free_lease_is_created_and_held() {
    let (client, mut api) = mock_client();
    let task = spawn(async move { lock(client).try_acquire_or_renew(now()).await });
    let get = api.next().await;
    get.is("GET", LEASE);
    get.reply(404, status_error(404, "NotFound"));
    let create = api.next().await;
    create.is("POST", LEASES);
    assert_eq!(create.body["metadata"]["name"], "sluice-operator");
    assert_eq!(create.body["spec"]["holderIdentity"], "operator-a");
    assert_eq!(create.body["spec"]["leaseDurationSeconds"], 15);
    assert_eq!(create.body["spec"]["leaseTransitions"], 0);
    assert!(create.body["spec"]["renewTime"].is_string());
    create.echo();
    assert!(api.finish(task).await.unwrap());
}

#[tokio::test]
async fn a_lease_held_by_another_live_replica_is_left_alone() {
    let (client, mut api) = mock_client();
    let task = spawn(async move { lock(client).try_acquire_or_renew(now()).await });
    let get = api.next().await;
    get.is("GET", LEASE);
    get.reply(200, lease("operator-b", 5, 1));
    // No write follows.
    assert!(!api.finish(task).await.unwrap());
}

#[tokio::test]
async fn an_expired_lease_is_taken_over_with_its_resource_version() {
    let (client, mut api) = mock_client();
    let task = spawn(async move { lock(client).try_acquire_or_renew(now()).await });
    api.next().await.reply(200, lease("operator-b", 16, 3));
    let put = api.next().await;
    put.is("PUT", LEASE);
    assert_eq!(put.body["metadata"]["resourceVersion"], "42");
    assert_eq!(put.body["spec"]["holderIdentity"], "operator-a");
    assert_eq!(put.body["spec"]["leaseTransitions"], 4);
    let acquired: Timestamp = put.body["spec"]["acquireTime"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(acquired, now());
    put.echo();
    assert!(api.finish(task).await.unwrap());
}

#[tokio::test]
async fn losing_the_race_for_an_expired_lease_is_not_leadership() {
    let (client, mut api) = mock_client();
    let task = spawn(async move { lock(client).try_acquire_or_renew(now()).await });
    api.next().await.reply(200, lease("operator-b", 60, 3));
    let put = api.next().await;
    put.is("PUT", LEASE);
    put.reply(409, status_error(409, "Conflict"));
    assert!(!api.finish(task).await.unwrap());
}

#[tokio::test]
async fn the_holder_renews_without_a_transition() {
    let (client, mut api) = mock_client();
    let task = spawn(async move { lock(client).try_acquire_or_renew(now()).await });
    api.next().await.reply(200, lease("operator-a", 5, 2));
    let put = api.next().await;
    put.is("PUT", LEASE);
    assert_eq!(put.body["spec"]["holderIdentity"], "operator-a");
    assert_eq!(put.body["spec"]["leaseTransitions"], 2);
    let acquired: Timestamp = put.body["spec"]["acquireTime"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(
        acquired,
        "2026-03-01T09:00:00Z".parse().unwrap(),
        "acquireTime is kept"
    );
    let renewed: Timestamp = put.body["spec"]["renewTime"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(renewed, now());
    put.echo();
    assert!(api.finish(task).await.unwrap());
}

#[tokio::test]
async fn release_hands_the_lease_back() {
    let (client, mut api) = mock_client();
    let task = spawn(async move { lock(client).release().await });
    api.next().await.reply(200, lease("operator-a", 1, 2));
    let put = api.next().await;
    put.is("PUT", LEASE);
    assert!(
        put.body["spec"].get("holderIdentity").is_none(),
        "{:?}",
        put.body
    );
    assert_eq!(put.body["spec"]["leaseDurationSeconds"], 1);
    put.echo();
    api.finish(task).await.unwrap();

    // Not ours: nothing is written.
    let (client, mut api) = mock_client();
    let task = spawn(async move { lock(client).release().await });
    api.next().await.reply(200, lease("operator-b", 1, 2));
    api.finish(task).await.unwrap();
}

#[tokio::test]
async fn the_elector_publishes_leadership_and_releases_on_stop() {
    let (client, mut api) = mock_client();
    let (leader_tx, mut leader_rx) = tokio::sync::watch::channel(false);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let elector = spawn(sluice_operator::leader::run(
        lock(client),
        Duration::from_secs(3600),
        Duration::from_secs(10),
        leader_tx,
        stop_rx,
    ));
    api.next().await.reply(404, status_error(404, "NotFound"));
    api.next().await.echo();
    leader_rx.wait_for(|l| *l).await.unwrap();
    stop_tx.send_replace(true);
    // On stop: read, then hand back.
    api.next().await.reply(200, lease("operator-a", 0, 0));
    let put = api.next().await;
    put.is("PUT", LEASE);
    assert_eq!(put.body["spec"]["leaseDurationSeconds"], 1);
    put.echo();
    api.finish(elector).await;
    assert!(!*leader_rx.borrow());
}

#[tokio::test]
async fn a_renewal_time_at_the_end_of_time_does_not_crash_and_counts_from_now() {
    let (client, mut api) = mock_client();
    let task = spawn(async move { lock(client).try_acquire_or_renew(now()).await });
    let mut held = lease("operator-b", 0, 1);
    held["spec"]["renewTime"] = "9999-12-30T21:59:59.000000Z".into();
    held["spec"]["leaseDurationSeconds"] = i32::MAX.into();
    api.next().await.reply(200, held);
    // Held by a live replica as far as anyone can tell: no write.
    assert!(!api.finish(task).await.unwrap());
}

#[tokio::test]
async fn a_leader_whose_lease_calls_hang_steps_down_within_the_renew_deadline() {
    use std::time::Instant;
    let renew_every = Duration::from_millis(100);
    let renew_deadline = Duration::from_millis(400);
    let (client, mut api) = mock_client();
    let (leader_tx, mut leader_rx) = tokio::sync::watch::channel(false);
    let (_stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let started = Instant::now();
    let _elector = spawn(sluice_operator::leader::run(
        lock(client),
        renew_every,
        renew_deadline,
        leader_tx,
        stop_rx,
    ));
    api.next().await.reply(404, status_error(404, "NotFound"));
    api.next().await.echo();
    leader_rx.wait_for(|l| *l).await.unwrap();

    // From now on the API server takes every request and never answers.
    let mut hung = Vec::new();
    let stepped_down = tokio::time::timeout(Duration::from_secs(3), async {
        loop {
            tokio::select! {
                call = api.next() => {
                    call.is("GET", LEASE);
                    hung.push(call);
                }
                r = leader_rx.wait_for(|l| !*l) => {
                    r.unwrap();
                    break Instant::now();
                }
            }
        }
    })
    .await
    .expect("a leader whose Lease calls hang must step down");
    // The renewal that made it leader started after `started`; it steps down at that renewal plus
    // the renew deadline, well before the Lease (15 s here, 3 x the deadline at default) expires.
    let held = stepped_down - started;
    assert!(
        held >= renew_deadline - Duration::from_millis(50)
            && held < renew_deadline + Duration::from_millis(300),
        "stepped down after {held:?}"
    );
    // Each hung call was cut off after the renew interval and retried.
    assert!(hung.len() >= 2, "{} calls", hung.len());
}

#[test]
fn a_stepped_down_leader_stops_writing_before_the_lease_can_expire() {
    use sluice_operator::controller::LeaseTiming;
    let t = LeaseTiming::default();
    assert!(t.renew_every <= t.renew_deadline);
    assert!(
        t.renew_deadline + t.stop_grace() < t.lease_duration,
        "{t:?}: grace {:?}",
        t.stop_grace()
    );
}
