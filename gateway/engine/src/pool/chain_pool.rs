//! One chain's pool: its sandboxes by state (`Counts`), claims waiting in line (tenants taking
//! turns), boots asked of the scheduler, and what happens to a sandbox handed back (recycled into
//! the next cell, or retired), kept alive (keepalive) or shrunk away (idle, outdated).

use super::Shared;
use super::retire::Retirement;
use super::scheduler::{BOOT_RETRY, BootFor, BootSlot, boot_retry};
use crate::chain::Chain;
use crate::log_text::Escaped;
use crate::metrics::ChainLabels;
use crate::sandbox::{SandboxSpec, StartError};
use crate::supervisor::{CellEnd, EndAndPrepareError, SandboxFailure, SupervisorConn};
use sluice_crds::Reuse;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// How long after a claim the replacement boot starts.
const BACKFILL_DELAY: Duration = Duration::from_millis(25);
/// Beyond the chain's deadline, what opening a cell may take (instances made, acks sent).
const PREPARE_MARGIN: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error("no sandbox for chain {chain} within {waited_ms} ms ({detail})")]
    Timeout {
        chain: String,
        waited_ms: u64,
        detail: String,
    },
}

/// Why a boot gave no warm sandbox: the log line, and the detail of a claim that timed out.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BootError {
    /// The backend could not start it (names the chain and, once known, the sandbox).
    #[error(transparent)]
    Start(#[from] StartError),
    #[error("supervisor did not start: {0}")]
    Supervisor(SandboxFailure),
    /// Its first cell did not open: the chain's module code failed or overran, or the sandbox died.
    #[error("its first cell did not open: {0}")]
    FirstCell(SandboxFailure),
}

/// The pool of one chain (one namespace/name and one sandbox spec).
pub struct ChainPool {
    pub(super) name: String,
    /// The chain's labels in per-chain metrics.
    pub(super) labels: ChainLabels,
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

/// A pool's sandboxes by state, and the claims waiting for one.
#[derive(Default)]
struct Counts {
    warm: VecDeque<SupervisorConn>,
    booting: usize,
    claimed: usize,
    /// Released sandboxes whose cell is being ended and the next one opened.
    recycling: usize,
    /// Claimed sandboxes whose trigger point is answered, held until the answer is written: back
    /// in moments, so a claim waits for them rather than boot another.
    answered: usize,
    /// Warm sandboxes taken out for a keepalive `ping`.
    probing: usize,
    tearing_down: usize,
    /// Why the last boot failed, until one succeeds.
    last_error: Option<Arc<BootError>>,
    /// Tickets of claims waiting, oldest first, with the tenant each claims for.
    waiting: BTreeMap<u64, Arc<str>>,
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

/// A pool's counts, locked. Dropping it publishes the warm gauge if the warm count changed: the
/// one place the gauge is set.
struct Locked<'a> {
    pool: &'a ChainPool,
    counts: MutexGuard<'a, Counts>,
    warm_before: usize,
}

/// How many sandboxes a pool has in each state, at one moment.
pub(super) struct Snapshot {
    pub(super) warm: usize,
    pub(super) booting: usize,
    pub(super) claimed: usize,
    pub(super) recycling: usize,
    pub(super) tearing_down: usize,
}

/// A claim's place in line; leaving (served, timed out or cancelled) lets the next one go.
struct Ticket {
    pool: Arc<ChainPool>,
    id: u64,
    tenant: Arc<str>,
}

/// A sandbox claimed for one trigger point. Dropping it hands it back: recycled or retired.
pub struct Claimed {
    conn: Option<SupervisorConn>,
    pool: Arc<ChainPool>,
    tenant: Arc<str>,
    /// Its trigger point is answered: it is held only until the answer is written (`answered`).
    answered: bool,
}

// === impl Counts ===

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

    /// What `sluice_gateway_pool_warm_sandboxes` shows: the warm queue, with those out for a
    /// keepalive `ping` (they go back to its front when they answer).
    fn warm_shown(&self) -> usize {
        self.warm.len() + self.probing
    }
}

// === impl Locked ===

