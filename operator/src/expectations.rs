//! Expectations: pods this operator created or deleted that its watch cache does not show yet.
//!
//! The cache lags the API server. Without this record a reconcile that runs right after a create
//! sees the old pod count and creates the same pods again (the over-create kubernetes-sigs/agent-sandbox
//! learned about). A create is settled once the cache shows the pod; a delete once the cache shows
//! the pod terminating or gone. An entry that the cache never settles (the pod was created and
//! deleted between two watch events, say) expires after `timeout`.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long an unseen create or delete is waited for before the cache is trusted again.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Default)]
struct Entry {
    creates: HashMap<String, Instant>,
    deletes: HashMap<String, Instant>,
}

/// What is still unsettled for one chain.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pending {
    pub creates: usize,
    pub deletes: HashSet<String>,
}

/// How the cache shows a pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seen {
    Absent,
    Present,
    Terminating,
}

pub struct Expectations {
    timeout: Duration,
    chains: Mutex<HashMap<String, Entry>>,
}

impl Default for Expectations {
    fn default() -> Self {
        Self::new(DEFAULT_TIMEOUT)
    }
}

impl Expectations {
    pub fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            chains: Mutex::default(),
        }
    }

    fn with<R>(&self, chain: &str, f: impl FnOnce(&mut Entry) -> R) -> R {
        // A panic while holding the lock cannot leave an Entry half-written; keep going.
        let mut map = self.chains.lock().unwrap_or_else(|e| e.into_inner());
        f(map.entry(chain.to_string()).or_default())
    }

    pub fn created(&self, chain: &str, pod: &str, now: Instant) {
        self.with(chain, |e| e.creates.insert(pod.to_string(), now));
    }

    pub fn deleted(&self, chain: &str, pod: &str, now: Instant) {
        self.with(chain, |e| e.deletes.insert(pod.to_string(), now));
    }

    /// Settles what the cache now shows and returns what is still pending.
    pub fn observe(&self, chain: &str, now: Instant, seen: impl Fn(&str) -> Seen) -> Pending {
        let timeout = self.timeout;
        self.with(chain, |e| {
            let fresh = |at: &Instant| now.saturating_duration_since(*at) < timeout;
            e.creates
                .retain(|pod, at| seen(pod) == Seen::Absent && fresh(at));
            e.deletes
                .retain(|pod, at| seen(pod) == Seen::Present && fresh(at));
            Pending {
                creates: e.creates.len(),
                deletes: e.deletes.keys().cloned().collect(),
            }
        })
    }

    /// Drops everything about a chain that is gone.
    pub fn forget(&self, chain: &str) {
        let mut map = self.chains.lock().unwrap_or_else(|e| e.into_inner());
        map.remove(chain);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_create_is_pending_until_the_cache_shows_the_pod() {
        let x = Expectations::default();
        let t0 = Instant::now();
        x.created("ns/c", "c-1", t0);
        x.created("ns/c", "c-2", t0);
        let p = x.observe("ns/c", t0, |_| Seen::Absent);
        assert_eq!(p.creates, 2);
        let p = x.observe("ns/c", t0, |n| {
            if n == "c-1" {
                Seen::Present
            } else {
                Seen::Absent
            }
        });
        assert_eq!(p.creates, 1);
        // Other chains are separate.
        assert_eq!(x.observe("ns/other", t0, |_| Seen::Absent).creates, 0);
    }

    #[test]
    fn a_delete_is_pending_until_the_cache_shows_it_terminating_or_gone() {
        let x = Expectations::default();
        let t0 = Instant::now();
        x.deleted("ns/c", "a", t0);
        x.deleted("ns/c", "b", t0);
        let p = x.observe("ns/c", t0, |_| Seen::Present);
        assert_eq!(p.deletes, HashSet::from(["a".to_string(), "b".to_string()]));
        let p = x.observe("ns/c", t0, |n| {
            if n == "a" {
                Seen::Terminating
            } else {
                Seen::Absent
            }
        });
        assert!(p.deletes.is_empty());
    }

    #[test]
    fn unseen_expectations_expire() {
        let x = Expectations::new(Duration::from_secs(60));
        let t0 = Instant::now();
        x.created("ns/c", "lost", t0);
        assert_eq!(
            x.observe("ns/c", t0 + Duration::from_secs(59), |_| Seen::Absent)
                .creates,
            1
        );
        assert_eq!(
            x.observe("ns/c", t0 + Duration::from_secs(60), |_| Seen::Absent)
                .creates,
            0
        );
        x.created("ns/c", "again", t0);
        x.forget("ns/c");
        assert_eq!(x.observe("ns/c", t0, |_| Seen::Absent).creates, 0);
    }
}
