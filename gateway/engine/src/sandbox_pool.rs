//! Warm pools: per chain, `pool.warm` sandboxes already booted with a cell open for the chain's next
//! trigger point, never more than `pool.max` in all (warm, booting, claimed, recycling and being torn
//! down). A claim takes one for a single trigger point; claims wait in arrival order, tenants taking
//! turns where several share a pool (the platform baseline's). When the
//! trigger point ends, `reuse: Recycle` ends its cell and, if the supervisor's verdict is clean and
//! the sandbox has served fewer than `maxUses`, opens the next cell and puts it back; anything else
//! (reuse: None, a dirty verdict, a deadline kill, a broken stream, `maxUses`) retires it.
//!
//! Boots are scheduled gateway-wide (`Scheduler`), so no chain can starve another: at most
//! `boot_concurrency` at once (a boot holds its slot until the sandbox is up, not while the chain's
//! module code runs in its first cell); boots for claims that are waiting go before warm-up boots; chains
//! take turns (round robin) within each kind; and warm-up boots stop at `Limits::warm_sandboxes`
//! warm sandboxes across all chains.

use crate::chain::Chain;
use crate::limits::Limits;
use crate::log_text::Escaped;
use crate::metrics::{ChainLabels, Metrics};
use crate::sandbox::{SandboxBackend, SandboxSpec};
use crate::supervisor::CellEnd;
use crate::supervisor::SupervisorConn;
use sluice_crds::Reuse;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// How long after a claim the replacement boot starts.
const BACKFILL_DELAY: Duration = Duration::from_millis(25);
/// How long a pool whose boot failed waits before its next one, doubled after each further failure
/// up to `BOOT_RETRY_MAX`, so a broken runtime or chain is not hammered (and does not take boot slots
/// from chains that boot fine).
const BOOT_RETRY: Duration = Duration::from_millis(500);
const BOOT_RETRY_MAX: Duration = Duration::from_secs(30);
/// Beyond the chain's deadline, what opening a cell may take (instances made, acks sent).
const PREPARE_MARGIN: Duration = Duration::from_secs(5);

/// The wait before the next boot after `failures` failed boots in a row (at least one).
fn boot_retry(failures: u32) -> Duration {
    BOOT_RETRY
        .saturating_mul(1 << failures.saturating_sub(1).min(16))
        .min(BOOT_RETRY_MAX)
}

#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error("no sandbox for chain {chain} within {waited_ms} ms ({detail})")]
    Timeout {
        chain: String,
        waited_ms: u64,
        detail: String,
    },
}

#[derive(Default)]
struct Counts {
    warm: VecDeque<SupervisorConn>,
    booting: usize,
    claimed: usize,
    /// Released sandboxes whose cell is being ended and the next one opened.
    recycling: usize,
    /// Warm sandboxes taken out for a keepalive `ping`.
    probing: usize,
    tearing_down: usize,
    last_error: Option<String>,
    /// Tickets of claims waiting, oldest first, with the tenant each claims for.
    waiting: std::collections::BTreeMap<u64, Arc<str>>,
    next_ticket: u64,
    /// Per tenant with claims held or waiting: how many it holds, and when it was last served.
    tenants: HashMap<Arc<str>, TenantUse>,
    served: u64,
    /// When the last boot failed.
    failed_at: Option<Instant>,
    /// Boots that failed in a row (reset by one that succeeds).
    failed_boots: u32,
}

/// One tenant's use of a pool.
#[derive(Default)]
struct TenantUse {
    held: usize,
    last_served: u64,
}

impl Counts {
    /// The ticket served next: the oldest of the tenant that holds the fewest of this pool's
    /// sandboxes, least recently served among equals. One tenant alone is served in arrival order;
    /// several take turns, so a tenant that floods a shared pool (the platform baseline's, which
    /// every tenant's runs go through) cannot queue the others out of it.
    fn next_in_line(&self) -> Option<u64> {
        let mut best: Option<((usize, u64), u64)> = None;
        for (&ticket, tenant) in &self.waiting {
            let key = self
                .tenants
                .get(tenant)
                .map_or((0, 0), |t| (t.held, t.last_served));
            if best.is_none_or(|(k, _)| key < k) {
                best = Some((key, ticket));
            }
        }
        best.map(|(_, ticket)| ticket)
    }

