//! What a hook sees of time: clocks that stand still. Hooks of one run must not be able to measure
//! each other (a hook before the redactor could spell the raw text in how long it ran, and one after
//! it read that back), so every instance's WASI clocks, wall and monotonic, read one moment: the
//! run's, which the gateway sends with each of its walks (`chunk`'s `moment_ms`), so that every
//! sandbox serving the run reads the same. From a gateway that sends none (an older one), the start
//! of the cell's first walk, for all of its walks. Module code run ahead of a walk (an instance
//! being prepared, the check at `init`) reads the Unix epoch. Only `--trace-lines` (authoring
//! tools, whose line tracer counts time) gives instances running clocks.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use wasmtime_wasi::{HostMonotonicClock, HostWallClock};

/// One reading of both clocks, as the guest sees them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Moment {
    /// Since the Unix epoch.
    wall: Duration,
    /// Nanoseconds, counted from the Unix epoch too: a monotonic clock's origin is arbitrary, and
    /// one that stands still needs no clock of its own.
    monotonic: u64,
}

impl Moment {
    /// What module code run ahead of a walk reads: nothing of when it ran.
    pub(crate) const EPOCH: Moment = Moment {
        wall: Duration::ZERO,
        monotonic: 0,
    };

    /// The moment `ms` milliseconds after the Unix epoch; None past what the monotonic clock's
    /// nanoseconds can count (the year 2554).
    pub(crate) fn from_unix_ms(ms: u64) -> Option<Self> {
        Some(Self {
            wall: Duration::from_millis(ms),
            monotonic: ms.checked_mul(1_000_000)?,
        })
    }

    pub(crate) fn now() -> Self {
        let wall = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        Self {
            wall,
            monotonic: wall.as_nanos() as u64,
        }
    }

    /// A reading of running clocks (`--trace-lines`): a monotonic clock that never steps back.
    fn running() -> Self {
        static ORIGIN: OnceLock<Instant> = OnceLock::new();
        Self {
            monotonic: ORIGIN.get_or_init(Instant::now).elapsed().as_nanos() as u64,
            ..Self::now()
        }
    }
}

/// The clocks of one instance: standing at a moment, or running (`None`, `--trace-lines` only).
#[derive(Clone)]
pub(crate) struct Clocks(Arc<Mutex<Option<Moment>>>);

impl Clocks {
    /// Clocks standing at the Unix epoch until told otherwise.
    pub(crate) fn standing() -> Self {
        Self(Arc::new(Mutex::new(Some(Moment::EPOCH))))
    }

    /// From now on they read `at` (or run, for `None`). Set before the instance's guest code runs.
    pub(crate) fn set(&self, at: Option<Moment>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = at;
    }

    fn read(&self) -> Moment {
        let at = *self.0.lock().unwrap_or_else(|p| p.into_inner());
        at.unwrap_or_else(Moment::running)
    }

    /// The WASI wall clock of the instance.
    pub(crate) fn wall(&self) -> impl HostWallClock + 'static {
        Wall(self.clone())
    }

    /// The WASI monotonic clock of the instance.
    pub(crate) fn monotonic(&self) -> impl HostMonotonicClock + 'static {
        Monotonic(self.clone())
    }
}

struct Wall(Clocks);

impl HostWallClock for Wall {
    fn resolution(&self) -> Duration {
        Duration::from_nanos(1)
    }

    fn now(&self) -> Duration {
        self.0.read().wall
    }
}

struct Monotonic(Clocks);

impl HostMonotonicClock for Monotonic {
    fn resolution(&self) -> u64 {
        1
    }

    fn now(&self) -> u64 {
        self.0.read().monotonic
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn standing_clocks_read_one_moment_until_set_and_running_ones_move() {
        let clocks = Clocks::standing();
        let (wall, monotonic) = (clocks.wall(), clocks.monotonic());
        assert_eq!((wall.now(), monotonic.now()), (Duration::ZERO, 0));
        let at = Moment::now();
        clocks.set(Some(at));
        let first = (wall.now(), monotonic.now());
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!((wall.now(), monotonic.now()), first);
        assert_eq!(first, (at.wall, at.monotonic));
        let given = Moment::from_unix_ms(1_767_225_600_000).unwrap();
        clocks.set(Some(given));
        assert_eq!(
            (wall.now(), monotonic.now()),
            (
                Duration::from_secs(1_767_225_600),
                1_767_225_600_000_000_000
            )
        );
        assert_eq!(Moment::from_unix_ms(u64::MAX), None);
        clocks.set(None);
        let running = monotonic.now();
        std::thread::sleep(Duration::from_millis(2));
        assert!(monotonic.now() > running);
    }
}
