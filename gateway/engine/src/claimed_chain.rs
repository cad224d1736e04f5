//! One chain bound to one claimed sandbox for one trigger point (a Run, or a whole Stream): a claim
//! (whose cell was opened ahead of it), then walks, re-validated by `outcome`. A sandbox failure
//! becomes a hook error under the chain's policy; under `Open` the walk resumes after the failed hook
//! in a fresh sandbox.

use crate::chain::Chain;
use crate::engine::Engine;
use crate::host_call_guard::{HostCallGuard, HostCallReport};
use crate::host_calls::{Caller, ShadowHostCalls};
use crate::log_text::Escaped;
use crate::outcome::{self, Walk};
use crate::pool::Claimed;
use crate::request::{EngineError, Target};
use crate::run_id::RunId;
use crate::state_vector::StateVector;
use crate::supervisor::{RunContext, SandboxFailure};
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

/// A chain bound to one claimed sandbox for one trigger point (a Run, or a whole Stream).
pub(crate) struct ClaimedChain<'e> {
    engine: &'e Engine,
    pub chain: Arc<Chain>,
    claimed: Option<Claimed>,
    /// What its hooks are told of the run: the same in every walk, whichever sandbox serves it.
    run: RunContext,
    /// Every walk's host_calls go through it, so the run's limits hold across flushes, the final
    /// pass and resumed walks.
    host: Arc<HostCallGuard>,
    pub sandbox_id: String,
    /// A failure while loading the hooks, reported by the next walk.
    pending: Option<SandboxFailure>,
    /// The namespace the run is for: tenants take turns in a pool they share.
    tenant: String,
    /// Set for a rollout's candidate in shadow: sandboxes only when one is free at once, and
    /// host_calls only to capabilities safe to repeat (counted here when refused).
    shadow: Option<Arc<ShadowHostCalls>>,
}

/// How long a shadow run waits for a sandbox that no run is waiting for, before it is dropped.
const SHADOW_CLAIM_PATIENCE: Duration = Duration::from_millis(250);

impl<'e> ClaimedChain<'e> {
    /// Claims a sandbox and loads the chain into it. No sandbox in time → UNAVAILABLE. `shadow`:
    /// for a rollout's shadow run (see the field).
    pub(crate) async fn open(
        engine: &'e Engine,
        chain: Arc<Chain>,
        target: &Target,
        run_id: RunId,
        shadow: bool,
    ) -> Result<Self, EngineError> {
        let app_context = target.caller_context();
        let caller = Caller::new(
            &target.key,
            &target.session_id,
            &app_context,
            &run_id.to_string(),
        );
        let context = json!({
            "namespace": target.key.namespace,
            "target": target.key.target,
            "trigger_point": target.key.trigger_point.as_str(),
            "session_id": target.session_id,
            "run_id": run_id.for_hooks(),
            "caller": app_context,
        });
        let registry = engine.registry();
        let mut calls = engine
            .capabilities()
            .for_run(registry.clone(), chain.clone(), caller);
        let shadow = shadow.then(|| {
            Arc::new(ShadowHostCalls::new(
                calls.clone(),
                registry,
                &chain.namespace,
            ))
        });
        if let Some(s) = &shadow {
            calls = s.clone() as Arc<dyn crate::host_calls::HostCalls>;
        }
        let host = Arc::new(HostCallGuard::new(calls, chain.clone(), engine.limits()));
        let mut claimed = Self {
            engine,
            chain,
            claimed: None,
            run: RunContext {
                context,
                moment: run_id.moment(),
            },
            host,
            sandbox_id: String::new(),
            pending: None,
            tenant: target.key.namespace.clone(),
            shadow,
        };
        match claimed.claim().await {
            Ok(()) => Ok(claimed),
            Err(ClaimOrInit::Claim(e)) => Err(EngineError::Unavailable(e)),
            // The sandbox died or hung while loading the hooks: the walk reports it per policy.
            Err(ClaimOrInit::Init(f)) => {
                claimed.pending = Some(f);
                Ok(claimed)
            }
        }
    }