impl Deref for Locked<'_> {
    type Target = Counts;
    fn deref(&self) -> &Counts {
        &self.counts
    }
}

impl DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Counts {
        &mut self.counts
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let warm = self.counts.warm_shown();
        if warm != self.warm_before {
            self.pool.publish(warm);
        }
    }
}

// === impl ChainPool ===

impl ChainPool {
    pub(super) fn new(
        chain: &Arc<Chain>,
        reuse: Reuse,
        max_uses: u32,
        shared: Arc<Shared>,
    ) -> Self {
        Self {
            name: chain.qualified_name(),
            labels: ChainLabels::of(chain),
            spec: chain.sandbox.clone(),
            chain: Mutex::new(chain.clone()),
            reuse,
            max_uses: max_uses.max(1),
            // With the kube backend the operator keeps the pods warm; the gateway claims per run,
            // or holds a few claimed and attached when told to.
            warm_target: shared.backend.warm_target(chain.spec.pool.warm as usize),
            claimed_count: reuse == Reuse::Recycle && shared.backend.claimed_count_toward_warm(),
            max: chain.spec.pool.max.max(1) as usize,
            counts: Mutex::default(),
            changed: Notify::new(),
            closed: AtomicBool::new(false),
            shared,
        }
    }

    fn lock(&self) -> Locked<'_> {
        // A poisoned lock only means a panic elsewhere; the counts themselves stay consistent.
        let counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        Locked {
            pool: self,
            warm_before: counts.warm_shown(),
            counts,
        }
    }

    /// Sets the warm gauge; only `Locked::drop` calls it, after a change of the counts.
    fn publish(&self, warm: usize) {
        self.shared
            .metrics
            .pool_warm
            .with_label_values(&[&self.name])
            .set(warm as i64);
    }

    pub(super) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }

    /// Closed before it had anything: made after the gateway's pools shut down.
    pub(super) fn mark_closed(&self) {
        self.closed.store(true, Ordering::Relaxed);
    }

    /// Claimed sandboxes that count toward the warm target: those that come back after their
    /// trigger point, where the backend counts them (see `claimed_count`).
    fn returning(&self, c: &Counts) -> usize {
        if self.claimed_count { c.claimed } else { 0 }
    }

    /// The warm target, within `pool.max`.
    pub(super) fn warm_goal(&self) -> usize {
        self.warm_target.min(self.max)
    }

    /// Sandboxes that are or will soon be waiting for a claim (for the gateway-wide warm cap).
    pub(super) fn coming(&self) -> usize {
        self.lock().coming()
    }

    pub(super) fn snapshot(&self) -> Snapshot {
        let c = self.lock();
        Snapshot {
            warm: c.warm.len(),
            booting: c.booting,
            claimed: c.claimed,
            recycling: c.recycling,
            tearing_down: c.tearing_down,
        }
    }

    fn current_chain(&self) -> Arc<Chain> {
        self.chain.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Makes `chain` the version new cells are opened for.
    pub(super) fn set_chain(&self, chain: &Arc<Chain>) {
        let mut current = self.chain.lock().unwrap_or_else(|p| p.into_inner());
        if !Arc::ptr_eq(&current, chain) {
            *current = chain.clone();
        }
    }

    /// Counts a retirement in `sluice_gateway_sandbox_retirements_total`.
    fn count_retirement(&self, why: &Retirement) {
        self.shared
            .metrics
            .sandbox_retirements
            .with_label_values(&self.labels.with(&[why.label()]))
            .inc();
    }

    // --- boots ---

    /// Asks the scheduler for the boots this pool needs (for its claims and its warm target).
    pub(super) fn backfill(&self) {
        if self.is_closed() {
            return;
        }
        self.shared.scheduler.kick();
    }

    /// Counts one boot of `kind` as started if this pool needs one now.
    pub(super) fn take_boot(&self, kind: BootFor) -> bool {
        if self.is_closed() {
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
            BootFor::Claims => c.coming() + c.answered < c.waiting.len(),
            BootFor::Warm => c.coming() + self.returning(&c) < self.warm_target,
        };
        if wanted {
            c.booting += 1;
        }
        wanted
    }

    /// Boots one sandbox, counted by `take_boot` and in the scheduler's running boots.
    pub(super) fn spawn_boot(self: &Arc<Self>) {
        let pool = self.clone();
        tokio::spawn(async move {
            let slot = BootSlot::taken(pool.shared.clone());
            let result = pool.boot(&slot).await;
            let leftover = {
                let mut c = pool.lock();
                c.booting -= 1;
                // A boot nobody needs any more (its waiter gave up) is not kept past the target:
                // with the kube backend it is a claimed pod, which must not idle here.
                let surplus = c.warm.len() >= c.waiting.len()
                    && c.warm.len() + pool.returning(&c) >= pool.warm_target;
                match result {
                    Ok(mut conn) if !pool.is_closed() && !surplus => {
                        conn.mark_idle();
                        c.warm.push_back(conn);
                        c.last_error = None;
                        c.failed_boots = 0;
                        None
                    }
                    Ok(conn) => {
                        c.tearing_down += 1;
                        Some(Ok(conn))
                    }
                    Err(e) => {
                        tracing::warn!(chain = %Escaped(&pool.name), error = %Escaped(&e.to_string()), "sandbox failed to boot");
                        pool.shared
                            .metrics
                            .sandbox_boot_failures
                            .with_label_values(&pool.labels.with(&[]))
                            .inc();
                        c.last_error = Some(Arc::new(e));
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

    /// Opens a cell of the chain's current version in `conn`. It may take the chain's deadline (its
    /// hooks' module code runs within it; the supervisor stops it there) plus a margin for making
    /// the instances.
    async fn open_cell(&self, conn: &mut SupervisorConn) -> Result<(), SandboxFailure> {
        let chain = self.current_chain();
        conn.prepare(
            &chain,
            &self.shared.limits.wire(),
            self.prepare_budget(&chain),
        )
        .await
    }

    /// How long opening a cell of `chain` may take: its hooks' module code runs within the chain's
    /// deadline, plus a margin for making the instances.
    fn prepare_budget(&self, chain: &Chain) -> Duration {
        (Duration::from_millis(chain.spec.timeout_ms as u64) + PREPARE_MARGIN)
            .min(self.shared.limits.boot_timeout)
    }

    /// Starts a sandbox and opens its first cell. `slot` is handed back as soon as the supervisor is
    /// up: the cell's module code is the chain's own (it may sleep), and must not keep other chains
    /// from booting. Err: why, for the log and a claim's timeout.
    async fn boot(&self, slot: &BootSlot) -> Result<SupervisorConn, BootError> {
        let began = Instant::now();
        let sandbox = self.shared.backend.start(&self.spec).await?;
        let mut conn = SupervisorConn::new(sandbox, self.shared.limits.max_line());
        let budget = self.shared.limits.boot_timeout;
        let ready = match conn.wait_ready(budget).await {
            Ok(()) => {
                slot.release();
                self.open_cell(&mut conn)
                    .await
                    .map_err(BootError::FirstCell)
            }
            Err(e) => Err(BootError::Supervisor(e)),
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
                // A boot's throttling is the boot's (sandbox_boot_seconds shows it), not the first
                // trigger point's.
                let _ = conn.throttling_since_counted();
                Ok(conn)
            }
            Err(e) => {
                conn.close().await;
                Err(e)
            }
        }
    }

    // --- claims ---

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
            if self.is_closed() {
                // Closed while it waited (the chain changed, or the gateway shuts down): nothing
                // will come to it.
                waited_for(self);
                return Err(ClaimError::Timeout {
                    chain: self.name.clone(),
                    waited_ms: began.elapsed().as_millis() as u64,
                    detail:
                        "its pool was closed: the chain changed or the gateway is shutting down"
                            .into(),
                });
            }
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
                    c.claimed += 1;
                    c.served(ticket.id);
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
                    self.backfill_soon();
                    return Ok(Claimed {
                        conn: Some(conn),
                        pool: self.clone(),
                        tenant,
                        answered: false,
                    });
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
                    drop(c);
                    self.shared
                        .metrics
                        .claims
                        .with_label_values(&self.labels.with(&["shadow"]))
                        .inc();
                    self.backfill_soon();
                    return Some(Claimed {
                        conn: Some(conn),
                        pool: self.clone(),
                        tenant,
                        answered: false,
                    });
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return None;
            }
        }
    }

    /// Asks for a replacement a moment after a claim: booting is CPU-heavy, and starting it later
    /// keeps it off the claimed run's critical path.
    fn backfill_soon(self: &Arc<Self>) {
        let pool = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(BACKFILL_DELAY).await;
            pool.backfill();
        });
    }

    // --- hand-back ---

    /// Why a sandbox handed back is retired without trying to recycle it; None: recycle it.
    fn retirement_on_release(&self, conn: &SupervisorConn) -> Option<Retirement> {
        if !conn.healthy() {
            Some(Retirement::Broken)
        } else if self.reuse == Reuse::None {
            Some(Retirement::ReuseNone)
        } else if conn.uses().saturating_add(1) >= self.max_uses {
            Some(Retirement::MaxUses)
        } else if conn.outdated() {
            Some(Retirement::Outdated)
        } else if self.is_closed() {
            Some(Retirement::PoolClosed)
        } else {
            None
        }
    }

    /// Adds the CPU throttling the sandbox met since it was last counted (its trigger point, and the
    /// preparation of the cell before it) to the chain's metrics.
    fn count_throttling(&self, conn: &mut SupervisorConn) {
        let Some(t) = conn.throttling_since_counted() else {
            return;
        };
        let labels = self.labels.with(&[]);
        let m = &self.shared.metrics;
        m.sandbox_cpu_throttled_periods
            .with_label_values(&labels)
            .inc_by(t.periods);
        m.sandbox_cpu_throttled_seconds
            .with_label_values(&labels)
            .inc_by(t.time.as_secs_f64());
    }

    /// The trigger point is over: recycle the sandbox for the next one, or retire it.
    fn release(self: &Arc<Self>, mut conn: SupervisorConn, answered: bool) {
        self.count_throttling(&mut conn);
        let retire = self.retirement_on_release(&conn);
        {
            let mut c = self.lock();
            c.claimed -= 1;
            c.answered -= usize::from(answered);
            if retire.is_some() {
                c.tearing_down += 1;
            } else {
                c.recycling += 1;
            }
        }
        let pool = self.clone();
        tokio::spawn(async move {
            let why = match retire {
                Some(why) => why,
                None => {
                    // What the answer woke first (its connection's writer, on this worker thread)
                    // goes before the next cell's `end` and `init`.
                    tokio::task::yield_now().await;
                    let recycled = pool.recycle(&mut conn).await;
                    // Checked under the lock `close` drains with: a pool that closed while the
                    // cell was replaced does not keep it either.
                    let mut c = pool.lock();
                    c.recycling -= 1;
                    match recycled {
                        Ok(()) if !pool.is_closed() => {
                            conn.mark_idle();
                            c.warm.push_back(conn);
                            drop(c);
                            pool.changed.notify_waiters();
                            pool.backfill();
                            return;
                        }
                        Ok(()) => {
                            c.tearing_down += 1;
                            Retirement::PoolClosed
                        }
                        Err(why) => {
                            c.tearing_down += 1;
                            why
                        }
                    }
                }
            };
            if why.logged() {
                tracing::info!(chain = %Escaped(&pool.name), sandbox = %conn.id, uses = conn.uses(), reason = %Escaped(&why.to_string()), "sandbox retired");
            }
            pool.count_retirement(&why);
            conn.close().await;
            pool.lock().tearing_down -= 1;
            pool.changed.notify_waiters();
            pool.backfill();
        });
    }

    /// Ends the sandbox's cell and opens the next one, in one exchange with it
    /// (`SupervisorConn::end_and_prepare`). Err: why it must be retired instead.
    async fn recycle(&self, conn: &mut SupervisorConn) -> Result<(), Retirement> {
        if self.is_closed() {
            return Err(Retirement::PoolClosed);
        }
        let chain = self.current_chain();
        let end_budget = self.shared.limits.boot_timeout;
        match conn
            .end_and_prepare(
                &chain,
                &self.shared.limits.wire(),
                end_budget,
                self.prepare_budget(&chain),
            )
            .await
        {
            Ok(CellEnd::Clean) => {}
            Ok(CellEnd::Dirty(why)) => return Err(Retirement::Dirty(why)),
            Err(EndAndPrepareError::End(e)) => return Err(Retirement::EndFailed(e)),
            Err(EndAndPrepareError::Prepare(e)) => return Err(Retirement::NextCellFailed(e)),
        }
        self.shared
            .metrics
            .cells_prepared
            .with_label_values(&self.labels.with(&[]))
            .inc();
        Ok(())
    }

    // --- waiting sandboxes ---

    /// Retires waiting sandboxes the backend calls outdated (an upgrade reaches held pods without
    /// traffic too), and those that have waited longer than `idle_retire` while the pool has more
    /// waiting than its warm target: a held set that grew with demand shrinks when it is gone.
    pub(super) fn shrink(self: &Arc<Self>) {
        let idle = self.shared.limits.idle_retire;
        let victims: Vec<(SupervisorConn, Retirement)> = {
            let mut c = self.lock();
            let (outdated, current): (VecDeque<_>, VecDeque<_>) =
                c.warm.drain(..).partition(|conn| conn.outdated());
            c.warm = current;
            let mut victims: Vec<_> = outdated
                .into_iter()
                .map(|v| (v, Retirement::Outdated))
                .collect();
            while c.warm.len() + self.returning(&c) > self.warm_target
                && c.warm.front().is_some_and(|f| f.idle_for() >= idle)
            {
                if let Some(v) = c.warm.pop_front() {
                    victims.push((v, Retirement::Idle));
                }
            }
            c.tearing_down += victims.len();
            victims
        };
        for (conn, why) in victims {
            self.count_retirement(&why);
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
    pub(super) fn keepalive(self: &Arc<Self>) {
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
                {
                    let mut c = pool.lock();
                    c.probing -= 1;
                    if answered.is_ok() && !pool.is_closed() {
                        // Back where claims look first: it waited longest.
                        c.warm.push_front(conn);
                        drop(c);
                        pool.changed.notify_waiters();
                        return;
                    }
                    c.tearing_down += 1;
                }
                if let Err(e) = answered {
                    tracing::warn!(chain = %Escaped(&pool.name), sandbox = %conn.id, error = %e, "a warm sandbox did not answer its keepalive; replacing it");
                    pool.count_retirement(&Retirement::Unanswered(e));
                }
                conn.close().await;
                pool.lock().tearing_down -= 1;
                pool.changed.notify_waiters();
                pool.backfill();
            });
        }
    }

    /// Stops backfilling and destroys the warm sandboxes; claimed ones are destroyed on release.
    pub(super) async fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        let warm: Vec<SupervisorConn> = self.lock().warm.drain(..).collect();
        futures::future::join_all(warm.into_iter().map(|c| c.close())).await;
        self.changed.notify_waiters();
    }

    /// True once nothing of this pool exists any more.
    pub(super) fn drained(&self) -> bool {
        self.lock().total() == 0
    }
}

// === impl Ticket ===

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

// === impl Claimed ===

impl Claimed {
    pub fn conn(&mut self) -> &mut SupervisorConn {
        self.conn
            .as_mut()
            .expect("a Claimed holds its connection until dropped")
    }

    /// Its trigger point is answered and it is held only until the answer is written: a claim
    /// that comes meanwhile (the client's next request, sent as soon as it read the answer)
    /// waits for it instead of booting another sandbox.
    pub(crate) fn answered(mut self) -> Self {
        if !self.answered {
            self.answered = true;
            self.pool.lock().answered += 1;
        }
        self
    }
}

impl Drop for Claimed {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            self.pool.lock().handed_back(&self.tenant);
            self.pool.release(conn, self.answered);
        }
    }
}