    fn served(&mut self, ticket: u64) {
        if let Some(tenant) = self.waiting.remove(&ticket) {
            self.served += 1;
            let t = self.tenants.entry(tenant).or_default();
            t.held += 1;
            t.last_served = self.served;
        }
    }

    /// A tenant's claim ended; its entry goes once it holds and waits for nothing.
    fn handed_back(&mut self, tenant: &Arc<str>) {
        if let Some(t) = self.tenants.get_mut(tenant) {
            t.held = t.held.saturating_sub(1);
        }
        self.forget_if_idle(tenant);
    }

    fn forget_if_idle(&mut self, tenant: &Arc<str>) {
        let idle = self.tenants.get(tenant).is_some_and(|t| t.held == 0)
            && !self.waiting.values().any(|w| w == tenant);
        if idle {
            self.tenants.remove(tenant);
        }
    }

    fn total(&self) -> usize {
        self.warm.len()
            + self.booting
            + self.claimed
            + self.recycling
            + self.probing
            + self.tearing_down
    }

    /// Sandboxes that are or will soon be waiting for a claim.
    fn coming(&self) -> usize {
        self.warm.len() + self.booting + self.recycling + self.probing
    }
}

/// The pool of one chain (one namespace/name and one sandbox spec).
pub struct Pool {
    name: String,
    /// The chain's labels in per-chain metrics.
    labels: ChainLabels,
    spec: SandboxSpec,
    /// The chain version new cells are opened for (code changes keep the pool, not its cells).
    chain: Mutex<Arc<Chain>>,
    reuse: Reuse,
    max_uses: u32,
    warm_target: usize,
    /// Whether claimed sandboxes that come back count toward `warm_target`
    /// (`SandboxBackend::claimed_count_toward_warm`, under `reuse: Recycle`).
    claimed_count: bool,
    max: usize,
    counts: Mutex<Counts>,
    changed: Notify,
    closed: AtomicBool,
    shared: Arc<Shared>,
}

/// What every pool of a gateway shares.
struct Shared {
    backend: Arc<dyn SandboxBackend>,
    limits: Limits,
    metrics: Metrics,
    scheduler: Scheduler,
}

/// Which kind of boot a pool is asked for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum BootFor {
    /// Claims are waiting and not enough sandboxes are coming for them.
    Claims,
    /// The pool is below its warm target.
    Warm,
}

/// Decides, gateway-wide, which pool boots next. Lock order: the scheduler's lock, then a pool's;
/// a pool never calls in while holding its own.
struct Scheduler {
    state: Mutex<SchedulerState>,
    /// Boots at once across all pools: booting is CPU-bound, and more than the cores only slows all.
    max_running: usize,
    /// Warm sandboxes (warm, booting or recycling) across all pools, for warm-up boots.
    max_warm: usize,
}

#[derive(Default)]
struct SchedulerState {
    running: usize,
    pools: Vec<Weak<Pool>>,
    /// Where the next round-robin search starts, per kind.
    next_claims: usize,
    next_warm: usize,
}

