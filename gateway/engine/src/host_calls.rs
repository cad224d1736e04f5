//! The one line from a hook into the application, as the engine sees it: a hook's `host_call` is
//! answered by a `HostCalls` made for its run by the `Capabilities` the engine was given. The
//! capability runner (`sluice-capabilities`) implements both; tests give fakes. `Caller` is built here,
//! on the trusted side, from the run's identity: nothing a hook sends can change it.

use crate::audit::AuditHostCall;
use crate::chain::{Chain, ChainKey};
use crate::registry::Registry;
use async_trait::async_trait;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// Who is calling: the run's identity, never the hook's payload.
#[derive(Clone, Debug, PartialEq)]
pub struct Caller(pub BTreeMap<String, String>);

impl Caller {
    pub fn new(
        key: &ChainKey,
        session_id: &str,
        context: &BTreeMap<String, String>,
        run_id: &str,
    ) -> Self {
        // The application's context first (its `caller` already the verified one, see
        // `Target::caller_context`), so the session's own fields always win over it.
        let mut m = context.clone();
        m.insert("namespace".into(), key.namespace.clone());
        m.insert("target".into(), key.target.clone());
        m.insert("trigger_point".into(), key.trigger_point.as_str().into());
        m.insert("session_id".into(), session_id.into());
        m.insert("run_id".into(), run_id.into());
        Self(m)
    }

    pub fn to_json(&self) -> Value {
        json!(self.0)
    }
}

/// How a host_call failed, as the hook sees it: `HostCallError.code` in the hook, so hook code can
/// tell "no credit" (`denied`) from "the ledger is down" (`unavailable`) without parsing messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostCallCode {
    /// A gate refused the call (e.g. not enough credit): the answer the application gave.
    Denied,
    /// The payload or the call itself is wrong (schema, no such hook).
    Invalid,
    /// The capability's endpoint could not be reached or answered an error.
    Unavailable,
    /// The capability did not answer within its `timeoutMs`.
    Timeout,
    /// The run's host_call count, time or bytes are spent.
    Limit,
    /// The hook may not call this capability (unknown, not listed by the hook, or a gate).
    Forbidden,
}

impl HostCallCode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Denied => "denied",
            Self::Invalid => "invalid",
            Self::Unavailable => "unavailable",
            Self::Timeout => "timeout",
            Self::Limit => "limit",
            Self::Forbidden => "forbidden",
        }
    }
}

