//! The leader Lease against a mock API server: acquire when free, wait while another replica holds
//! an unexpired Lease, take over an expired one, lose a race by conflict, renew, release.
//!
//! Expiry follows client-go: a follower times another holder's Lease from when it saw the record
//! change, on its own monotonic clock (the `Instant` each attempt is given); the holder's
//! `renewTime` is never compared with the follower's wall clock. So taking a Lease over always
//! takes two reads of the same record a Lease duration apart.

use crate::common;

use common::{mock_client, spawn, status_error};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Api;
use serde_json::{Value, json};
use sluice_operator::leader::LeaseLock;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

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
    lease_version(
        holder,
        now() - SignedDuration::from_secs(renewed_secs_ago),
        "42",
        transitions,
    )
}

/// The Lease as the holder last wrote it: at `renewed` by its clock, as `resource_version`.
fn lease_version(
    holder: &str,
    renewed: Timestamp,
    resource_version: &str,
    transitions: i32,
) -> Value {
    json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "sluice-operator", "namespace": "sluice-system",
                     "resourceVersion": resource_version},
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15,
                 "acquireTime": "2026-03-01T09:00:00.000000Z",
                 "renewTime": renewed.to_string(),
                 "leaseTransitions": transitions}
    })
}

/// One attempt by `lock`, with `wall` on its wall clock and `local` on its monotonic clock.
fn attempt(
    lock: &Arc<LeaseLock>,
    wall: Timestamp,
    local: Instant,
) -> JoinHandle<Result<bool, kube::Error>> {
    let lock = lock.clone();
    spawn(async move { lock.try_acquire_or_renew(wall, local).await })
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

#[tokio::test]
async fn a_free_lease_is_created_and_held() {
    let (client, mut api) = mock_client();
    let task = attempt(&Arc::new(lock(client)), now(), Instant::now());
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
    let task = attempt(&Arc::new(lock(client)), now(), Instant::now());
    let get = api.next().await;
    get.is("GET", LEASE);
    get.reply(200, lease("operator-b", 5, 1));
    // No write follows.
    assert!(!api.finish(task).await.unwrap());
}

#[tokio::test]
async fn a_lease_seen_unchanged_for_its_duration_is_taken_over_with_its_resource_version() {
    let (client, mut api) = mock_client();
    let lock = Arc::new(lock(client));
    let t0 = Instant::now();
    // Its renewTime is 16 s old by this replica's clock, but that clock proves nothing: this is
    // the first time the record is seen.
    let task = attempt(&lock, now(), t0);
    api.next().await.reply(200, lease("operator-b", 16, 3));
    assert!(!api.finish(task).await.unwrap());
    // The same record just under a Lease duration later: still not expired.
    let task = attempt(&lock, now(), t0 + Duration::from_millis(14_900));
    api.next().await.reply(200, lease("operator-b", 16, 3));
    assert!(!api.finish(task).await.unwrap());
    // And a full Lease duration after it was first seen: taken.
    let task = attempt(&lock, now(), t0 + secs(15));
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
    let lock = Arc::new(lock(client));
    let t0 = Instant::now();
    let task = attempt(&lock, now(), t0);
    api.next().await.reply(200, lease("operator-b", 60, 3));
    assert!(!api.finish(task).await.unwrap());
    let task = attempt(&lock, now(), t0 + secs(20));
    api.next().await.reply(200, lease("operator-b", 60, 3));
    let put = api.next().await;
    put.is("PUT", LEASE);
    put.reply(409, status_error(409, "Conflict"));
    assert!(!api.finish(task).await.unwrap());
}

#[tokio::test]
async fn the_holder_renews_without_a_transition() {
    let (client, mut api) = mock_client();
    let task = attempt(&Arc::new(lock(client)), now(), Instant::now());
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
    let lock = Arc::new(lock(client));
    let t0 = Instant::now();
    let mut held = lease("operator-b", 0, 1);
    held["spec"]["renewTime"] = "9999-12-30T21:59:59.000000Z".into();
    held["spec"]["leaseDurationSeconds"] = i32::MAX.into();
    for local in [t0, t0 + secs(16), t0 + secs(3600)] {
        let task = attempt(&lock, now(), local);
        api.next().await.reply(200, held.clone());
        // Held for i32::MAX seconds from when it was first seen: no write.
        assert!(!api.finish(task).await.unwrap());
    }
}

/// client-go's semantics under clock skew: a follower whose wall clock runs an hour ahead sees every
/// renewTime of the leader as long past. It still must not take the Lease while the leader keeps
/// renewing it; it takes over only after seeing the same record for a whole Lease duration.
#[tokio::test]
async fn a_follower_whose_clock_runs_ahead_does_not_take_a_lease_being_renewed() {
    let (client, mut api) = mock_client();
    let follower = Arc::new(lock(client));
    let skew = SignedDuration::from_hours(1);
    let t0 = Instant::now();
    // The leader renews every 5 s (its clock is right); the follower looks every 5 s.
    for tick in 0..12u64 {
        let leader_renewed = now() + SignedDuration::from_secs(5 * tick as i64);
        let task = attempt(&follower, leader_renewed + skew, t0 + secs(5 * tick));
        api.next().await.reply(
            200,
            lease_version("operator-b", leader_renewed, &(100 + tick).to_string(), 1),
        );
        assert!(
            !api.finish(task).await.unwrap(),
            "tick {tick}: took a Lease the leader renewed"
        );
    }
    // The leader stops renewing: its last record (first seen at 55 s) is all the follower sees.
    let last = lease_version(
        "operator-b",
        now() + SignedDuration::from_secs(55),
        "111",
        1,
    );
    for local in [secs(60), secs(65), Duration::from_millis(69_900)] {
        let task = attempt(&follower, now() + skew, t0 + local);
        api.next().await.reply(200, last.clone());
        assert!(!api.finish(task).await.unwrap(), "took over at {local:?}");
    }
    // A Lease duration (15 s) after that record was first seen, the follower takes over.
    let task = attempt(&follower, now() + skew, t0 + secs(70));
    api.next().await.reply(200, last.clone());
    let put = api.next().await;
    put.is("PUT", LEASE);
    assert_eq!(put.body["metadata"]["resourceVersion"], "111");
    assert_eq!(put.body["spec"]["holderIdentity"], "operator-a");
    assert_eq!(put.body["spec"]["leaseTransitions"], 2);
    put.echo();
    assert!(api.finish(task).await.unwrap());
}

/// A change the follower sees restarts its timer even when renewTime does not move (a holder whose
/// clock stands still, or another writer): what counts is that the record changed.
#[tokio::test]
async fn any_change_of_the_record_restarts_the_expiry_timer() {
    let (client, mut api) = mock_client();
    let follower = Arc::new(lock(client));
    let t0 = Instant::now();
    let renewed = now() - SignedDuration::from_hours(2);
    for (local, version) in [(0, "1"), (10, "2"), (20, "3")] {
        let task = attempt(&follower, now(), t0 + secs(local));
        api.next()
            .await
            .reply(200, lease_version("operator-b", renewed, version, 1));
        assert!(!api.finish(task).await.unwrap(), "took over at {local}s");
    }
    let task = attempt(&follower, now(), t0 + secs(35));
    api.next()
        .await
        .reply(200, lease_version("operator-b", renewed, "3", 1));
    let put = api.next().await;
    put.is("PUT", LEASE);
    put.reply(409, status_error(409, "Conflict"));
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