impl Scheduler {
    fn lock(&self) -> std::sync::MutexGuard<'_, SchedulerState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn register(&self, pool: &Arc<Pool>) {
        self.lock().pools.push(Arc::downgrade(pool));
    }

    /// Starts as many boots as the limits allow: claims first, then warm-ups, chains in turn.
    fn kick(&self) {
        let mut s = self.lock();
        s.pools.retain(|p| {
            p.upgrade()
                .is_some_and(|p| !p.closed.load(Ordering::Relaxed))
        });
        while s.running < self.max_running {
            let pools: Vec<Arc<Pool>> = s.pools.iter().filter_map(Weak::upgrade).collect();
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
                    let warm: usize = pools.iter().map(|p| p.lock().coming()).sum();
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

impl Pool {
    fn lock(&self) -> std::sync::MutexGuard<'_, Counts> {
        // A poisoned lock only means a panic elsewhere; the counts themselves stay consistent.
        self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The warm gauge, set from the counts (under their lock) wherever the warm queue changes.
    fn show_warm(&self, c: &Counts) {
        self.shared
            .metrics
            .pool_warm
            .with_label_values(&[&self.name])
            .set(c.warm.len() as i64);
    }

    /// Claimed sandboxes that count toward the warm target: those that come back after their
    /// trigger point, where the backend counts them (see `claimed_count`).
    fn returning(&self, c: &Counts) -> usize {
        if self.claimed_count { c.claimed } else { 0 }
    }

    /// Warm and claimed counts, for status and metrics.
    pub fn sizes(&self) -> (usize, usize) {
        let c = self.lock();
        (c.warm.len(), c.claimed)
    }

    fn current_chain(&self) -> Arc<Chain> {
        self.chain.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Makes `chain` the version new cells are opened for.
    fn set_chain(&self, chain: &Arc<Chain>) {
        let mut current = self.chain.lock().unwrap_or_else(|p| p.into_inner());
        if !Arc::ptr_eq(&current, chain) {
            *current = chain.clone();
        }
    }

    /// Asks the scheduler for the boots this pool needs (for its claims and its warm target).
    fn backfill(&self) {
        if self.closed.load(Ordering::Relaxed) {
            return;
        }
        self.shared.scheduler.kick();
    }

    /// Counts one boot of `kind` as started if this pool needs one now.
    fn take_boot(&self, kind: BootFor) -> bool {
        if self.closed.load(Ordering::Relaxed) {
            return false;
        }
        let mut c = self.lock();
        // After failed boots, warm-up boots back off (0.5 s doubling to 30 s); a boot for a claim
        // that is waiting is tried again after 0.5 s, as before: in a cluster a failed "boot" is
        // often only "no warm pod yet" (the node was cordoned), and the run must not wait out the
        // backoff once pods are there.
        let wait = match kind {
            BootFor::Claims => BOOT_RETRY,
            BootFor::Warm => boot_retry(c.failed_boots),
        };
        if c.failed_at.is_some_and(|t| t.elapsed() < wait) || c.total() >= self.max {
            return false;
        }
        let wanted = match kind {
            BootFor::Claims => c.coming() < c.waiting.len(),
            BootFor::Warm => c.coming() + self.returning(&c) < self.warm_target,
        };
        if wanted {
            c.booting += 1;
        }
        wanted
    }

    /// Boots one sandbox, counted by `take_boot` and in the scheduler's running boots.
    fn spawn_boot(self: &Arc<Self>) {
        let pool = self.clone();
        tokio::spawn(async move {
            let slot = BootSlot {
                shared: pool.shared.clone(),
                released: AtomicBool::new(false),
            };
            let result = pool.boot(&slot).await;
            let leftover = {
                let mut c = pool.lock();
                c.booting -= 1;
                // A boot nobody needs any more (its waiter gave up) is not kept past the target:
                // with the kube backend it is a claimed pod, which must not idle here.
                let surplus = c.warm.len() >= c.waiting.len()
                    && c.warm.len() + pool.returning(&c) >= pool.warm_target;
                match result {
                    Ok(mut conn) if !pool.closed.load(Ordering::Relaxed) && !surplus => {
                        conn.mark_idle();
                        c.warm.push_back(conn);
                        c.last_error = None;
                        c.failed_boots = 0;
                        pool.show_warm(&c);
                        None
                    }
                    Ok(conn) => {
                        c.tearing_down += 1;
                        Some(Ok(conn))
                    }
                    Err(e) => {
                        tracing::warn!(chain = %Escaped(&pool.name), error = %Escaped(&e), "sandbox failed to boot");
                        pool.shared
                            .metrics
                            .sandbox_boot_failures
                            .with_label_values(&pool.labels.with(&[]))
                            .inc();
                        c.last_error = Some(e.clone());
                        c.failed_boots = c.failed_boots.saturating_add(1);
                        let wait = boot_retry(c.failed_boots);
                        c.failed_at = Some(Instant::now());
                        Some(Err(wait))
                    }
                }
            };
            slot.release();
            match leftover {
                None => pool.changed.notify_waiters(),
                // The pool closed while this one booted, or nobody needs it any more.
                Some(Ok(conn)) => {
                    conn.close().await;
                    pool.lock().tearing_down -= 1;
                }
                Some(Err(wait)) => {
                    pool.changed.notify_waiters();
                    // Claims that wait may boot again after BOOT_RETRY, warm-ups after `wait`.
                    tokio::time::sleep(BOOT_RETRY).await;
                    pool.backfill();
                    if wait > BOOT_RETRY {
                        tokio::time::sleep(wait - BOOT_RETRY).await;
                        pool.backfill();
                    }
                }
            }
        });
    }

    /// How long opening a cell for `chain` may take: its hooks' module code runs within the chain's
    /// deadline (the supervisor stops it there), plus a margin for making the instances.
    fn prepare_budget(&self, chain: &Chain) -> Duration {
        (Duration::from_millis(chain.spec.timeout_ms as u64) + PREPARE_MARGIN)
            .min(self.shared.limits.boot_timeout)
    }

    /// Starts a sandbox and opens its first cell. `slot` is handed back as soon as the supervisor is
    /// up: the cell's module code is the chain's own (it may sleep), and must not keep other chains
    /// from booting.
    async fn boot(&self, slot: &BootSlot) -> Result<SupervisorConn, String> {
        let began = Instant::now();
        let sandbox = self
            .shared
            .backend
            .start(&self.spec)
            .await
            .map_err(|e| e.to_string())?;
        let mut conn = SupervisorConn::new(sandbox, self.shared.limits.max_line());
        let budget = self.shared.limits.boot_timeout;
        let ready = match conn.wait_ready(budget).await {
            Ok(()) => {
                slot.release();
                let chain = self.current_chain();
                conn.prepare(
                    &chain,
                    &self.shared.limits.wire(),
                    self.prepare_budget(&chain),
                )
                .await
                .map_err(|e| format!("its first cell did not open: {e}"))
            }
            Err(e) => Err(format!("supervisor did not start: {e}")),
        };
        match ready {
            Ok(()) => {
                let m = &self.shared.metrics;
                let labels = self.labels.with(&[]);
                m.sandbox_boot_seconds
                    .with_label_values(&labels)
                    .observe(began.elapsed().as_secs_f64());
                m.sandboxes_started.with_label_values(&labels).inc();
                m.cells_prepared.with_label_values(&labels).inc();
                Ok(conn)
            }
            Err(e) => {
                conn.close().await;
                Err(e)
            }
        }
    }

    /// Takes a warm sandbox for one trigger point of `tenant` (the namespace the run is for),
    /// waiting up to `timeout` for one to boot.
    pub async fn claim(
        self: &Arc<Self>,
        tenant: &str,
        timeout: Duration,
    ) -> Result<Claimed, ClaimError> {
        let tenant: Arc<str> = Arc::from(tenant);
        let began = Instant::now();
        let deadline = began + timeout;
        let waited_for = |pool: &Self| {
            pool.shared
                .metrics
                .claim_wait_seconds
                .with_label_values(&pool.labels.with(&[]))
                .observe(began.elapsed().as_secs_f64());
        };
        // Claims are served in arrival order: under overload nobody waits behind later arrivals.
        let ticket = {
            let mut c = self.lock();
            c.next_ticket += 1;
            let t = c.next_ticket;
            c.waiting.insert(t, tenant.clone());
            Ticket {
                pool: self.clone(),
                id: t,
                tenant: tenant.clone(),
            }
        };
        let mut waited = false;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut c = self.lock();
                // A sandbox that died while it waited (a held pod's exec connection broke, its
                // pod was evicted) is dropped here, never handed to a run.
                while let Some(front) = c.warm.front_mut()
                    && !front.still_waiting()
                {
                    if let Some(dead) = c.warm.pop_front() {
                        tracing::warn!(chain = %Escaped(&self.name), sandbox = %dead.id, "a warm sandbox died while it waited; replacing it");
                        c.tearing_down += 1;
                        let pool = self.clone();
                        tokio::spawn(async move {
                            dead.close().await;
                            pool.lock().tearing_down -= 1;
                            pool.backfill();
                        });
                    }
                }
                if c.next_in_line() == Some(ticket.id)
                    && let Some(conn) = c.warm.pop_front()
                {
                    {
                        c.claimed += 1;
                        c.served(ticket.id);
                        self.show_warm(&c);
                        drop(c);
                        drop(ticket); // the next in line may go
                        let kind = if waited { "cold" } else { "warm" };
                        self.shared
                            .metrics
                            .claims
                            .with_label_values(&self.labels.with(&[kind]))
                            .inc();
                        waited_for(self);
                        tracing::debug!(chain = %Escaped(&self.name), kind, "sandbox claimed");
                        // Booting a replacement is CPU-heavy; starting it a moment later keeps it off
                        // the claimed run's critical path.
                        let pool = self.clone();
                        tokio::spawn(async move {
                            tokio::time::sleep(BACKFILL_DELAY).await;
                            pool.backfill();
                        });
                        return Ok(Claimed {
                            conn: Some(conn),
                            pool: self.clone(),
                            tenant,
                        });
                    }
                }
            }
            // Not enough coming for everyone waiting: the scheduler boots more, within max, ahead
            // of every pool's warm-up.
            self.backfill();
            waited = true;
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                self.shared
                    .metrics
                    .claims
                    .with_label_values(&self.labels.with(&["timeout"]))
                    .inc();
                waited_for(self);
                let c = self.lock();
                let detail = match &c.last_error {
                    Some(e) => format!("last boot failed: {e}"),
                    None => format!("{} of {} sandboxes busy", c.total(), self.max),
                };
                return Err(ClaimError::Timeout {
                    chain: self.name.clone(),
                    waited_ms: timeout.as_millis() as u64,
                    detail,
                });
            }
        }
    }

    /// A warm sandbox for work that must never make a run wait (a rollout's shadow runs): taken
    /// only while no claim waits, within `patience`; None when none came free. Never boots one.
    pub(crate) async fn try_claim(
        self: &Arc<Self>,
        tenant: &str,
        patience: Duration,
    ) -> Option<Claimed> {
        let tenant: Arc<str> = Arc::from(tenant);
        let deadline = Instant::now() + patience;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut c = self.lock();
                let alive = c.warm.front_mut().is_some_and(|f| f.still_waiting());
                if c.waiting.is_empty()
                    && alive
                    && let Some(conn) = c.warm.pop_front()
                {
                    c.claimed += 1;
                    c.served += 1;
                    let served = c.served;
                    let t = c.tenants.entry(tenant.clone()).or_default();
                    t.held += 1;
                    t.last_served = served;
                    self.show_warm(&c);
                    drop(c);
                    self.shared
                        .metrics
                        .claims
                        .with_label_values(&self.labels.with(&["shadow"]))
                        .inc();
                    let pool = self.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(BACKFILL_DELAY).await;
                        pool.backfill();
                    });
                    return Some(Claimed {
                        conn: Some(conn),
                        pool: self.clone(),
                        tenant,
                    });
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return None;
            }
        }
    }

    /// The trigger point is over: recycle the sandbox for the next one, or retire it.
    fn release(self: &Arc<Self>, mut conn: SupervisorConn) {
        let retire = if !conn.healthy() {
            Some("broken")
        } else if self.reuse == Reuse::None {
            Some("reuse_none")
        } else if conn.uses().saturating_add(1) >= self.max_uses {
            Some("max_uses")
        } else if conn.outdated() {
            Some("outdated")
        } else if self.closed.load(Ordering::Relaxed) {
            Some("pool_closed")
        } else {
            None
        };
        {
            let mut c = self.lock();
            c.claimed -= 1;
            if retire.is_some() {
                c.tearing_down += 1;
            } else {
                c.recycling += 1;
            }
        }
        let pool = self.clone();
        tokio::spawn(async move {
            let reason = match retire {
                Some(reason) => Some(reason.to_string()),
                None => pool.recycle(&mut conn).await.err(),
            };
            let reason = match reason {
                Some(reason) => Some(reason),
                None => {
                    // Checked under the lock `close` drains with: a pool that closed while the
                    // cell was replaced does not keep it either.
                    let mut c = pool.lock();
                    if pool.closed.load(Ordering::Relaxed) {
                        Some("pool_closed".to_string())
                    } else {
                        c.recycling -= 1;
                        conn.mark_idle();
                        c.warm.push_back(conn);
                        pool.show_warm(&c);
                        drop(c);
                        pool.changed.notify_waiters();
                        pool.backfill();
                        return;
                    }
                }
            };
            if let Some(reason) = reason {
                if retire.is_none() {
                    let mut c = pool.lock();
                    c.recycling -= 1;
                    c.tearing_down += 1;
                }
                let label = reason.split(':').next().unwrap_or("dirty").to_string();
                if label != "reuse_none" {
                    tracing::info!(chain = %Escaped(&pool.name), sandbox = %conn.id, uses = conn.uses(), reason = %Escaped(&reason), "sandbox retired");
                }
                pool.shared
                    .metrics
                    .sandbox_retirements
                    .with_label_values(&pool.labels.with(&[&label]))
                    .inc();
                conn.close().await;
                pool.lock().tearing_down -= 1;
            }
            pool.changed.notify_waiters();
            pool.backfill();
        });
    }

    /// Ends the sandbox's cell and opens the next one. Err: why it must be retired instead.
    async fn recycle(&self, conn: &mut SupervisorConn) -> Result<(), String> {
        let budget = self.shared.limits.boot_timeout;
        match conn.end(budget).await {
            Ok(CellEnd::Clean) => {}
            Ok(CellEnd::Dirty(why)) => return Err(format!("dirty: {why}")),
            Err(e) => return Err(format!("broken: {e}")),
        }
        if self.closed.load(Ordering::Relaxed) {
            return Err("pool_closed".into());
        }
        let chain = self.current_chain();
        conn.prepare(
            &chain,
            &self.shared.limits.wire(),
            self.prepare_budget(&chain),
        )
        .await
        .map_err(|e| format!("broken: the next cell did not open: {e}"))?;
        self.shared
            .metrics
            .cells_prepared
            .with_label_values(&self.labels.with(&[]))
            .inc();
        Ok(())
    }

    /// Retires waiting sandboxes the backend calls outdated (an upgrade reaches held pods without
    /// traffic too), and those that have waited longer than `idle_retire` while the pool has more
    /// waiting than its warm target: a held set that grew with demand shrinks when it is gone.
    fn shrink(self: &Arc<Self>) {
        let idle = self.shared.limits.idle_retire;
        let victims: Vec<(SupervisorConn, &'static str)> = {
            let mut c = self.lock();
            let (outdated, current): (VecDeque<_>, VecDeque<_>) =
                c.warm.drain(..).partition(|conn| conn.outdated());
            c.warm = current;
            let mut victims: Vec<_> = outdated.into_iter().map(|v| (v, "outdated")).collect();
            while c.warm.len() + self.returning(&c) > self.warm_target
                && c.warm.front().is_some_and(|f| f.idle_for() >= idle)
            {
                if let Some(v) = c.warm.pop_front() {
                    victims.push((v, "idle"));
                }
            }
            c.tearing_down += victims.len();
            if !victims.is_empty() {
                self.show_warm(&c);
            }
            victims
        };
        for (conn, reason) in victims {
            self.shared
                .metrics
                .sandbox_retirements
                .with_label_values(&self.labels.with(&[reason]))
                .inc();
            let pool = self.clone();
            tokio::spawn(async move {
                conn.close().await;
                pool.lock().tearing_down -= 1;
                pool.changed.notify_waiters();
            });
        }
    }

    /// Pings the warm sandboxes whose supervisor has been silent for `limits.keepalive`, one task
    /// each, out of the warm queue meanwhile: one that answers in time goes back; one that does not
    /// (a half-open connection, a stream the kubelet cut) is retired and replaced, so no run is ever
    /// handed a dead sandbox and left to fail at its deadline.
    fn keepalive(self: &Arc<Self>) {
        let Some(every) = self.shared.limits.keepalive else {
            return;
        };
        let due: Vec<SupervisorConn> = {
            let mut c = self.lock();
            let (due, keep): (VecDeque<_>, VecDeque<_>) = c
                .warm
                .drain(..)
                .partition(|conn| conn.silent_for() >= every);
            c.warm = keep;
            c.probing += due.len();
            due.into()
        };
        for mut conn in due {
            let pool = self.clone();
            tokio::spawn(async move {
                let answered = conn.ping(pool.shared.limits.keepalive_deadline).await;
                let closed = pool.closed.load(Ordering::Relaxed);
                {
                    let mut c = pool.lock();
                    c.probing -= 1;
                    if answered.is_ok() && !closed {
                        // Back where claims look first: it waited longest.
                        c.warm.push_front(conn);
                        drop(c);
                        pool.changed.notify_waiters();
                        return;
                    }
                    c.tearing_down += 1;
                    pool.show_warm(&c);
                }
                if let Err(e) = answered {
                    tracing::warn!(chain = %Escaped(&pool.name), sandbox = %conn.id, error = %e, "a warm sandbox did not answer its keepalive; replacing it");
                    pool.shared
                        .metrics
                        .sandbox_retirements
                        .with_label_values(&pool.labels.with(&["broken"]))
                        .inc();
                }
                conn.close().await;
                pool.lock().tearing_down -= 1;
                pool.changed.notify_waiters();
                pool.backfill();
            });
        }
    }

    /// Stops backfilling and destroys the warm sandboxes; claimed ones are destroyed on release.
    async fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        let warm: Vec<SupervisorConn> = self.lock().warm.drain(..).collect();
        self.shared
            .metrics
            .pool_warm
            .with_label_values(&[&self.name])
            .set(0);
        futures::future::join_all(warm.into_iter().map(|c| c.close())).await;
        self.changed.notify_waiters();
    }

    /// True once nothing of this pool exists any more.
    fn drained(&self) -> bool {
        self.lock().total() == 0
    }
}

