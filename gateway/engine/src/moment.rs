//! What a hook sees of time: one moment per run. Hooks of one run must not be able to measure each
//! other (a hook before a redactor could spell the raw text in how long it ran, and one after it
//! read that back), and a run's walks are served by several sandboxes (the baseline's, claimed again
//! for each walk; the tenant's; a fresh one after a sandbox died under `Open`; a shadow's), each
//! with its own cell. So the gateway decides the moment, once per run, and sends it with every walk
//! (`chunk`'s `moment_ms`, supervisor/PROTOCOL.md); the supervisor stands every clock of every
//! instance at it.
//!
//! The moment is the run's start, to the whole second. A hook needs the date and the time of day,
//! never milliseconds, and every digit more tells it more of when runs begin: across the turns of a
//! session a hook can keep one turn's moment in its `state` and read the next turn's, and how long a
//! turn took is something a hook can stretch. Whole seconds make that need whole seconds of delay.

use serde::Serialize;
use std::time::SystemTime;

/// What every clock a run's hooks can read stands at: milliseconds since the Unix epoch, always a
/// whole second.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Moment {
    unix_ms: u64,
}

impl Moment {
    /// The moment of a run that began `unix_ms` milliseconds after the Unix epoch.
    pub fn of_start(unix_ms: u64) -> Self {
        Self {
            unix_ms: unix_ms / 1000 * 1000,
        }
    }

    /// The moment of a run that begins now.
    pub fn now() -> Self {
        let since = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        Self::of_start(since.as_millis() as u64)
    }

    /// Milliseconds since the Unix epoch.
    pub fn unix_ms(self) -> u64 {
        self.unix_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runs_moment_is_its_start_to_the_whole_second() {
        assert_eq!(
            Moment::of_start(1_767_225_600_999).unix_ms(),
            1_767_225_600_000
        );
        assert_eq!(
            Moment::of_start(1_767_225_600_000).unix_ms(),
            1_767_225_600_000
        );
        assert_eq!(
            serde_json::to_string(&Moment::of_start(1_500)).unwrap(),
            "1000"
        );
        assert_eq!(Moment::now().unix_ms() % 1000, 0);
    }
}
