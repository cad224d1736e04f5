//! The capability runner: the one path from a hook into the application. For every `host_call` it
//! always does, in order: resolve (the capability exists in the chain's namespace and the hook lists
//! it) → validate the payload against the capability's JSON Schema → gates → execute → dispatch.
//! `caller` comes from the engine, built on the trusted side from the run; nothing a hook sends can
//! change it.

use crate::endpoint::Transport;
use crate::trust::Trust;
use async_trait::async_trait;
use serde_json::{Value, json};
use sluice_crds::endpoints::AllowedEndpoints;
use sluice_crds::log_text::Escaped;
use sluice_engine::{
    AuditGate, AuditHostCall, Caller, Capabilities, CapabilityEntry, Chain, HostCallCode,
    HostCallError, HostCalls, Limits, Metrics, Registry,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::Instrument;

/// Errors a hook sees as `HostCallError` with this text.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("capability {0:?} does not exist in namespace {1:?}")]
    Unknown(String, String),
    #[error("hook {hook:?} may not call {name:?}: list it under the hook's capabilities")]
    NotAllowed { hook: String, name: String },
    #[error(
        "{name:?} is a {role} of {of:?}, which settles what hooks use: hooks cannot call it; call {of:?} instead (or, to charge per message, a capability gated and settled by it, like the examples' credit.charge)"
    )]
    NotCallable {
        name: String,
        role: &'static str,
        of: String,
    },
    /// The capability, or a gate or dispatch step of it, points where the platform does not allow.
    #[error("{name:?} is refused: {reason}")]
    EndpointNotAllowed {
        name: String,
        reason: sluice_crds::endpoints::EndpointRefused,
    },
    #[error("payload for {name:?} does not match its schema: {reason}")]
    Schema { name: String, reason: String },
    #[error("{name:?} denied by gate {gate:?}: {reason}")]
    Denied {
        name: String,
        gate: String,
        reason: String,
    },
    /// The gate could not say (its endpoint failed or timed out): not a refusal.
    #[error("{name:?} could not be checked by gate {gate:?}: {source}")]
    GateFailed {
        name: String,
        gate: String,
        source: Box<CallError>,
    },
    #[error("{name:?} failed: {reason}")]
    Failed { name: String, reason: String },
    #[error("{name:?} did not answer within {ms} ms")]
    Timeout { name: String, ms: u64 },
    /// The run's host_call time ended while a gate or execute still waited.
    #[error("host_call limit reached: the run's host_call time ran out while {name:?} ran")]
    OutOfTime { name: String },
}

impl CallError {
    /// What the hook's `HostCallError.code` says.
    pub fn code(&self) -> HostCallCode {
        match self {
            Self::Unknown(..)
            | Self::NotAllowed { .. }
            | Self::NotCallable { .. }
            | Self::EndpointNotAllowed { .. } => HostCallCode::Forbidden,
            Self::Schema { .. } => HostCallCode::Invalid,
            Self::Denied { .. } => HostCallCode::Denied,
            Self::GateFailed { source, .. } => source.code(),
            Self::Failed { .. } => HostCallCode::Unavailable,
            Self::Timeout { .. } => HostCallCode::Timeout,
            Self::OutOfTime { .. } => HostCallCode::Limit,
        }
    }
}

/// Tries of a dispatch step that fails: each settles what a gate reserved, so a step that failed
/// (the ledger restarting) is tried again. Steps must be idempotent per `call_id`.
const DISPATCH_TRIES: u32 = 3;
const DISPATCH_RETRY: Duration = Duration::from_millis(100);

/// Shared, long-lived part of the runner: transports (connections are reused across runs).
pub struct Runner {
    metrics: Metrics,
    limits: Limits,
    transport: Transport,
    allowed: Arc<AllowedEndpoints>,
}

impl Runner {
    pub fn new(metrics: Metrics, limits: Limits, trust: Trust) -> Self {
        Self {
            metrics,
            limits,
            transport: Transport::new(trust.credentials),
            allowed: Arc::new(trust.allowed),
        }
    }
}