/// One of the scheduler's gateway-wide boot slots, held from a boot's start until its sandbox is up
/// (or the boot failed); released once.
struct BootSlot {
    shared: Arc<Shared>,
    released: AtomicBool,
}

impl BootSlot {
    fn release(&self) {
        if !self.released.swap(true, Ordering::SeqCst) {
            self.shared.scheduler.finished();
        }
    }
}

/// A claim's place in line; leaving (served, timed out or cancelled) lets the next one go.
struct Ticket {
    pool: Arc<Pool>,
    id: u64,
    tenant: Arc<str>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        {
            let mut c = self.pool.lock();
            c.waiting.remove(&self.id);
            c.forget_if_idle(&self.tenant);
        }
        self.pool.changed.notify_waiters();
    }
}

/// A sandbox claimed for one trigger point. Dropping it hands it back: recycled or retired.
pub struct Claimed {
    conn: Option<SupervisorConn>,
    pool: Arc<Pool>,
    tenant: Arc<str>,
}

impl Claimed {
    pub fn conn(&mut self) -> &mut SupervisorConn {
        self.conn
            .as_mut()
            .expect("a Claimed holds its connection until dropped")
    }
}

impl Drop for Claimed {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            self.pool.lock().handed_back(&self.tenant);
            self.pool.release(conn);
        }
    }
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

