//! The gateway-wide boot scheduler: which pool boots next, and how many boots run at once. Boots for
//! claims that are waiting go before warm-up boots; chains take turns (round robin) within each
//! kind; at most `boot_concurrency` boots hold a slot at once, and warm-up boots stop at
//! `Limits::warm_sandboxes` warm sandboxes across all chains. After failed boots a pool backs off
//! (`boot_retry`).

use super::Shared;
use super::chain_pool::ChainPool;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

/// How long a pool whose boot failed waits before its next one, doubled after each further failure
/// up to `BOOT_RETRY_MAX`, so a broken runtime or chain is not hammered (and does not take boot slots
/// from chains that boot fine).
pub(super) const BOOT_RETRY: Duration = Duration::from_millis(500);
const BOOT_RETRY_MAX: Duration = Duration::from_secs(30);

/// Which kind of boot a pool is asked for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum BootFor {
    /// Claims are waiting and not enough sandboxes are coming for them.
    Claims,
    /// The pool is below its warm target.
    Warm,
}

/// Decides, gateway-wide, which pool boots next. Lock order: the scheduler's lock, then a pool's;
/// a pool never calls in while holding its own.
pub(super) struct Scheduler {
    state: Mutex<SchedulerState>,
    /// Boots at once across all pools: booting is CPU-bound, and more than the cores only slows all.
    max_running: usize,
    /// Warm sandboxes (warm, booting or recycling) across all pools, for warm-up boots.
    pub(super) max_warm: usize,
}

#[derive(Default)]
struct SchedulerState {
    running: usize,
    pools: Vec<Weak<ChainPool>>,
    /// Where the next round-robin search starts, per kind.
    next_claims: usize,
    next_warm: usize,
}

/// One of the scheduler's gateway-wide boot slots, held from a boot's start until its sandbox is up
/// (or the boot failed); released once.
pub(super) struct BootSlot {
    shared: Arc<Shared>,
    released: AtomicBool,
}

/// The wait before the next boot after `failures` failed boots in a row (at least one).
pub(super) fn boot_retry(failures: u32) -> Duration {
    BOOT_RETRY
        .saturating_mul(1 << failures.saturating_sub(1).min(16))
        .min(BOOT_RETRY_MAX)
}

// === impl Scheduler ===

impl Scheduler {
    pub(super) fn new(boot_concurrency: usize, max_warm: usize) -> Self {
        Self {
            state: Mutex::default(),
            max_running: boot_concurrency.max(1),
            max_warm,
        }
    }

    fn lock(&self) -> MutexGuard<'_, SchedulerState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn register(&self, pool: &Arc<ChainPool>) {
        self.lock().pools.push(Arc::downgrade(pool));
    }

    /// Starts as many boots as the limits allow: claims first, then warm-ups, chains in turn.
    pub(super) fn kick(&self) {
        let mut s = self.lock();
        s.pools
            .retain(|p| p.upgrade().is_some_and(|p| !p.is_closed()));
        while s.running < self.max_running {
            let pools: Vec<Arc<ChainPool>> = s.pools.iter().filter_map(Weak::upgrade).collect();
            let n = pools.len();
            if n == 0 {
                return;
            }
            let take = |from: usize, kind: BootFor| {
                (0..n)
                    .map(|i| (from + i) % n)
                    .find(|&i| pools[i].take_boot(kind))
            };
            let picked = match take(s.next_claims, BootFor::Claims) {
                Some(i) => {
                    s.next_claims = (i + 1) % n;
                    Some(i)
                }
                None => {
                    let warm: usize = pools.iter().map(|p| p.coming()).sum();
                    match (warm < self.max_warm)
                        .then(|| take(s.next_warm, BootFor::Warm))
                        .flatten()
                    {
                        Some(i) => {
                            s.next_warm = (i + 1) % n;
                            Some(i)
                        }
                        None => None,
                    }
                }
            };
            let Some(i) = picked else {
                return;
            };
            s.running += 1;
            pools[i].spawn_boot();
        }
    }

    /// A boot ended: its slot goes to the next one.
    fn finished(&self) {
        {
            let mut s = self.lock();
            s.running = s.running.saturating_sub(1);
        }
        self.kick();
    }
}

// === impl BootSlot ===

impl BootSlot {
    /// The slot `Scheduler::kick` counted for a boot it started.
    pub(super) fn taken(shared: Arc<Shared>) -> Self {
        Self {
            shared,
            released: AtomicBool::new(false),
        }
    }

    pub(super) fn release(&self) {
        if !self.released.swap(true, Ordering::SeqCst) {
            self.shared.scheduler.finished();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_boots_back_off_doubling_up_to_thirty_seconds() {
        let waits: Vec<u64> = [1, 2, 3, 4, 7, 8, 40]
            .into_iter()
            .map(|n| boot_retry(n).as_millis() as u64)
            .collect();
        assert_eq!(waits, [500, 1000, 2000, 4000, 30_000, 30_000, 30_000]);
    }
}
