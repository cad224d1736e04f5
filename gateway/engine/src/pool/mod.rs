//! Warm pools: per chain, `pool.warm` sandboxes already booted with a cell open for the chain's next
//! trigger point, never more than `pool.max` in all (warm, booting, claimed, recycling and being torn
//! down). A claim takes one for a single trigger point; claims wait in arrival order, tenants taking
//! turns where several share a pool (the platform baseline's). When the
//! trigger point ends, `reuse: Recycle` ends its cell and, if the supervisor's verdict is clean and
//! the sandbox has served fewer than `maxUses`, opens the next cell and puts it back; anything else
//! (reuse: None, a dirty verdict, a deadline kill, a broken stream, `maxUses`) retires it.
//!
//! This module holds the set of pools (`Pools`, kept in step with the registry's chains). One
//! chain's pool is `chain_pool`; the gateway-wide boot scheduler, so that no chain can starve
//! another, is `scheduler`; why a sandbox is retired is `retire`.

mod chain_pool;
mod retire;
mod scheduler;

pub use chain_pool::ClaimError;
pub(crate) use chain_pool::{ChainPool, Claimed};

use crate::chain::Chain;
use crate::limits::Limits;
use crate::metrics::{ChainLabels, Metrics, SandboxStates};
use crate::sandbox::{SandboxBackend, SandboxSpec};
use scheduler::Scheduler;
use sluice_crds::Reuse;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// How often idle sandboxes past their pool's warm target are looked for.
const SHRINK_EVERY: Duration = Duration::from_secs(5);

/// All pools of a gateway, kept in step with the registry's chains.
pub struct Pools {
    shared: Arc<Shared>,
    pools: Arc<Mutex<HashMap<PoolKey, Arc<ChainPool>>>>,
    retired: Arc<Mutex<Vec<Arc<ChainPool>>>>,
    /// Shut down: no pool is made any more, so nothing boots after the sandboxes were torn down.
    closed: std::sync::atomic::AtomicBool,
}

/// What every pool of a gateway shares.
struct Shared {
    backend: Arc<dyn SandboxBackend>,
    limits: Limits,
    metrics: Metrics,
    scheduler: Scheduler,
}

/// Identity of a pool: the chain and the sandbox shape it boots.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct PoolKey {
    chain: String,
    spec: SandboxSpec,
    warm: usize,
    max: usize,
    reuse: Reuse,
    max_uses: u32,
}

/// Warm sandboxes against the pools' targets (`Pools::warm_progress`).
#[derive(Clone, Debug, Default)]
pub struct WarmProgress {
    pub chains: usize,
    pub warm: usize,
    /// The sum of the pools' warm targets.
    pub target: usize,
    pub booting: usize,
    /// `--max-warm-sandboxes`: warm-up stops there even below the targets.
    pub cap: usize,
    /// Pools below their target, as `namespace/name warm/target`.
    pub below: Vec<String>,
}

// === impl Pools ===

