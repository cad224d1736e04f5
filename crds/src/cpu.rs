//! What a chain's CPU setting means, in one place for the operator, the gateway and `sluice check`.
//!
//! A sandbox's CPU has two numbers, as a pod's has:
//! - the chain's `resources.cpu` is what the sandbox is **guaranteed**: the pod's CPU request (the
//!   scheduler reserves it; under contention the sandbox gets at least that share), a local
//!   sandbox's `cpu.shares`;
//! - the platform's **sandbox CPU limit** (`--sandbox-cpu-limit`, one core by default) is the most
//!   it may burn at any moment: the pod's CPU limit, a local sandbox's CFS quota. A chain may not
//!   ask for more than it.
//!
//! The limit is a CFS quota per 100 ms period. A trigger point's walk that needs more CPU than one
//! period's quota waits out the rest of the period (it is throttled): with the old model (the
//! chain's 250m as the limit, 25 ms per period) a three-hook walk and the preparation of the next
//! cell (~17 ms each) waited one or two periods, ~100–200 ms per trigger point. A runaway hook is
//! bounded by its deadline (`timeoutMs`), not by throttling; the limit only keeps one sandbox from
//! taking more than its core(s) while it runs.

use std::time::Duration;

/// The CFS period of every sandbox's quota (the kubelet's default `cpuCFSQuotaPeriod`, and what the
/// local backend sets).
pub const CFS_PERIOD: Duration = Duration::from_millis(100);

/// The platform's default sandbox CPU limit: one core. A walk runs one hook at a time on one
/// thread, so one core never throttles a walk; preparing the next cell runs after the answer.
pub const DEFAULT_SANDBOX_CPU_LIMIT: &str = "1";

/// Host CPU one hook call costs in a sandbox (gVisor's sentry included), from `make bench`'s `CPU per
/// hook (ms), WebAssembly cell` row (5.7 ms on the reference machine), rounded up.
pub const HOOK_CPU: Duration = Duration::from_millis(6);

/// Host CPU preparing one hook's next instance costs (its module code run), after the answer went
/// out: about a hook call's (`make bench`).
pub const PREPARE_CPU: Duration = Duration::from_millis(6);

/// The platform's ceiling on one sandbox's CPU, in millicores; `None`: no CFS limit at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SandboxCpuLimit(pub Option<u64>);

impl Default for SandboxCpuLimit {
    fn default() -> Self {
        Self(Some(1000))
    }
}

/// A `--sandbox-cpu-limit` that is neither a CPU quantity above 0 nor `none`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "sandbox CPU limit {0:?} is not a CPU quantity above 0 (like 1, 1500m or 2) or `none` (no limit)"
)]
pub struct SandboxCpuLimitError(pub String);

impl std::str::FromStr for SandboxCpuLimit {
    type Err = SandboxCpuLimitError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("none") {
            return Ok(Self(None));
        }
        match parse_millis(s) {
            Some(0) | None => Err(SandboxCpuLimitError(s.to_string())),
            Some(m) => Ok(Self(Some(m))),
        }
    }
}

impl std::fmt::Display for SandboxCpuLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            None => f.write_str("none"),
            Some(m) if m % 1000 == 0 => write!(f, "{}", m / 1000),
            Some(m) => write!(f, "{m}m"),
        }
    }
}

impl SandboxCpuLimit {
    /// The limit as a Kubernetes quantity (`1`, `1500m`), or `None` when there is none.
    pub fn quantity(&self) -> Option<String> {
        self.0.map(|_| self.to_string())
    }

    /// The CFS quota of one period.
    pub fn quota(&self) -> Option<Duration> {
        self.0
            .map(|m| Duration::from_micros(CFS_PERIOD.as_micros() as u64 * m / 1000))
    }

    /// Why a chain asking for `cpu` (its `resources.cpu`) cannot have it under this limit.
    pub fn refuses(&self, cpu: &str) -> Option<String> {
        let (Some(limit), Some(asked)) = (self.0, parse_millis(cpu)) else {
            return None;
        };
        (asked > limit).then(|| {
            format!(
                "spec.resources.cpu {cpu} is more than the platform's sandbox CPU limit ({self}): a chain's cpu is what its sandboxes are guaranteed, up to what one sandbox may use"
            )
        })
    }

