//! Why a sandbox is retired instead of serving again: one enum whose `label` is the `reason` of
//! `sluice_gateway_sandbox_retirements_total` and whose `Display` is the `reason` of the
//! "sandbox retired" log line.

use crate::supervisor::SandboxFailure;

/// Why a sandbox is destroyed rather than kept warm.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Retirement {
    /// Handed back unhealthy: a deadline kill, a broken stream, a protocol error.
    Broken,
    /// Ending its cell failed.
    EndFailed(SandboxFailure),
    /// Its cell ended clean, but the next one did not open.
    NextCellFailed(SandboxFailure),
    /// It did not answer a keepalive `ping` while it waited.
    Unanswered(SandboxFailure),
    /// The chain's `pool.reuse` is `None` (or the backend cannot recycle yet).
    ReuseNone,
    /// It served the chain's `pool.maxUses` trigger points.
    MaxUses,
    /// The backend says sandboxes of another kind serve its chain now (an upgrade).
    Outdated,
    /// Its pool closed (the chain went or its sandbox shape changed, or the gateway shuts down).
    PoolClosed,
    /// The supervisor's verdict on the cell that ended: not clean, for this reason.
    Dirty(String),
    /// It waited longer than `idle_retire` while its pool had more waiting than its warm target.
    Idle,
}

// === impl Retirement ===

impl Retirement {
    /// The `reason` label of `sluice_gateway_sandbox_retirements_total`.
    pub(crate) fn label(&self) -> &'static str {
        match self {
            Self::Broken | Self::EndFailed(_) | Self::NextCellFailed(_) | Self::Unanswered(_) => {
                "broken"
            }
            Self::ReuseNone => "reuse_none",
            Self::MaxUses => "max_uses",
            Self::Outdated => "outdated",
            Self::PoolClosed => "pool_closed",
            Self::Dirty(_) => "dirty",
            Self::Idle => "idle",
        }
    }

    /// Whether a handed-back sandbox retired for this is logged: under `reuse: None` every
    /// trigger point retires one, which is no news.
    pub(crate) fn logged(&self) -> bool {
        *self != Self::ReuseNone
    }
}

impl std::fmt::Display for Retirement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::EndFailed(e) => write!(f, "broken: {e}"),
            Self::NextCellFailed(e) => write!(f, "broken: the next cell did not open: {e}"),
            Self::Unanswered(e) => write!(f, "broken: no keepalive answer: {e}"),
            Self::Dirty(why) => write!(f, "dirty: {why}"),
            other => f.write_str(other.label()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_the_metric_reasons_and_display_the_logged_reasons() {
        let lost = SandboxFailure::Timeout(250);
        let cases = [
            (Retirement::Broken, "broken", "broken"),
            (
                Retirement::EndFailed(lost.clone()),
                "broken",
                "broken: timed out after 250 ms",
            ),
            (
                Retirement::NextCellFailed(lost.clone()),
                "broken",
                "broken: the next cell did not open: timed out after 250 ms",
            ),
            (
                Retirement::Unanswered(lost),
                "broken",
                "broken: no keepalive answer: timed out after 250 ms",
            ),
            (Retirement::ReuseNone, "reuse_none", "reuse_none"),
            (Retirement::MaxUses, "max_uses", "max_uses"),
            (Retirement::Outdated, "outdated", "outdated"),
            (Retirement::PoolClosed, "pool_closed", "pool_closed"),
            (
                Retirement::Dirty("a file was left in /tmp".into()),
                "dirty",
                "dirty: a file was left in /tmp",
            ),
            (Retirement::Idle, "idle", "idle"),
        ];
        for (why, label, text) in cases {
            assert_eq!(why.label(), label, "{why:?}");
            assert_eq!(why.to_string(), text, "{why:?}");
        }
    }

    #[test]
    fn only_reuse_none_goes_unlogged() {
        assert!(!Retirement::ReuseNone.logged());
        assert!(Retirement::Broken.logged());
        assert!(Retirement::Dirty("x".into()).logged());
    }
}