    async fn claim(&mut self) -> Result<(), ClaimOrInit> {
        let pool = self.engine.pools().pool_serving(&self.chain);
        let span = tracing::info_span!(
            "claim",
            chain = %Escaped(&self.chain.qualified_name()),
            sandbox = tracing::field::Empty,
        );
        let mut claimed = if self.shadow.is_some() {
            pool.try_claim(&self.tenant, SHADOW_CLAIM_PATIENCE)
                .instrument(span.clone())
                .await
                .ok_or_else(|| ClaimOrInit::Claim("no sandbox free for a shadow run".to_string()))?
        } else {
            pool.claim(&self.tenant, self.engine.limits().claim_timeout)
                .instrument(span.clone())
                .await
                .map_err(|e| ClaimOrInit::Claim(e.to_string()))?
        };
        self.sandbox_id = claimed.conn().id.clone();
        span.record("sandbox", self.sandbox_id.as_str());
        let conn = claimed.conn();
        // The cell was opened ahead of the claim, for the chain's version of that moment; after a
        // rollout a sandbox may still hold the old code: its cell is replaced here.
        let current = conn.cell().is_some_and(|c| c.same_hooks(&self.chain));
        let init = if current {
            Ok(())
        } else {
            let limits = self.engine.limits();
            let budget = Duration::from_millis(self.chain.spec.timeout_ms as u64);
            match conn.end(budget).await {
                Ok(crate::supervisor::CellEnd::Clean) => {
                    conn.prepare(&self.chain, &limits.wire(), limits.boot_timeout)
                        .await
                }
                Ok(crate::supervisor::CellEnd::Dirty(why)) => Err(SandboxFailure::Died(why)),
                Err(f) => Err(f),
            }
        };
        self.claimed = Some(claimed);
        match init {
            Ok(_) => Ok(()),
            Err(f) => {
                self.claimed = None;
                Err(ClaimOrInit::Init(f))
            }
        }
    }

    /// Runs the chain on `payload`, threading `state`. Sandbox failures become hook errors under the
    /// chain's policy; under `Open` the walk resumes after the failed hook in a fresh sandbox.
    pub(crate) async fn walk(&mut self, payload: Value, state: &mut StateVector) -> Walk {
        let mut walk = Walk::new(payload);
        let mut start = 0;
        let budget = Duration::from_millis(self.chain.spec.timeout_ms as u64);
        let host = self.host.clone();
        loop {
            if self.claimed.is_none() {
                let failure = match self.pending.take() {
                    Some(f) => Some(f),
                    None => match self.claim().await {
                        Ok(()) => None,
                        Err(ClaimOrInit::Claim(e)) => {
                            Some(SandboxFailure::Died(format!("no sandbox to go on in: {e}")))
                        }
                        Err(ClaimOrInit::Init(f)) => Some(f),
                    },
                };
                if let Some(f) = failure {
                    outcome::failure_before_walk(&self.chain, &f, &mut walk, start);
                    match walk.resume_at.take() {
                        Some(next) => {
                            start = next;
                            continue;
                        }
                        None => return walk,
                    }
                }
            }
            let Some(claimed) = self.claimed.as_mut() else {
                return walk;
            };
            let conn = claimed.conn();
            let report = conn
                .walk(
                    start,
                    &walk.payload,
                    state.as_slice(),
                    &self.run,
                    budget,
                    host.as_ref(),
                )
                .await;
            outcome::fold(
                &self.chain,
                start,
                &report,
                &mut walk,
                state,
                self.engine.limits(),
            );
            if let Some(f) = &report.failure {
                tracing::warn!(chain = %Escaped(&self.chain.qualified_name()), sandbox = %conn.id, error = %f, "the sandbox failed during a walk; it is destroyed");
            }
            if !conn.healthy() || report.failure.is_some() {
                // Dropping the claim destroys the sandbox (killed at once when broken).
                self.claimed = None;
            }
            match walk.resume_at.take() {
                Some(next) => start = next,
                None => return walk,
            }
        }
    }

    /// Hands the sandbox back between walks (recycled or retired as after a trigger point); the
    /// next walk claims one again. For a chain shared by every tenant (the baseline), so that no run
    /// holds its sandbox while other chains run.
    pub(crate) fn release(&mut self) {
        self.claimed = None;
    }

    /// The sandbox, for the caller to hand back when it is done (`Handback`); none after a release.
    pub(crate) fn take_claim(&mut self) -> Option<Claimed> {
        self.claimed.take()
    }

    /// host_calls refused because the run is a shadow run and the capability not safe to repeat.
    pub(crate) fn shadow_refused(&self) -> u64 {
        self.shadow.as_ref().map_or(0, |s| s.refused())
    }

    /// The host_calls made so far, for the audit.
    pub(crate) fn host_calls(&self) -> HostCallReport {
        self.host.report()
    }
}

enum ClaimOrInit {
    Claim(String),
    Init(SandboxFailure),
}