    /// Whether one walk of `hooks` hooks (and the preparation of their next instances) fits in one
    /// period's quota: `Err` says by how much it does not.
    pub fn walk_fits(&self, hooks: usize) -> Result<(), WalkThrottled> {
        let Some(quota) = self.quota() else {
            return Ok(());
        };
        let need = walk_cpu(hooks);
        if need <= quota {
            Ok(())
        } else {
            Err(WalkThrottled {
                hooks,
                need,
                quota,
                limit: *self,
            })
        }
    }
}

/// Host CPU one walk of `hooks` hooks takes, with the preparation of their next instances.
pub fn walk_cpu(hooks: usize) -> Duration {
    (HOOK_CPU + PREPARE_CPU) * u32::try_from(hooks).unwrap_or(u32::MAX)
}

/// A walk that needs more CPU than one CFS period's quota gives: each trigger point waits out at
/// least one period.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WalkThrottled {
    pub hooks: usize,
    pub need: Duration,
    pub quota: Duration,
    pub limit: SandboxCpuLimit,
}

impl std::fmt::Display for WalkThrottled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "a walk of {} hooks takes about {} ms of CPU with the preparation of the next cell, more than the {} ms per {} ms period the platform's sandbox CPU limit ({}) gives: every trigger point waits out at least one period (~{} ms); split the chain or ask the platform for a higher --sandbox-cpu-limit",
            self.hooks,
            self.need.as_millis(),
            self.quota.as_millis(),
            CFS_PERIOD.as_millis(),
            self.limit,
            CFS_PERIOD.as_millis()
        )
    }
}

/// Millicores of a CPU quantity (`250m`, `1`, `0.5`), rounded up as the API server does; `None`
/// when it is not one.
fn parse_millis(q: &str) -> Option<u64> {
    crate::quantity::cpu_millis(q).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_parse_as_quantities_or_none() {
        assert_eq!("1".parse(), Ok(SandboxCpuLimit(Some(1000))));
        assert_eq!("1500m".parse(), Ok(SandboxCpuLimit(Some(1500))));
        assert_eq!("0.5".parse(), Ok(SandboxCpuLimit(Some(500))));
        assert_eq!("none".parse(), Ok(SandboxCpuLimit(None)));
        for bad in ["0", "", "lots", "-1", "1.5x"] {
            assert!(bad.parse::<SandboxCpuLimit>().is_err(), "{bad:?}");
        }
        assert_eq!(
            SandboxCpuLimit(Some(1500)).quantity().as_deref(),
            Some("1500m")
        );
        assert_eq!(SandboxCpuLimit(Some(2000)).quantity().as_deref(), Some("2"));
        assert_eq!(SandboxCpuLimit(None).quantity(), None);
    }

    #[test]
    fn a_chain_may_ask_up_to_the_limit() {
        let one = SandboxCpuLimit(Some(1000));
        assert_eq!(one.refuses("250m"), None);
        assert_eq!(one.refuses("1"), None);
        let refused = one.refuses("1500m").expect("over the limit");
        assert!(
            refused.contains("1500m") && refused.contains("(1)"),
            "{refused}"
        );
        assert_eq!(SandboxCpuLimit(None).refuses("64"), None);
    }

    #[test]
    fn a_walk_fits_one_core_but_not_a_tenth() {
        assert_eq!(SandboxCpuLimit(Some(1000)).walk_fits(3), Ok(()));
        assert_eq!(SandboxCpuLimit(None).walk_fits(500), Ok(()));
        let tenth = SandboxCpuLimit(Some(100))
            .walk_fits(3)
            .expect_err("10 ms per period");
        assert_eq!(tenth.quota, Duration::from_millis(10));
        assert_eq!(tenth.need, Duration::from_millis(36));
        let msg = tenth.to_string();
        assert!(
            msg.contains("3 hooks") && msg.contains("10 ms per 100 ms"),
            "{msg}"
        );
        // Many hooks outgrow even one core.
        assert!(SandboxCpuLimit(Some(1000)).walk_fits(12).is_err());
    }
}
