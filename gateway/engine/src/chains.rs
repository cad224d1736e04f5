//! The chains one trigger point runs: the platform's enforced baseline at its trigger point (if any)
//! and the tenant's own chain, and how their hooks are named in answers and the audit.

use crate::audit::{AuditChain, AuditEvent};
use crate::chain::{Chain, ChainKey};
use crate::registry::Registry;
use crate::request::EngineError;
use crate::state_vector::StateVector;
use std::sync::Arc;

/// The chains that serve one (namespace, target, trigger point).
#[derive(Clone, Debug)]
pub(crate) struct Chains {
    /// The platform namespace's enforced chain at this trigger point.
    pub baseline: Option<Arc<Chain>>,
    /// The tenant's chain for this target.
    pub tenant: Option<Arc<Chain>>,
}

impl Chains {
    /// In the order they run, each with whether it is the baseline.
    pub(crate) fn ordered(&self) -> impl Iterator<Item = (&Arc<Chain>, bool)> {
        self.baseline
            .iter()
            .map(|c| (c, true))
            .chain(self.tenant.iter().map(|c| (c, false)))
    }

    /// The chain whose streaming settings and pool a stream follows: the tenant's when it has one.
    pub(crate) fn main(&self) -> &Arc<Chain> {
        match (&self.tenant, &self.baseline) {
            (Some(c), _) | (None, Some(c)) => c,
            (None, None) => unreachable!("Chains always holds at least one chain"),
        }
    }

    /// The stream path's window, `(flushChars, lookbackChars)`: each the larger of the baseline's
    /// and the tenant's, since a baseline runs on the same batches as the tenant's chain. A tenant
    /// can widen the window (hold back more) but never give a baseline's hooks a smaller one than
    /// the baseline's own: tighten-only holds on the stream path too.
    pub(crate) fn stream_window(&self) -> (usize, usize) {
        self.ordered()
            .fold((1, 0), |(flush, lookback), (chain, _)| {
                let s = &chain.spec.streaming;
                (
                    flush.max(s.flush_chars as usize),
                    lookback.max(s.lookback_chars as usize),
                )
            })
    }

    /// A fresh state vector per chain, in run order.
    pub(crate) fn fresh_states(&self) -> Vec<StateVector> {
        self.ordered()
            .map(|(c, _)| StateVector::fresh(c.spec.hooks.len()))
            .collect()
    }

    /// Records which chains serve a run in its audit event.
    pub(crate) fn describe(&self, audit: &mut AuditEvent) {
        if let Some(t) = &self.tenant {
            audit.chain = Some(t.qualified_name());
            audit.code_hash = Some(t.code_hash.clone());
        }
        audit.superseded = self
            .ordered()
            .find_map(|(c, _)| c.superseded.as_ref())
            .map(|s| s.to_string());
        if let Some(b) = &self.baseline {
            audit.baseline = Some(AuditChain {
                chain: b.qualified_name(),
                code_hash: b.code_hash.clone(),
                sandbox: None,
            });
        }
    }

    /// The chains for a key: the baseline at its trigger point and the tenant's chain. Neither →
    /// NOT_FOUND; a baseline alone is enough.
    pub(crate) fn resolve(registry: &Registry, key: &ChainKey) -> Result<Chains, EngineError> {
        let chains = Chains {
            baseline: registry.baseline(key.trigger_point).cloned(),
            tenant: registry.chain(key).cloned(),
        };
        if chains.baseline.is_none() && chains.tenant.is_none() {
            return Err(EngineError::NotFound(format!(
                "no HookChain for target {:?} at trigger point {} in namespace {:?}",
                key.target, key.trigger_point, key.namespace
            )));
        }
        Ok(chains)
    }
}