/// All pools of a gateway, kept in step with the registry's chains.
pub struct Pools {
    shared: Arc<Shared>,
    pools: Arc<Mutex<HashMap<PoolKey, Arc<Pool>>>>,
    retired: Arc<Mutex<Vec<Arc<Pool>>>>,
}

/// How often idle sandboxes past their pool's warm target are looked for.
const SHRINK_EVERY: Duration = Duration::from_secs(5);

impl Pools {
    pub fn new(
        backend: Arc<dyn SandboxBackend>,
        limits: Limits,
        metrics: Metrics,
        boot_concurrency: usize,
    ) -> Self {
        let shared = Arc::new(Shared {
            backend,
            scheduler: Scheduler {
                state: Mutex::default(),
                max_running: boot_concurrency.max(1),
                max_warm: limits.warm_sandboxes,
            },
            limits,
            metrics,
        });
        let pools: Arc<Mutex<HashMap<PoolKey, Arc<Pool>>>> = Arc::default();
        let retired: Arc<Mutex<Vec<Arc<Pool>>>> = Arc::default();
        {
            let (pools, retired) = (Arc::downgrade(&pools), Arc::downgrade(&retired));
            shared.metrics.set_sandbox_states(Box::new(move || {
                let mut all: Vec<Arc<Pool>> = Vec::new();
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
                let all: Vec<Arc<Pool>> = pools
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
    pub fn pool_for(&self, chain: &Arc<Chain>) -> Arc<Pool> {
        let pool = self.pool_serving(chain);
        pool.set_chain(chain);
        pool
    }

    /// The pool a claim for this version of the chain takes from, created on first use. An existing
    /// pool keeps opening cells for the version it has (during a rollout, the live one); a claim for
    /// another version has its cell replaced (`ClaimedChain::claim`).
    pub(crate) fn pool_serving(&self, chain: &Arc<Chain>) -> Arc<Pool> {
        let key = self.key(chain);
        let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        pools
            .entry(key.clone())
            .or_insert_with(|| {
                let pool = Arc::new(Pool {
                    name: chain.qualified_name(),
                    labels: ChainLabels::of(chain),
                    spec: chain.sandbox.clone(),
                    chain: Mutex::new(chain.clone()),
                    reuse: key.reuse,
                    max_uses: key.max_uses.max(1),
                    // With the kube backend the operator keeps the pods warm; the gateway claims
                    // per run, or holds a few claimed and attached when told to.
                    warm_target: self
                        .shared
                        .backend
                        .warm_target(chain.spec.pool.warm as usize),
                    claimed_count: key.reuse == Reuse::Recycle
                        && self.shared.backend.claimed_count_toward_warm(),
                    max: chain.spec.pool.max.max(1) as usize,
                    counts: Mutex::default(),
                    changed: Notify::new(),
                    closed: AtomicBool::new(false),
                    shared: self.shared.clone(),
                });
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
        let stale: Vec<Arc<Pool>> = {
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
                    .map(|p| (p.lock().warm.len(), p.warm_target.min(p.max)))
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
        let all: Vec<Arc<Pool>> = {
            let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
            pools.drain().map(|(_, p)| p).collect()
        };
        for p in &all {
            p.close().await;
        }
        let deadline = Instant::now() + timeout;
        let retired: Vec<Arc<Pool>> = self
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
            let c = p.lock();
            let target = p.warm_target.min(p.max);
            progress.warm += c.warm.len();
            progress.target += target;
            progress.booting += c.booting;
            if c.warm.len() < target {
                progress
                    .below
                    .push(format!("{} {}/{}", p.name, c.warm.len(), target));
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
                let (w, c) = p.sizes();
                (p.name.clone(), w, c)
            })
            .collect()
    }
}

/// Sandboxes per chain and state across `pools` (several pools of one chain are summed: a pool
/// whose shape changed drains while its successor fills).
fn sandbox_states(pools: &[Arc<Pool>]) -> crate::metrics::SandboxStates {
    let mut sums: std::collections::BTreeMap<(ChainLabels, &'static str), i64> = Default::default();
    for pool in pools {
        let c = pool.lock();
        for (state, n) in [
            ("warm", c.warm.len()),
            ("claimed", c.claimed),
            ("booting", c.booting),
            ("recycling", c.recycling),
            ("tearing_down", c.tearing_down),
        ] {
            *sums.entry((pool.labels.clone(), state)).or_default() += n as i64;
        }
    }
    sums.into_iter()
        .map(|((chain, state), n)| (chain, state, n))
        .collect()
}
