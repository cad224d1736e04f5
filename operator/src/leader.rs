//! Leader election on a `coordination.k8s.io/v1` Lease, so two operator replicas can run and only
//! one reconciles. kube 5 has no elector; this is the client-go algorithm reduced to what Sluice
//! needs: every write is a PUT carrying the Lease's `resourceVersion`, so of two replicas racing
//! for a free or expired Lease exactly one wins and the other gets a conflict.
//!
//! Expiry is client-go's: a follower times another holder's Lease from when *it* saw the record
//! change (holder, renewTime, resourceVersion...), on its own monotonic clock, and takes over only
//! after seeing no change for the Lease's duration. The holder's `renewTime` is never compared with
//! the local wall clock, so a follower whose clock runs ahead cannot take a Lease that is being
//! renewed. Why not a crate: the kube lease crates that exist (kube-lease-manager, the only one on
//! kube 5; kube-leader-election; kubert's lease) all compute expiry as `renewTime + duration`
//! against the local wall clock, which is the bug this module avoids.
//!
//! Timing: every Lease call is cut off after `renew_every` (kube's own timeout is minutes), and a
//! leader whose last successful renewal started `renew_deadline` ago steps down on a timer, whatever
//! its calls are doing. The controller then stops writing within `LeaseTiming::stop_grace`, which
//! ends before `LEASE_DURATION` has passed since that renewal: two leaders never write at once.

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How long a Lease stays valid after its last renewal.
pub const LEASE_DURATION: Duration = Duration::from_secs(15);
/// How often the leader renews (and a follower retries).
pub const RENEW_EVERY: Duration = Duration::from_secs(5);
/// A leader that could not renew for this long steps down before anyone else may take over.
pub const RENEW_DEADLINE: Duration = Duration::from_secs(10);

pub struct LeaseLock {
    api: Api<Lease>,
    name: String,
    identity: String,
    duration: Duration,
    /// The last Lease record this replica read or wrote, and when (monotonic) it first saw it.
    observed: Mutex<Option<(Record, Instant)>>,
}

/// What identifies one version of the Lease's record: any change restarts the expiry timer.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Record {
    resource_version: Option<String>,
    holder: Option<String>,
    renew_time: Option<Timestamp>,
    acquire_time: Option<Timestamp>,
    duration_seconds: Option<i32>,
    transitions: Option<i32>,
}

impl Record {
    fn of(lease: &Lease) -> Self {
        let spec = lease.spec.as_ref();
        Self {
            resource_version: lease.metadata.resource_version.clone(),
            holder: spec.and_then(|s| s.holder_identity.clone()),
            renew_time: spec.and_then(|s| s.renew_time.as_ref().map(|t| t.0)),
            acquire_time: spec.and_then(|s| s.acquire_time.as_ref().map(|t| t.0)),
            duration_seconds: spec.and_then(|s| s.lease_duration_seconds),
            transitions: spec.and_then(|s| s.lease_transitions),
        }
    }
}

fn conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

impl LeaseLock {
    pub fn new(api: Api<Lease>, name: &str, identity: &str, duration: Duration) -> Self {
        Self {
            api,
            name: name.into(),
            identity: identity.into(),
            duration,
            observed: Mutex::new(None),
        }
    }

    /// Records `lease` as seen at `at`, unless it is the record already seen: then returns when
    /// that record was first seen.
    fn observe(&self, lease: &Lease, at: Instant) -> Instant {
        let record = Record::of(lease);
        let mut observed = self.observed.lock().unwrap_or_else(|e| e.into_inner());
        match &*observed {
            Some((seen, since)) if *seen == record => *since,
            _ => {
                *observed = Some((record, at));
                at
            }
        }
    }

    pub fn identity(&self) -> &str {
        &self.identity
    }

    fn seconds(&self) -> i32 {
        i32::try_from(self.duration.as_secs()).unwrap_or(i32::MAX)
    }

