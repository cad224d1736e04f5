//! Deadlines for the instances: each armed deadline is watched by one thread, which ticks the
//! engine's epoch when one passes; every running instance then checks whether its own has (several
//! run at once: a walk's hook and the preparer's module code).

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use wasmtime::Engine;

/// Bumps the engine's epoch when an armed deadline passes; each running instance then checks its
/// own deadline (`Core::store`). Idle (no deadline armed) it sleeps: a prepared sandbox costs no
/// CPU.
pub(crate) struct Timer {
    shared: Arc<TimerShared>,
}

struct TimerShared {
    deadlines: Mutex<Deadlines>,
    changed: Condvar,
}

#[derive(Default)]
struct Deadlines {
    next_id: u64,
    armed: HashMap<u64, DeadlineInner>,
    /// When the watching thread wakes next (None: it waits to be told). It is told only of a
    /// deadline earlier than that: inside gVisor every wake-up is system calls, and a hook arms and
    /// ends a deadline per call.
    wakes_at: Option<Instant>,
}

impl Deadlines {
    /// A deadline now runs out at `at`: wakes the watcher if it would sleep past it.
    fn watch_for(&self, at: Instant, changed: &Condvar) {
        if self.wakes_at.is_none_or(|wake| at < wake) {
            changed.notify_all();
        }
    }
}

#[derive(Debug)]
struct DeadlineInner {
    /// When the hook's time runs out, or None while paused.
    at: Option<Instant>,
    /// Time left, kept while paused.
    left: Duration,
    expired: bool,
}

/// One armed deadline. Host calls pause it (their time is not the hook's), `disarm` ends it.
#[derive(Clone)]
pub(crate) struct Deadline {
    id: u64,
    timer: Arc<TimerShared>,
}

impl std::fmt::Debug for Deadline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Deadline({})", self.id)
    }
}

impl Deadline {
    fn with<R>(&self, f: impl FnOnce(&mut DeadlineInner) -> R) -> Option<R> {
        let mut deadlines = self
            .timer
            .deadlines
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let r = deadlines.armed.get_mut(&self.id).map(f);
        if let Some(at) = deadlines.armed.get(&self.id).and_then(|inner| inner.at) {
            deadlines.watch_for(at, &self.timer.changed);
        }
        r
    }

    /// Stops the clock (a host call started); `resume` starts it again with what was left.
    pub(crate) fn pause(&self) {
        self.with(|inner| {
            if let Some(at) = inner.at.take() {
                inner.left = at.saturating_duration_since(Instant::now());
            }
        });
    }

    pub(crate) fn resume(&self) {
        self.with(|inner| {
            if inner.at.is_none() && !inner.expired {
                inner.at = Some(Instant::now() + inner.left);
            }
        });
    }

    pub(crate) fn expired(&self) -> bool {
        self.with(|inner| inner.expired).unwrap_or(true)
    }

    /// The time left, or None once it has run out (or the deadline was disarmed).
    pub(crate) fn left(&self) -> Option<Duration> {
        self.with(|inner| match inner.at {
            _ if inner.expired => None,
            Some(at) => Some(at.saturating_duration_since(Instant::now())),
            None => Some(inner.left),
        })
        .flatten()
    }

    /// Ends this deadline: whether it had expired, and the time that was left.
    pub(crate) fn disarm(&self) -> (bool, Duration) {
        let mut deadlines = self
            .timer
            .deadlines
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        // The watcher is not woken: at worst it wakes once for a deadline no longer armed.
        let Some(mut inner) = deadlines.armed.remove(&self.id) else {
            return (true, Duration::ZERO);
        };
        if let Some(at) = inner.at.take() {
            inner.left = at.saturating_duration_since(Instant::now());
        }
        if inner.expired {
            (true, Duration::ZERO)
        } else {
            (false, inner.left)
        }
    }
}

impl Timer {
    pub(crate) fn start(engine: Engine) -> Self {
        let shared = Arc::new(TimerShared {
            deadlines: Mutex::default(),
            changed: Condvar::new(),
        });
        let watched = shared.clone();
        thread::Builder::new()
            .name("deadline".into())
            .spawn(move || watch(&engine, &watched))
            .expect("spawning the deadline thread");
        Self { shared }
    }

    pub(crate) fn arm(&self, timeout: Duration) -> Deadline {
        let mut deadlines = self
            .shared
            .deadlines
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        deadlines.next_id += 1;
        let id = deadlines.next_id;
        let at = Instant::now() + timeout;
        deadlines.armed.insert(
            id,
            DeadlineInner {
                at: Some(at),
                left: timeout,
                expired: false,
            },
        );
        deadlines.watch_for(at, &self.shared.changed);
        Deadline {
            id,
            timer: self.shared.clone(),
        }
    }
}

/// Sleeps until the earliest armed deadline; when one passes, marks it expired and ticks the epoch
/// (the instances running under it trap at their next check).
fn watch(engine: &Engine, timer: &TimerShared) {
    let mut deadlines = timer.deadlines.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let now = Instant::now();
        let mut passed = false;
        let mut next: Option<Instant> = None;
        for inner in deadlines.armed.values_mut() {
            match inner.at {
                Some(at) if at <= now => {
                    inner.at = None;
                    inner.expired = true;
                    passed = true;
                }
                Some(at) => next = Some(next.map_or(at, |n| n.min(at))),
                None => {}
            }
        }
        if passed {
            engine.increment_epoch();
        }
        deadlines.wakes_at = next;
        deadlines = match next {
            Some(at) => {
                timer
                    .changed
                    .wait_timeout(deadlines, at.saturating_duration_since(now))
                    .unwrap_or_else(|e| e.into_inner())
                    .0
            }
            None => timer
                .changed
                .wait(deadlines)
                .unwrap_or_else(|e| e.into_inner()),
        };
    }
}
