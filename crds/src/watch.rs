//! How Sluice's components watch the API server: the wait between a failed watch's tries, shared by
//! the operator's controller and the gateway's watches.

use kube::runtime::utils::Backoff;
use rand::Rng;
use std::time::Duration;

/// The first wait after a watch fails.
const WATCH_RETRY_FIRST: Duration = Duration::from_millis(500);
/// The longest wait between a failed watch's tries.
const WATCH_RETRY_MAX: Duration = Duration::from_secs(5);

/// How a failed watch waits before it tries again: from `WATCH_RETRY_FIRST`, doubling, at most
/// `WATCH_RETRY_MAX`, each wait jittered down by up to half (so replicas do not retry in step); back
/// to the first once an event arrives (`StreamBackoff` resets it).
///
/// Not kube-runtime's default (client-go's reflector: 800 ms doubling to 30 s). That one is kind to
/// an API server in trouble, but after an API server restart, where the connection is refused for a
/// while and then the resumed watch's version has expired, it left both components blind for up to
/// 30 s after the API server was back: the gateway did not serve chains applied meanwhile nor claim
/// their warm pods (runs refused although the pool was Ready), and the operator made no pool for
/// them. Both act on what they watch; a process's few watches trying every 5 s are nothing to an API
/// server, and API Priority and Fairness answers 429 if they were.
pub struct WatchBackoff {
    next: Duration,
}

impl Default for WatchBackoff {
    fn default() -> Self {
        Self {
            next: WATCH_RETRY_FIRST,
        }
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let full = self.next;
        self.next = (full * 2).min(WATCH_RETRY_MAX);
        Some(rand::rng().random_range(full / 2..=full))
    }
}

impl Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.next = WATCH_RETRY_FIRST;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_watch_waits_longer_each_time_but_never_past_the_cap() {
        let mut backoff = WatchBackoff::default();
        let waits: Vec<Duration> = (&mut backoff).take(12).collect();
        let mut full = WATCH_RETRY_FIRST;
        for wait in &waits {
            assert!(
                *wait >= full / 2 && *wait <= full,
                "{wait:?} outside {:?}..={full:?}: {waits:?}",
                full / 2
            );
            full = (full * 2).min(WATCH_RETRY_MAX);
        }
        assert!(waits.iter().all(|w| *w <= WATCH_RETRY_MAX));
        assert!(
            waits[8..].iter().all(|w| *w >= WATCH_RETRY_MAX / 2),
            "the later waits are at the cap: {waits:?}"
        );
    }

    #[test]
    fn an_event_brings_the_wait_back_to_the_first() {
        let mut backoff = WatchBackoff::default();
        for _ in 0..10 {
            backoff.next();
        }
        backoff.reset();
        let wait = backoff.next().expect("a wait");
        assert!(wait <= WATCH_RETRY_FIRST, "{wait:?} after a reset");
    }
}