impl Capabilities for Runner {
    /// The host_call handler of one run.
    fn for_run(
        &self,
        registry: Arc<Registry>,
        chain: Arc<Chain>,
        caller: Caller,
    ) -> Arc<dyn HostCalls> {
        Arc::new(RunHostCalls {
            registry,
            chain,
            caller,
            metrics: self.metrics.clone(),
            transport: self.transport.clone(),
            allowed: self.allowed.clone(),
            max_result_bytes: self.limits.payload_bytes,
            audit: Mutex::default(),
            calls: AtomicU64::new(0),
        })
    }
}

/// The host_calls of one run of one chain, recorded for its audit event.
struct RunHostCalls {
    registry: Arc<Registry>,
    chain: Arc<Chain>,
    caller: Caller,
    metrics: Metrics,
    transport: Transport,
    allowed: Arc<AllowedEndpoints>,
    max_result_bytes: usize,
    audit: Mutex<Vec<AuditHostCall>>,
    /// host_calls of this run so far: each gets its own `call_id` (`<run id>.<n>`).
    calls: AtomicU64,
}

impl RunHostCalls {
    fn capability(&self, name: &str) -> Result<&Arc<CapabilityEntry>, CallError> {
        self.registry
            .capability(&self.chain.namespace, name)
            .ok_or_else(|| CallError::Unknown(name.to_string(), self.chain.namespace.clone()))
    }

    /// A capability that some capability of the namespace uses as a gate or dispatch step: it
    /// reserves or settles on behalf of another call, so a hook calling it directly would reserve
    /// what nothing settles.
    fn settles_for(&self, name: &str) -> Option<(&'static str, String)> {
        self.registry
            .capabilities_in(&self.chain.namespace)
            .find_map(|other| {
                if other.spec.gates.iter().any(|g| g == name) {
                    Some(("gate", other.name.clone()))
                } else if other.spec.dispatch.iter().any(|d| d == name) {
                    Some(("dispatch step", other.name.clone()))
                } else {
                    None
                }
            })
    }

    /// Calls one capability's endpoint within its timeout and, when given, before `until` (the end
    /// of the run's host_call time). Used for gates, execute and dispatch (dispatch steps are never
    /// cut short by the run's budget: they settle what was reserved).
    async fn execute(
        &self,
        cap: &CapabilityEntry,
        payload: Value,
        until: Option<Instant>,
    ) -> Result<(Value, Option<Value>), CallError> {
        let ms = cap.spec.timeout_ms as u64;
        let own = Instant::now() + Duration::from_millis(ms);
        let (deadline, budget_first) = match until {
            Some(u) if u < own => (u, true),
            _ => (own, false),
        };
        let endpoint = &cap.spec.endpoint;
        let kind = if endpoint.http.is_some() {
            "http"
        } else if endpoint.grpc.is_some() {
            "grpc"
        } else {
            "builtin"
        };
        // One span per request (gate, execute or dispatch step); its trace context goes out with it.
        let span = tracing::info_span!(
            "capability_request",
            otel.kind = "client",
            capability = %Escaped(&cap.name),
            endpoint = kind,
            error = tracing::field::Empty,
        );
        let call = self
            .transport
            .execute(&cap.name, endpoint, payload, &self.caller)
            .instrument(span.clone());
        let answer = tokio::time::timeout_at(deadline.into(), call).await;
        if let Ok(Err(e)) = &answer {
            span.record("error", tracing::field::display(Escaped(&e.to_string())));
        } else if answer.is_err() {
            span.record("error", "timed out");
        }
        match answer {
            Ok(Ok((result, consumed))) => {
                let size = serde_json::to_vec(&result)
                    .map(|b| b.len())
                    .unwrap_or(usize::MAX);
                if size > self.max_result_bytes {
                    return Err(CallError::Failed {
                        name: cap.name.clone(),
                        reason: format!("result is {size} bytes, over the limit"),
                    });
                }
                Ok((result, consumed))
            }
            Ok(Err(e)) => Err(CallError::Failed {
                name: cap.name.clone(),
                reason: e.to_string(),
            }),
            Err(_) if budget_first => Err(CallError::OutOfTime {
                name: cap.name.clone(),
            }),
            Err(_) => Err(CallError::Timeout {
                name: cap.name.clone(),
                ms,
            }),
        }
    }