    /// Takes the Lease if it is free or expired, renews it if this replica holds it. True when
    /// this replica holds the Lease afterwards.
    ///
    /// `now` is the wall-clock time written into the Lease (`renewTime`, `acquireTime`); `local` is
    /// this process's monotonic time, the only clock expiry is measured on: another replica's
    /// Lease has expired when this replica has seen the same record since `local - duration`.
    pub async fn try_acquire_or_renew(
        &self,
        now: Timestamp,
        local: Instant,
    ) -> Result<bool, kube::Error> {
        let pp = PostParams::default();
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.identity.clone()),
                    lease_duration_seconds: Some(self.seconds()),
                    acquire_time: Some(MicroTime(now)),
                    renew_time: Some(MicroTime(now)),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            return match self.api.create(&pp, &lease).await {
                Ok(written) => {
                    self.observe(&written, local);
                    Ok(true)
                }
                Err(e) if conflict(&e) => Ok(false),
                Err(e) => Err(e),
            };
        };
        let seen_since = self.observe(&lease, local);
        let mut spec = lease.spec.take().unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        if holder.as_deref() == Some(self.identity.as_str()) {
            spec.renew_time = Some(MicroTime(now));
            spec.lease_duration_seconds = Some(self.seconds());
        } else {
            let duration = spec.lease_duration_seconds.map_or(self.duration, |s| {
                Duration::from_secs(u64::try_from(s).unwrap_or(0))
            });
            // An expiry past the end of the monotonic clock never comes (no overflow panic).
            let expired = seen_since
                .checked_add(duration)
                .is_some_and(|expiry| expiry <= local);
            if holder.is_some() && !expired {
                return Ok(false);
            }
            spec.holder_identity = Some(self.identity.clone());
            spec.lease_duration_seconds = Some(self.seconds());
            spec.acquire_time = Some(MicroTime(now));
            spec.renew_time = Some(MicroTime(now));
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        lease.spec = Some(spec);
        // The resourceVersion read above travels in metadata: a concurrent writer makes this a 409.
        match self.api.replace(&self.name, &pp, &lease).await {
            Ok(written) => {
                self.observe(&written, local);
                Ok(true)
            }
            Err(e) if conflict(&e) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Hands the Lease back so a standby replica takes over at once instead of after expiry.
    pub async fn release(&self) -> Result<(), kube::Error> {
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            return Ok(());
        };
        let mut spec = lease.spec.take().unwrap_or_default();
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        lease.spec = Some(spec);
        match self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if conflict(&e) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// Keeps trying to hold the Lease until `stop` turns true, publishing leadership on `leader`.
/// On stop it releases the Lease if held.
///
/// Each attempt is cut off after `renew_every` (at most `renew_deadline`); while leading, a timer
/// steps down once the last successful renewal started `renew_deadline` ago, even while a call
/// hangs.
pub async fn run(
    lock: LeaseLock,
    renew_every: Duration,
    renew_deadline: Duration,
    leader: watch::Sender<bool>,
    mut stop: watch::Receiver<bool>,
) {
    let call_timeout = renew_every.min(renew_deadline);
    // When the last successful renewal started: no replica can have seen it earlier, so none
    // times our Lease out before this plus the Lease duration.
    let mut last_renewed: Option<Instant> = None;
    let step_down_at = |last: Option<Instant>| {
        let at = last.map(|t| t + renew_deadline);
        async move {
            match at {
                Some(at) => tokio::time::sleep_until(at.into()).await,
                None => std::future::pending().await,
            }
        }
    };
    let step_down = |leader: &watch::Sender<bool>, last: &mut Option<Instant>| {
        *last = None;
        if *leader.borrow() {
            tracing::warn!("could not renew the lease in time; stepping down");
            leader.send_replace(false);
        }
    };
    loop {
        let started = Instant::now();
        let attempt = tokio::time::timeout(
            call_timeout,
            lock.try_acquire_or_renew(Timestamp::now(), started),
        );
        let result = tokio::select! {
            r = attempt => Some(r),
            _ = step_down_at(last_renewed) => None,
        };
        match result {
            None => step_down(&leader, &mut last_renewed),
            Some(Ok(Ok(true))) => {
                last_renewed = Some(started);
                if !*leader.borrow() {
                    tracing::info!(identity = lock.identity(), "became leader");
                }
                leader.send_replace(true);
            }
            Some(Ok(Ok(false))) => {
                if *leader.borrow() {
                    tracing::warn!(
                        identity = lock.identity(),
                        "lost the lease to another replica"
                    );
                }
                last_renewed = None;
                leader.send_replace(false);
            }
            Some(Ok(Err(e))) => tracing::warn!(error = %e, "cannot reach the leader lease"),
            Some(Err(_)) => tracing::warn!(
                timeout_ms = call_timeout.as_millis() as u64,
                "the leader lease call did not answer in time"
            ),
        }
        if last_renewed.is_some_and(|t| t.elapsed() >= renew_deadline) {
            step_down(&leader, &mut last_renewed);
        }
        tokio::select! {
            _ = tokio::time::sleep(renew_every) => {}
            _ = step_down_at(last_renewed) => step_down(&leader, &mut last_renewed),
            _ = stop.wait_for(|s| *s) => break,
        }
    }
    if *leader.borrow() {
        leader.send_replace(false);
        match tokio::time::timeout(call_timeout, lock.release()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "cannot release the leader lease"),
            Err(_) => tracing::warn!("releasing the leader lease did not answer in time"),
        }
    }
}