/// Why a host_call was not answered with a result. The hook sees the message as a raised
/// `HostCallError`, with `code()` as its `code`.
#[derive(Debug, thiserror::Error)]
pub enum HostCallError {
    #[error("host_call from unknown hook #{0}")]
    UnknownHook(usize),
    #[error("capability {0:?} is not available here")]
    Unavailable(String),
    /// Refused by the gateway: the run's host_call count, time or bytes are spent.
    #[error("{0}")]
    OverLimit(String),
    /// Refused or failed by whoever answers host_calls (the capability runner's own error).
    #[error("{error}")]
    Refused {
        code: HostCallCode,
        error: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl HostCallError {
    pub fn code(&self) -> HostCallCode {
        match self {
            Self::UnknownHook(_) => HostCallCode::Invalid,
            Self::Unavailable(_) => HostCallCode::Unavailable,
            Self::OverLimit(_) => HostCallCode::Limit,
            Self::Refused { code, .. } => *code,
        }
    }
}

/// Answers the host_calls of one run.
#[async_trait]
pub trait HostCalls: Send + Sync {
    async fn call(&self, hook: usize, name: &str, payload: Value) -> Result<Value, HostCallError>;
    /// `call`, with `budget` left of the run's host_call time. The engine calls this one. Whoever
    /// answers bounds its own steps by it, so that what must follow a call still runs when the
    /// budget ends mid-call (the capability runner's dispatch steps, which settle what a gate
    /// reserved); this default simply cuts the call off.
    async fn call_within(
        &self,
        hook: usize,
        name: &str,
        payload: Value,
        budget: Duration,
    ) -> Result<Value, HostCallError> {
        match tokio::time::timeout(budget, self.call(hook, name, payload)).await {
            Ok(answer) => answer,
            Err(_) => Err(HostCallError::OverLimit(format!(
                "host_call limit reached: the run's host_call time ran out during {name:?}"
            ))),
        }
    }
    /// The host_calls answered so far, for the run's audit event.
    fn audit(&self) -> Vec<AuditHostCall> {
        Vec::new()
    }
}

/// Makes the host_call handler of each run: what the engine knows of capabilities.
pub trait Capabilities: Send + Sync {
    /// The handler for one chain of one run, on the registry the run started with.
    fn for_run(
        &self,
        registry: Arc<Registry>,
        chain: Arc<Chain>,
        caller: Caller,
    ) -> Arc<dyn HostCalls>;
}

/// Answers every host_call with an error: for chains run where no capability is reachable.
pub struct NoHostCalls;

#[async_trait]
impl HostCalls for NoHostCalls {
    async fn call(
        &self,
        _hook: usize,
        name: &str,
        _payload: Value,
    ) -> Result<Value, HostCallError> {
        Err(HostCallError::Unavailable(name.to_string()))
    }
}

impl Capabilities for NoHostCalls {
    fn for_run(&self, _: Arc<Registry>, _: Arc<Chain>, _: Caller) -> Arc<dyn HostCalls> {
        Arc::new(NoHostCalls)
    }
}

/// The host_calls of a rollout's candidate running in shadow: only capabilities marked
/// `safeToRepeat` are called, and only when every gate and dispatch step they run is marked so too
/// (the live run already made whatever calls the trigger point needed, and already reserved and
/// charged for them); the others answer the hook `forbidden`, and are counted.
pub(crate) struct ShadowHostCalls {
    inner: Arc<dyn HostCalls>,
    registry: Arc<Registry>,
    namespace: String,
    refused: std::sync::atomic::AtomicU64,
}

/// Why a call is not made in shadow: the capability called, or one of its steps, is not safe to repeat.
#[derive(Debug, thiserror::Error)]
enum NotInShadow {
    #[error(
        "capability {0:?} is not called in shadow: only capabilities with safeToRepeat: true are (this hook is a rollout's candidate; its answers are compared, not used)"
    )]
    Capability(String),
    #[error(
        "capability {name:?} is not called in shadow: its {role} {step:?} is not safeToRepeat, and a shadow calls no gate or dispatch step that is not (this hook is a rollout's candidate; its answers are compared, not used)"
    )]
    Step {
        name: String,
        role: &'static str,
        step: String,
    },
}

impl ShadowHostCalls {
    pub(crate) fn new(inner: Arc<dyn HostCalls>, registry: Arc<Registry>, namespace: &str) -> Self {
        Self {
            inner,
            registry,
            namespace: namespace.to_string(),
            refused: Default::default(),
        }
    }

    pub(crate) fn refused(&self) -> u64 {
        self.refused.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn repeatable(&self, name: &str) -> bool {
        self.registry
            .capability(&self.namespace, name)
            .is_some_and(|c| c.spec.safe_to_repeat)
    }

    /// Whether `name` may be called in shadow: it, each of its gates and each of its dispatch steps
    /// is safe to repeat (a step that does not exist is not).
    fn admit(&self, name: &str) -> Result<(), NotInShadow> {
        let cap = self
            .registry
            .capability(&self.namespace, name)
            .filter(|c| c.spec.safe_to_repeat)
            .ok_or_else(|| NotInShadow::Capability(name.to_string()))?;
        let gates = cap.spec.gates.iter().map(|g| ("gate", g));
        let steps = gates.chain(cap.spec.dispatch.iter().map(|d| ("dispatch step", d)));
        for (role, step) in steps {
            if !self.repeatable(step) {
                return Err(NotInShadow::Step {
                    name: name.to_string(),
                    role,
                    step: step.clone(),
                });
            }
        }
        Ok(())
    }

    fn refuse(&self, why: NotInShadow) -> HostCallError {
        self.refused
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        HostCallError::Refused {
            code: HostCallCode::Forbidden,
            error: Box::new(why),
        }
    }
}

#[async_trait]
impl HostCalls for ShadowHostCalls {
    async fn call(&self, hook: usize, name: &str, payload: Value) -> Result<Value, HostCallError> {
        self.admit(name).map_err(|why| self.refuse(why))?;
        self.inner.call(hook, name, payload).await
    }

    /// As `call`, handing the budget on: whoever answers bounds its own steps by it.
    async fn call_within(
        &self,
        hook: usize,
        name: &str,
        payload: Value,
        budget: Duration,
    ) -> Result<Value, HostCallError> {
        self.admit(name).map_err(|why| self.refuse(why))?;
        self.inner.call_within(hook, name, payload, budget).await
    }

    fn audit(&self) -> Vec<AuditHostCall> {
        self.inner.audit()
    }
}