    async fn run(
        &self,
        hook: usize,
        name: &str,
        payload: Value,
        record: &mut AuditHostCall,
        until: Option<Instant>,
    ) -> Result<Value, CallError> {
        // resolve
        let cap = self.capability(name)?.clone();
        if let Some((role, of)) = self.settles_for(name) {
            return Err(CallError::NotCallable {
                name: name.into(),
                role,
                of,
            });
        }
        let hook_spec = &self.chain.spec.hooks[hook];
        if !hook_spec.capabilities.iter().any(|c| c == name) {
            return Err(CallError::NotAllowed {
                hook: hook_spec.name.clone(),
                name: name.into(),
            });
        }
        // trust: the capability and every gate and dispatch step of it point where the platform
        // allows, checked before any gate can reserve.
        for step in std::iter::once(name)
            .chain(cap.spec.gates.iter().map(String::as_str))
            .chain(cap.spec.dispatch.iter().map(String::as_str))
        {
            if let Some(c) = self.registry.capability(&self.chain.namespace, step)
                && let Err(reason) = self.allowed.check(&c.spec.endpoint)
            {
                return Err(CallError::EndpointNotAllowed {
                    name: step.into(),
                    reason,
                });
            }
        }
        // schema
        if let Some(schema) = &cap.spec.schema {
            sluice_crds::schema::validate(schema, &payload).map_err(|e| CallError::Schema {
                name: name.into(),
                reason: e.to_string(),
            })?;
        }
        // From the first gate on, every way this call ends is told to the dispatch steps (the
        // result and what was consumed, or the error), so a gate's reservation is always settled
        // or released, once, under this call's id.
        let call_id = format!(
            "{}.{}",
            self.caller.0.get("run_id").map_or("", String::as_str),
            self.calls.fetch_add(1, Ordering::Relaxed) + 1
        );
        let outcome = self
            .gates_then_execute(&cap, name, &payload, &call_id, record, until)
            .await;
        let body = match &outcome {
            Ok((result, consumed)) => {
                json!({"capability": name, "call_id": call_id, "payload": payload, "result": result, "consumed": consumed, "caller": self.caller.to_json()})
            }
            Err(e) => {
                json!({"capability": name, "call_id": call_id, "payload": payload, "result": null, "consumed": null, "error": e.to_string(), "caller": self.caller.to_json()})
            }
        };
        self.dispatch(&cap, body, record).await;
        let (result, consumed) = outcome?;
        record.consumed = consumed;
        Ok(result)
    }

    /// The gates in order (each a capability answering {allow, reason}), then execute.
    async fn gates_then_execute(
        &self,
        cap: &CapabilityEntry,
        name: &str,
        payload: &Value,
        call_id: &str,
        record: &mut AuditHostCall,
        until: Option<Instant>,
    ) -> Result<(Value, Option<Value>), CallError> {
        for gate in &cap.spec.gates {
            let gate_cap = self.capability(gate)?.clone();
            let ask = json!({"capability": name, "call_id": call_id, "payload": payload, "caller": self.caller.to_json()});
            let (answer, _) =
                self.execute(&gate_cap, ask, until)
                    .await
                    .map_err(|e| CallError::GateFailed {
                        name: name.into(),
                        gate: gate.clone(),
                        source: Box::new(e),
                    })?;
            let allow = answer
                .get("allow")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            let reason = answer
                .get("reason")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string();
            record.gates.push(AuditGate {
                gate: gate.clone(),
                allow,
                reason: reason.clone(),
            });
            if !allow {
                let reason = if reason.is_empty() {
                    "no reason given".into()
                } else {
                    reason
                };
                return Err(CallError::Denied {
                    name: name.into(),
                    gate: gate.clone(),
                    reason,
                });
            }
        }
        self.execute(cap, payload.clone(), until).await
    }

