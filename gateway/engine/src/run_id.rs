//! A run's id: one ULID per run (a Run, or a whole Stream, and the shadow runs made on it), as the
//! audit, the logs and the capabilities' `caller` name it. What hooks learn of it carries no time
//! the audit does not let them have: the id with its time part zeroed, and the run's `Moment` (its
//! start, to the whole second), which their clocks read.

use crate::moment::Moment;
use ulid::Ulid;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RunId(Ulid);

impl RunId {
    /// The id of a run that begins now.
    pub(crate) fn new() -> Self {
        Self(Ulid::new())
    }

    /// The run id as hooks see it: the run's ULID with its time part zeroed (`00000000006K...`), so
    /// that no hook learns when the run began from it (hooks of one walk must not be able to time
    /// each other), while its random part still names the run the audit and the capabilities'
    /// `caller` name in full.
    pub(crate) fn for_hooks(&self) -> String {
        Ulid::from_parts(0, self.0.random()).to_string()
    }

    /// What the clocks of every hook of the run read: when it began (the time part of its id), to
    /// the whole second.
    pub(crate) fn moment(&self) -> Moment {
        Moment::of_start(self.0.timestamp_ms())
    }
}

impl std::fmt::Display for RunId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.0, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hooks_get_the_random_part_and_the_start_to_the_second() {
        let id = RunId(Ulid::from_parts(1_767_225_600_123, 42));
        let shown = Ulid::from_string(&id.for_hooks()).unwrap();
        assert_eq!((shown.timestamp_ms(), shown.random()), (0, 42));
        assert_eq!(id.moment().unix_ms(), 1_767_225_600_000);
        assert_eq!(Ulid::from_string(&id.to_string()).unwrap(), id.0);
    }
}