impl Pools {
    pub fn new(
        backend: Arc<dyn SandboxBackend>,
        limits: Limits,
        metrics: Metrics,
        boot_concurrency: usize,
    ) -> Self {
        let shared = Arc::new(Shared {
            backend,
            scheduler: Scheduler::new(boot_concurrency, limits.warm_sandboxes),
            limits,
            metrics,
        });
        let pools: Arc<Mutex<HashMap<PoolKey, Arc<ChainPool>>>> = Arc::default();
        let retired: Arc<Mutex<Vec<Arc<ChainPool>>>> = Arc::default();
        {
            let (pools, retired) = (Arc::downgrade(&pools), Arc::downgrade(&retired));
            shared.metrics.set_sandbox_states(Box::new(move || {
                let mut all: Vec<Arc<ChainPool>> = Vec::new();
                if let Some(p) = pools.upgrade() {
                    all.extend(
                        p.lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .values()
                            .cloned(),
                    );
                }
                if let Some(r) = retired.upgrade() {
                    all.extend(r.lock().unwrap_or_else(|p| p.into_inner()).iter().cloned());
                }
                sandbox_states(&all)
            }));
        }
        // A held set that grew with demand shrinks when the demand is gone; the task ends with the
        // pools (it holds them weakly).
        let weak = Arc::downgrade(&pools);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(SHRINK_EVERY).await;
                let Some(pools) = weak.upgrade() else { return };
                let all: Vec<Arc<ChainPool>> = pools
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .values()
                    .cloned()
                    .collect();
                for pool in all {
                    pool.shrink();
                    pool.keepalive();
                }
            }
        });
        Self {
            shared,
            pools,
            retired,
            closed: std::sync::atomic::AtomicBool::new(false),
        }
    }

    pub fn backend(&self) -> &Arc<dyn SandboxBackend> {
        &self.shared.backend
    }

    fn key(&self, chain: &Chain) -> PoolKey {
        PoolKey {
            chain: chain.qualified_name(),
            spec: chain.sandbox.clone(),
            warm: chain.spec.pool.warm as usize,
            max: chain.spec.pool.max as usize,
            reuse: self.effective_reuse(chain),
            max_uses: chain.spec.pool.max_uses,
        }
    }

    /// The chain's `pool.reuse`, unless the backend cannot recycle its sandboxes yet.
    fn effective_reuse(&self, chain: &Chain) -> Reuse {
        if self.shared.backend.recycles() {
            chain.spec.pool.reuse
        } else {
            Reuse::None
        }
    }

    /// The pool for a chain, created (and filled) on first use. New cells of an existing pool are
    /// opened for this version of the chain from now on.
    pub fn pool_for(&self, chain: &Arc<Chain>) -> Arc<ChainPool> {
        let pool = self.pool_serving(chain);
        pool.set_chain(chain);
        pool
    }

    /// The pool a claim for this version of the chain takes from, created on first use. An existing
    /// pool keeps opening cells for the version it has (during a rollout, the live one); a claim for
    /// another version has its cell replaced (`ClaimedChain::claim`).
    pub(crate) fn pool_serving(&self, chain: &Arc<Chain>) -> Arc<ChainPool> {
        let key = self.key(chain);
        let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        if self.closed.load(std::sync::atomic::Ordering::SeqCst) {
            // After shutdown a late run (a task that outlived its connection) gets a pool that is
            // closed from the start: its claim is refused at once and nothing boots.
            let pool = ChainPool::new(chain, key.reuse, key.max_uses, self.shared.clone());
            pool.mark_closed();
            return Arc::new(pool);
        }
        pools
            .entry(key.clone())
            .or_insert_with(|| {
                let pool = Arc::new(ChainPool::new(
                    chain,
                    key.reuse,
                    key.max_uses,
                    self.shared.clone(),
                ));
                self.shared.scheduler.register(&pool);
                pool.backfill();
                pool
            })
            .clone()
    }

    /// Makes the pools match `live` (the version of each chain that serves by default) and
    /// `candidates` (rollouts' new versions): new chains get a filling pool, chains that are gone or
    /// whose sandbox shape changed have their pool closed (runs in flight finish on their claimed
    /// sandbox). A candidate of the same sandbox shape shares its chain's pool, whose cells stay
    /// opened for the live version.
    pub async fn sync<'a>(
        &self,
        live: impl IntoIterator<Item = &'a Arc<Chain>>,
        candidates: impl IntoIterator<Item = &'a Arc<Chain>>,
    ) {
        let mut wanted: HashMap<PoolKey, &Arc<Chain>> =
            live.into_iter().map(|c| (self.key(c), c)).collect();
        let mut own = Vec::new();
        for c in candidates {
            let key = self.key(c);
            if let std::collections::hash_map::Entry::Vacant(e) = wanted.entry(key) {
                own.push(c);
                e.insert(c);
            }
        }
        let stale: Vec<Arc<ChainPool>> = {
            let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
            let gone: Vec<PoolKey> = pools
                .keys()
                .filter(|k| !wanted.contains_key(*k))
                .cloned()
                .collect();
            gone.into_iter().filter_map(|k| pools.remove(&k)).collect()
        };
        for chain in wanted.values() {
            if own.iter().any(|c| Arc::ptr_eq(c, chain)) {
                self.pool_serving(chain);
            } else {
                self.pool_for(chain);
            }
        }
        for pool in &stale {
            pool.close().await;
        }
        let mut retired = self.retired.lock().unwrap_or_else(|p| p.into_inner());
        retired.extend(stale);
        retired.retain(|p| !p.drained());
    }

    /// Whether readiness waits for the warm targets (see `SandboxBackend::ready_needs_warm`).
    pub fn ready_needs_warm(&self) -> bool {
        self.shared.backend.ready_needs_warm()
    }

    /// Waits until every pool has its warm target, or the gateway has `Limits::warm_sandboxes` warm
    /// (or `timeout` passes). For readiness and tests.
    pub async fn wait_warm(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            // Every pool at its target, or the gateway-wide cap reached (then chains took turns).
            let all_warm = {
                let pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
                let warm: Vec<(usize, usize)> = pools
                    .values()
                    .map(|p| (p.snapshot().warm, p.warm_goal()))
                    .collect();
                warm.iter().all(|(w, target)| w >= target)
                    || warm.iter().map(|(w, _)| w).sum::<usize>() >= self.shared.scheduler.max_warm
            };
            if all_warm {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Closes every pool and waits (up to `timeout`) for all sandboxes, claimed ones included, to go.
    pub async fn shutdown(&self, timeout: Duration) {
        let all: Vec<Arc<ChainPool>> = {
            let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
            // Under the map's lock: a pool made from now on is closed (`pool_serving`).
            self.closed.store(true, std::sync::atomic::Ordering::SeqCst);
            pools.drain().map(|(_, p)| p).collect()
        };
        for p in &all {
            p.close().await;
        }
        let deadline = Instant::now() + timeout;
        let retired: Vec<Arc<ChainPool>> = self
            .retired
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
            .collect();
        while Instant::now() < deadline && !all.iter().chain(&retired).all(|p| p.drained()) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// How far the pools are from their warm targets, for the start-up and warm-up logs.
    pub fn warm_progress(&self) -> WarmProgress {
        let pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        let mut progress = WarmProgress {
            chains: pools.len(),
            cap: self.shared.scheduler.max_warm,
            ..Default::default()
        };
        for p in pools.values() {
            let now = p.snapshot();
            let target = p.warm_goal();
            progress.warm += now.warm;
            progress.target += target;
            progress.booting += now.booting;
            if now.warm < target {
                progress
                    .below
                    .push(format!("{} {}/{}", p.name, now.warm, target));
            }
        }
        progress.below.sort();
        progress
    }

    /// (warm, claimed) per chain, for status.
    pub fn sizes(&self) -> Vec<(String, usize, usize)> {
        let pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        pools
            .values()
            .map(|p| {
                let now = p.snapshot();
                (p.name.clone(), now.warm, now.claimed)
            })
            .collect()
    }
}

/// Sandboxes per chain and state across `pools` (several pools of one chain are summed: a pool
/// whose shape changed drains while its successor fills).
fn sandbox_states(pools: &[Arc<ChainPool>]) -> SandboxStates {
    let mut sums: BTreeMap<(ChainLabels, &'static str), i64> = Default::default();
    for pool in pools {
        let now = pool.snapshot();
        for (state, n) in [
            ("warm", now.warm),
            ("claimed", now.claimed),
            ("booting", now.booting),
            ("recycling", now.recycling),
            ("tearing_down", now.tearing_down),
        ] {
            *sums.entry((pool.labels.clone(), state)).or_default() += n as i64;
        }
    }
    sums.into_iter()
        .map(|((chain, state), n)| (chain, state, n))
        .collect()
}