    /// Runs the capability's dispatch steps in order, each tried up to `DISPATCH_TRIES` times. A
    /// step that still fails is recorded, logged and counted; the hook still gets its result, since
    /// the work was done and must not be repeated.
    async fn dispatch(&self, cap: &CapabilityEntry, body: Value, record: &mut AuditHostCall) {
        for step in &cap.spec.dispatch {
            let step_cap = match self.capability(step) {
                Ok(c) => c.clone(),
                Err(e) => {
                    tracing::error!(capability = %Escaped(&cap.name), step = %Escaped(step), error = %Escaped(&e.to_string()), "dispatch step missing");
                    continue;
                }
            };
            let mut tries = 0;
            let failed = loop {
                tries += 1;
                match self.execute(&step_cap, body.clone(), None).await {
                    Ok(_) => break None,
                    Err(e) if tries >= DISPATCH_TRIES => break Some(e),
                    Err(_) => tokio::time::sleep(DISPATCH_RETRY * tries).await,
                }
            };
            if let Some(e) = failed {
                tracing::error!(capability = %Escaped(&cap.name), step = %Escaped(step), tries, error = %Escaped(&e.to_string()), "dispatch step failed");
                self.metrics
                    .host_calls
                    .with_label_values(&[step.as_str(), "dispatch_failed"])
                    .inc();
                record.error = Some(format!("dispatch {step:?} failed: {e}"));
            }
        }
    }
}

#[async_trait]
impl HostCalls for RunHostCalls {
    async fn call(&self, hook: usize, name: &str, payload: Value) -> Result<Value, HostCallError> {
        self.answer(hook, name, payload, None).await
    }

    async fn call_within(
        &self,
        hook: usize,
        name: &str,
        payload: Value,
        budget: Duration,
    ) -> Result<Value, HostCallError> {
        self.answer(hook, name, payload, Some(Instant::now() + budget))
            .await
    }

    fn audit(&self) -> Vec<AuditHostCall> {
        self.audit.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl RunHostCalls {
    /// One host_call, its gates and execute bounded by `until`, recorded and counted.
    async fn answer(
        &self,
        hook: usize,
        name: &str,
        payload: Value,
        until: Option<Instant>,
    ) -> Result<Value, HostCallError> {
        let began = Instant::now();
        let hook_name = self.chain.spec.hooks.get(hook).map(|h| h.name.clone());
        let Some(hook_name) = hook_name else {
            return Err(HostCallError::UnknownHook(hook));
        };
        let mut record = AuditHostCall {
            hook: hook_name,
            capability: name.to_string(),
            gates: vec![],
            consumed: None,
            latency_us: 0,
            error: None,
        };
        let result = self.run(hook, name, payload, &mut record, until).await;
        record.latency_us = began.elapsed().as_micros() as u64;
        let outcome = match &result {
            Ok(_) => "ok",
            Err(CallError::Denied { .. }) => "denied",
            Err(
                CallError::Unknown(..)
                | CallError::NotAllowed { .. }
                | CallError::NotCallable { .. },
            ) => "refused",
            Err(CallError::Schema { .. }) => "invalid",
            Err(_) => "failed",
        };
        // Unknown names are not used as label values, so a hook cannot blow up the metric's cardinality.
        let label = if self
            .registry
            .capability(&self.chain.namespace, name)
            .is_some()
        {
            name
        } else {
            "<unknown>"
        };
        self.metrics
            .host_calls
            .with_label_values(&[label, outcome])
            .inc();
        if let Err(e) = &result {
            record.error.get_or_insert_with(|| e.to_string());
        }
        self.audit
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(record);
        result.map_err(|e| match e {
            // The gateway's limit, not the capability's answer: counted as over_limit.
            CallError::OutOfTime { .. } => HostCallError::OverLimit(e.to_string()),
            e => HostCallError::Refused {
                code: e.code(),
                error: Box::new(e),
            },
        })
    }
}
