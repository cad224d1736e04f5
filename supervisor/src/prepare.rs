//! Instances made ahead of their call: the preparer thread keeps one instance prepared for each
//! hook of the open cell (its module code already run), and resets the used ones after their answers
//! went out; the slots they live in are counted so that no instance is refused for want of one.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use crate::runtime::{Core, HookCode, MAX_PREPARED, Prepared};

/// The pool's instance slots, counted: a store takes one before it instantiates and gives it back
/// once dropped (its slot reset), so an instance is never refused for want of a slot; it waits for
/// the preparer to reset one.
pub(crate) struct Slots {
    free: Arc<(Mutex<u32>, Condvar)>,
}

/// One slot taken; given back on drop.
pub(crate) struct Slot(Arc<(Mutex<u32>, Condvar)>);

impl Slots {
    pub(crate) fn new(n: u32) -> Self {
        Self {
            free: Arc::new((Mutex::new(n), Condvar::new())),
        }
    }

    pub(crate) fn take(&self) -> Slot {
        let (free, changed) = &*self.free;
        let mut free = free.lock().unwrap_or_else(|e| e.into_inner());
        while *free == 0 {
            free = changed.wait(free).unwrap_or_else(|e| e.into_inner());
        }
        *free -= 1;
        Slot(self.free.clone())
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let (free, changed) = &*self.0;
        *free.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        changed.notify_all();
    }
}

/// The preparer: a thread that keeps one instance prepared for each hook of the open cell (up to
/// `MAX_PREPARED`), and drops used instances (resetting their slots) after their answers went out.
/// It works only when there is something to prepare or drop; a prepared instance runs nothing while
/// it waits (a WebAssembly instance has no threads).
pub(crate) struct Preparer {
    shared: Arc<(Mutex<Ahead>, Condvar)>,
}

#[derive(Default)]
struct Ahead {
    wanted: Vec<HookCode>,
    ready: HashMap<[u8; 32], Prepared>,
    /// Hooks whose instance could not be prepared (they run unprepared, as before).
    unpreparable: HashSet<[u8; 32]>,
    /// The hook being prepared now.
    busy: Option<[u8; 32]>,
    used: Vec<Prepared>,
    /// A walk is running: the preparer keeps off the CPU it needs, resetting a used instance only
    /// when too few slots would be left otherwise.
    walking: bool,
    /// Callers waiting for a preparation to finish: the preparer wakes them, and only them (inside
    /// gVisor a wake-up nobody waits for is still a system call).
    waiting: usize,
}

impl Ahead {
    /// So many instances are held, ready or used, that too few slots would be left for a hook run
    /// unprepared and one being prepared: used ones are reset even during a walk.
    fn pressed(&self) -> bool {
        self.ready.len() + self.used.len() > MAX_PREPARED
    }

    fn next_wanted(&self) -> Option<HookCode> {
        self.wanted
            .iter()
            .find(|h| !self.ready.contains_key(&h.key) && !self.unpreparable.contains(&h.key))
            .cloned()
    }
}

impl Preparer {
    pub(crate) fn start(core: Arc<Core>) -> Self {
        let shared: Arc<(Mutex<Ahead>, Condvar)> = Arc::default();
        let worker = shared.clone();
        thread::Builder::new()
            .name("preparer".into())
            .spawn(move || {
                let (ahead, changed) = &*worker;
                let mut state = ahead.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    if state.walking && !state.pressed() {
                        state = changed.wait(state).unwrap_or_else(|e| e.into_inner());
                        continue;
                    }
                    if let Some(used) = state.used.pop() {
                        drop(state);
                        drop(used);
                        state = ahead.lock().unwrap_or_else(|e| e.into_inner());
                        continue;
                    }
                    let Some(hook) = state.next_wanted().filter(|_| !state.walking) else {
                        state = changed.wait(state).unwrap_or_else(|e| e.into_inner());
                        continue;
                    };
                    state.busy = Some(hook.key);
                    drop(state);
                    let prepared = core.prepare(&hook);
                    state = ahead.lock().unwrap_or_else(|e| e.into_inner());
                    state.busy = None;
                    let still_wanted = state.wanted.iter().any(|h| h.key == hook.key);
                    match prepared {
                        Some(p) if still_wanted => {
                            state.ready.insert(hook.key, p);
                        }
                        Some(p) => state.used.push(p),
                        None => {
                            state.unpreparable.insert(hook.key);
                        }
                    }
                    if state.waiting > 0 {
                        changed.notify_all();
                    }
                }
            })
            .expect("spawning the preparer thread");
        Self { shared }
    }

    fn lock(&self) -> MutexGuard<'_, Ahead> {
        self.shared.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn want(&self, mut hooks: Vec<HookCode>) {
        hooks.truncate(MAX_PREPARED);
        let mut state = self.lock();
        let keep: HashSet<[u8; 32]> = hooks.iter().map(|h| h.key).collect();
        let stale: Vec<[u8; 32]> = state
            .ready
            .keys()
            .filter(|k| !keep.contains(*k))
            .copied()
            .collect();
        for key in stale {
            if let Some(p) = state.ready.remove(&key) {
                state.used.push(p);
            }
        }
        state.unpreparable.retain(|k| keep.contains(k));
        state.wanted = hooks;
        self.shared.1.notify_all();
    }

    /// Waits until every wanted hook has its instance (or cannot have one), at most `wait`.
    pub(crate) fn wait(&self, wait: Duration) {
        let until = Instant::now() + wait;
        let mut state = self.lock();
        while state.next_wanted().is_some() || state.busy.is_some() {
            let now = Instant::now();
            if now >= until {
                return;
            }
            state.waiting += 1;
            state = self
                .shared
                .1
                .wait_timeout(state, until - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            state.waiting -= 1;
        }
    }

    /// A walk of `hooks` begins: when each has its instance ready, the preparer keeps off the CPU
    /// until `walk_ended`.
    pub(crate) fn walk_begins<'a>(&self, mut hooks: impl Iterator<Item = &'a [u8; 32]>) {
        // Not woken: whatever it does now, it looks at `walking` before it starts anything else.
        let mut state = self.lock();
        state.walking = hooks.all(|key| state.ready.contains_key(key));
    }

    pub(crate) fn walk_ended(&self) {
        self.lock().walking = false;
        self.shared.1.notify_all();
    }

    /// The instance prepared for `key`: ready, or being prepared now (waited for: cheaper than
    /// making another beside it).
    pub(crate) fn take(&self, key: &[u8; 32]) -> Option<Prepared> {
        let mut state = self.lock();
        while state.busy == Some(*key) {
            state.waiting += 1;
            state = self.shared.1.wait(state).unwrap_or_else(|e| e.into_inner());
            state.waiting -= 1;
        }
        let taken = state.ready.remove(key);
        // During a walk the preparer is not woken (inside gVisor a wake-up is system calls on the
        // walk's path); `walk_ended` wakes it.
        if taken.is_some() && !state.walking {
            self.shared.1.notify_all();
        }
        taken
    }

    pub(crate) fn discard(&self, used: Prepared) {
        let mut state = self.lock();
        state.used.push(used);
        if !state.walking || state.pressed() {
            self.shared.1.notify_all();
        }
    }
}
