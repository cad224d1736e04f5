//! The capability runner: the one path from a hook into the application. For every `host_call` it
//! always does, in order: resolve (the capability exists in the chain's namespace and the hook lists
//! it) → validate the payload against the capability's JSON Schema → gates → execute → dispatch.
//! `caller` is built here, on the trusted side, from the chain session; nothing a hook sends can
//! change it.

use crate::audit::{AuditGate, AuditHostCall};
use crate::chain::{Chain, ChainKey};
use crate::limits::Limits;
use crate::metrics::Metrics;
use crate::registry::{CapabilityEntry, Registry};
use crate::supervisor::HostCalls;
use async_trait::async_trait;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Who is calling: the chain session's identity, never the hook's payload.
#[derive(Clone, Debug, PartialEq)]
pub struct Caller(pub BTreeMap<String, String>);

impl Caller {
    pub fn new(
        key: &ChainKey,
        session_id: &str,
        context: &BTreeMap<String, String>,
        run_id: &str,
    ) -> Self {
        // The application's context first, so the session's own fields always win over it.
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

/// Errors a hook sees as `HostCallError` with this text.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("capability {0:?} does not exist in namespace {1:?}")]
    Unknown(String, String),
    #[error("hook {hook:?} may not call {name:?}: list it under the hook's capabilities")]
    NotAllowed { hook: String, name: String },
    #[error("payload for {name:?} does not match its schema: {reason}")]
    Schema { name: String, reason: String },
    #[error("{name:?} denied by gate {gate:?}: {reason}")]
    Denied {
        name: String,
        gate: String,
        reason: String,
    },
    #[error("{name:?} failed: {reason}")]
    Failed { name: String, reason: String },
    #[error("{name:?} did not answer within {ms} ms")]
    Timeout { name: String, ms: u64 },
}

/// Shared, long-lived part of the runner: transports and compiled schemas.
pub struct Runner {
    metrics: Metrics,
    limits: Limits,
    transport: crate::endpoint::Transport,
}

impl Runner {
    pub fn new(metrics: Metrics, limits: Limits) -> Self {
        Self {
            metrics,
            limits,
            transport: crate::endpoint::Transport::default(),
        }
    }

    /// The host_call handler of one run.
    pub fn for_run(
        &self,
        registry: Arc<Registry>,
        chain: Arc<Chain>,
        caller: Caller,
    ) -> RunHostCalls {
        RunHostCalls {
            registry,
            chain,
            caller,
            metrics: self.metrics.clone(),
            transport: self.transport.clone(),
            max_result_bytes: self.limits.payload_bytes,
            audit: Mutex::default(),
        }
    }
}

pub struct RunHostCalls {
    registry: Arc<Registry>,
    chain: Arc<Chain>,
    caller: Caller,
    metrics: Metrics,
    transport: crate::endpoint::Transport,
    max_result_bytes: usize,
    audit: Mutex<Vec<AuditHostCall>>,
}

impl RunHostCalls {
    pub fn audit(&self) -> Vec<AuditHostCall> {
        self.audit.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn capability(&self, name: &str) -> Result<&Arc<CapabilityEntry>, CallError> {
        self.registry
            .capability(&self.chain.namespace, name)
            .ok_or_else(|| CallError::Unknown(name.to_string(), self.chain.namespace.clone()))
    }

    /// Calls one capability's endpoint within its timeout. Used for gates, execute and dispatch.
    async fn execute(
        &self,
        cap: &CapabilityEntry,
        payload: Value,
    ) -> Result<(Value, Option<Value>), CallError> {
        let ms = cap.spec.timeout_ms as u64;
        let call = self
            .transport
            .execute(&cap.name, &cap.spec.endpoint, payload, &self.caller);
        match tokio::time::timeout(Duration::from_millis(ms), call).await {
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
            Ok(Err(reason)) => Err(CallError::Failed {
                name: cap.name.clone(),
                reason,
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
    ) -> Result<Value, CallError> {
        // resolve
        let cap = self.capability(name)?.clone();
        let hook_spec = &self.chain.spec.hooks[hook];
        if !hook_spec.capabilities.iter().any(|c| c == name) {
            return Err(CallError::NotAllowed {
                hook: hook_spec.name.clone(),
                name: name.into(),
            });
        }
        // schema
        if let Some(schema) = &cap.spec.schema {
            crate::endpoint::validate(schema, &payload).map_err(|reason| CallError::Schema {
                name: name.into(),
                reason,
            })?;
        }
        // gates, each a capability answering {allow, reason}
        for gate in &cap.spec.gates {
            let gate_cap = self.capability(gate)?.clone();
            let ask =
                json!({"capability": name, "payload": payload, "caller": self.caller.to_json()});
            let (answer, _) =
                self.execute(&gate_cap, ask)
                    .await
                    .map_err(|e| CallError::Denied {
                        name: name.into(),
                        gate: gate.clone(),
                        reason: format!("gate failed: {e}"),
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
        // execute
        let (result, consumed) = match self.execute(&cap, payload.clone()).await {
            Ok(done) => done,
            Err(e) => {
                // Dispatch steps still hear of it (result and consumed null, the error stated), so a
                // gate's reservation can be released.
                let body = json!({"capability": name, "payload": payload, "result": null, "consumed": null, "error": e.to_string(), "caller": self.caller.to_json()});
                self.dispatch(&cap, body, record).await;
                return Err(e);
            }
        };
        record.consumed = consumed.clone();
        // dispatch: after execute, told what was used.
        let body = json!({"capability": name, "payload": payload, "result": result, "consumed": consumed, "caller": self.caller.to_json()});
        self.dispatch(&cap, body, record).await;
        Ok(result)
    }

    /// Runs the capability's dispatch steps in order. A failing step is recorded and logged; the hook
    /// still gets its result, since the work was done and must not be repeated.
    async fn dispatch(&self, cap: &CapabilityEntry, body: Value, record: &mut AuditHostCall) {
        for step in &cap.spec.dispatch {
            let step_cap = match self.capability(step) {
                Ok(c) => c.clone(),
                Err(e) => {
                    tracing::error!(capability = %cap.name, step = %step, error = %e, "dispatch step missing");
                    continue;
                }
            };
            if let Err(e) = self.execute(&step_cap, body.clone()).await {
                tracing::error!(capability = %cap.name, step = %step, error = %e, "dispatch step failed");
                record.error = Some(format!("dispatch {step:?} failed: {e}"));
            }
        }
    }
}

#[async_trait]
impl HostCalls for RunHostCalls {
    async fn call(&self, hook: usize, name: &str, payload: Value) -> Result<Value, String> {
        let began = Instant::now();
        let hook_name = self.chain.spec.hooks.get(hook).map(|h| h.name.clone());
        let Some(hook_name) = hook_name else {
            return Err(format!("host_call from unknown hook #{hook}"));
        };
        let mut record = AuditHostCall {
            hook: hook_name,
            capability: name.to_string(),
            gates: vec![],
            consumed: None,
            latency_us: 0,
            error: None,
        };
        let result = self.run(hook, name, payload, &mut record).await;
        record.latency_us = began.elapsed().as_micros() as u64;
        let outcome = match &result {
            Ok(_) => "ok",
            Err(CallError::Denied { .. }) => "denied",
            Err(CallError::Unknown(..) | CallError::NotAllowed { .. }) => "refused",
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
        result.map_err(|e| e.to_string())
    }
}
