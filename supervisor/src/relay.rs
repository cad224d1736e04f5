//! A hook's `host_call`, relayed to the gateway: the instance is blocked in the import while the
//! supervisor writes `host_call` and waits for the matching `host_result`. The deadline is paused
//! meanwhile: the gateway does not count host-call time against the hook.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};

use crate::checks::{HOST_CALL_NAME_BYTES, Limits, bounded_json};
use crate::deadline::Deadline;
use crate::protocol::{Channel, Incoming};

/// What one call's host calls go through.
#[derive(Clone)]
pub(crate) struct Relay {
    link: Result<Arc<Link>, &'static str>,
    deadline: Option<Deadline>,
}

pub(crate) struct Link {
    pub(crate) channel: Arc<Mutex<Channel>>,
    pub(crate) run: Value,
    pub(crate) hook: usize,
    pub(crate) limits: Limits,
    /// Host calls left in this chunk's walk, shared by its hooks.
    pub(crate) budget: Arc<AtomicU64>,
    /// Host-call ids, unique within the sandbox.
    pub(crate) next_id: Arc<AtomicU64>,
}

fn refusal(message: impl Into<String>, code: &str) -> String {
    json!({"message": message.into(), "code": code}).to_string()
}

impl Relay {
    pub(crate) fn new(link: Link) -> Self {
        Self {
            link: Ok(Arc::new(link)),
            deadline: None,
        }
    }

    /// A relay that answers every call with an error (module code at load time has no run).
    pub(crate) fn refusing(why: &'static str) -> Self {
        Self {
            link: Err(why),
            deadline: None,
        }
    }

    pub(crate) fn set_deadline(&mut self, deadline: Deadline) {
        self.deadline = Some(deadline);
    }

    /// One host call, its name and payload read in the instance's memory: each is checked
    /// against its bound before anything of it is copied.
    pub(crate) fn host_call(&mut self, name: &str, payload_json: &str) -> Result<String, String> {
        let link = match &self.link {
            Ok(link) => link.clone(),
            Err(why) => return Err(refusal(*why, "forbidden")),
        };
        let left = link.budget.load(Ordering::Relaxed);
        if left == 0 {
            return Err(refusal(
                format!(
                    "host_call limit reached: at most {} per run",
                    link.limits.host_calls
                ),
                "limit",
            ));
        }
        link.budget.store(left - 1, Ordering::Relaxed);
        // Every field a host_call relays is bounded before it is read further: a name no
        // capability can have, or a payload whose text is over what its JSON may be, is the
        // hook's error, not a line over the gateway's limit.
        if name.len() > HOST_CALL_NAME_BYTES {
            return Err(refusal(
                format!(
                    "host_call name is {} bytes, over the limit of {HOST_CALL_NAME_BYTES} (a capability's name is a Kubernetes object name)",
                    name.len()
                ),
                "invalid",
            ));
        }
        // Python writes JSON with a space after every `,` and `:`: under twice the compact size.
        let most = link
            .limits
            .payload_bytes
            .saturating_mul(2)
            .saturating_add(1 << 10);
        if payload_json.len() > most {
            return Err(refusal(
                format!(
                    "host_call payload is {} bytes, over the limit of {}",
                    payload_json.len(),
                    link.limits.payload_bytes
                ),
                "invalid",
            ));
        }
        let payload: Value = serde_json::from_str(payload_json)
            .map_err(|e| refusal(format!("host_call payload is not JSON: {e}"), "invalid"))?;
        let payload = bounded_json(
            payload,
            "host_call payload",
            link.limits.payload_bytes,
            link.limits.depth,
        )
        .map_err(|e| refusal(e.to_string(), "invalid"))?;
        let id = link.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let mut channel = link.channel.lock().unwrap_or_else(|e| e.into_inner());
        let request = json!({"type": "host_call", "id": id, "run": link.run, "hook": link.hook, "name": name, "payload": payload});
        if channel.send(&request).is_err() {
            gateway_gone();
        }
        if let Some(deadline) = &self.deadline {
            deadline.pause();
        }
        let reply = loop {
            match channel.receive() {
                Ok(Incoming::Message(msg)) if msg["type"] == "host_result" && msg["id"] == id => {
                    break msg;
                }
                Ok(Incoming::Message(_) | Incoming::Malformed(_)) => continue,
                Ok(Incoming::Closed) | Err(_) => gateway_gone(),
            }
        };
        if let Some(deadline) = &self.deadline {
            deadline.resume();
        }
        if reply["ok"] == true {
            Ok(reply
                .get("result")
                .cloned()
                .unwrap_or(Value::Null)
                .to_string())
        } else {
            let message = reply["error"]
                .as_str()
                .unwrap_or("host_call failed")
                .to_string();
            let code = reply["code"].as_str().unwrap_or("error");
            Err(refusal(message, code))
        }
    }
}

/// The gateway hung up in the middle of a host call: nothing is left to answer, and nothing of the
/// sandbox outlives this process (its instances are memory of this process).
fn gateway_gone() -> ! {
    std::process::exit(0)
}
