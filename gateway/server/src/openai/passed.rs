//! What the chains already decided about the texts of a conversation. An application resends the
//! whole history every turn, and every user message and tool result in it must have passed its
//! chain before it goes upstream again (`chat`). Running the chain on each one every turn would
//! cost a turn's latency per message; instead the proxy remembers, per caller, namespace, target and
//! session, the verdict on each exact payload under the exact revision of the chains that walked it
//! (`Engine::serving_revision`). A resent message costs a hash and a lookup; a change of the hooks
//! (or of how a rollout places the session) is a new revision, so the text is walked again.
//!
//! Only verdicts of walks where every hook answered are remembered (a hook passed over by
//! `failurePolicy: Open` decided nothing). The record is bounded in entries and bytes and forgets
//! the oldest first; a forgotten text is simply walked again.

use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

/// At most this many verdicts are kept.
const MAX_ENTRIES: usize = 100_000;
/// And at most this many bytes of rewritten payloads and messages.
const MAX_BYTES: usize = 64 << 20;

/// What a chain decided about one payload.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Decided {
    /// Passed unchanged.
    Same,
    /// Rewritten to this payload.
    Rewritten(Value),
    /// Blocked, with this message.
    Blocked(String),
    /// Skipped (a hook answered instead), with this message.
    Skipped(String),
}

impl Decided {
    fn bytes(&self) -> usize {
        match self {
            Decided::Same => 0,
            Decided::Rewritten(v) => v.to_string().len(),
            Decided::Blocked(m) | Decided::Skipped(m) => m.len(),
        }
    }
}

/// Where a payload was walked: everything that decides which hooks walked it and with what.
pub(crate) struct Scope<'a> {
    pub(crate) caller: &'a str,
    pub(crate) namespace: &'a str,
    pub(crate) target: &'a str,
    pub(crate) session: &'a str,
    pub(crate) trigger_point: &'a str,
    pub(crate) revision: &'a str,
}

type Key = [u8; 32];

#[derive(Default)]
struct Inner {
    entries: HashMap<Key, Decided>,
    order: VecDeque<Key>,
    bytes: usize,
}

/// The record, shared by every request of the proxy.
#[derive(Default)]
pub(crate) struct Passed {
    inner: Mutex<Inner>,
}

fn key(scope: &Scope<'_>, payload: &Value) -> Key {
    let mut h = Sha256::new();
    let payload = payload.to_string();
    for part in [
        scope.caller,
        scope.namespace,
        scope.target,
        scope.session,
        scope.trigger_point,
        scope.revision,
        payload.as_str(),
    ] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    h.finalize().into()
}

impl Passed {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What the chain of `scope` decided about `payload`, if it was walked there.
    pub(crate) fn get(&self, scope: &Scope<'_>, payload: &Value) -> Option<Decided> {
        self.lock().entries.get(&key(scope, payload)).cloned()
    }

    /// Remembers what the chain of `scope` decided about `payload`.
    pub(crate) fn put(&self, scope: &Scope<'_>, payload: &Value, decided: Decided) {
        let size = decided.bytes();
        if size > MAX_BYTES / 16 {
            return;
        }
        let k = key(scope, payload);
        let mut inner = self.lock();
        if let Some(old) = inner.entries.insert(k, decided) {
            inner.bytes -= old.bytes();
        } else {
            inner.order.push_back(k);
        }
        inner.bytes += size;
        while inner.entries.len() > MAX_ENTRIES || inner.bytes > MAX_BYTES {
            let Some(oldest) = inner.order.pop_front() else {
                break;
            };
            if let Some(old) = inner.entries.remove(&oldest) {
                inner.bytes -= old.bytes();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn scope(revision: &str) -> Scope<'_> {
        Scope {
            caller: "app",
            namespace: "default",
            target: "bot",
            session: "s1",
            trigger_point: "input",
            revision,
        }
    }

    #[test]
    fn a_verdict_is_found_only_under_the_same_revision_and_payload() {
        let p = Passed::default();
        let text = json!("call 555-0123-4567");
        p.put(
            &scope("r1"),
            &text,
            Decided::Rewritten(json!("call [phone]")),
        );
        assert_eq!(
            p.get(&scope("r1"), &text),
            Some(Decided::Rewritten(json!("call [phone]")))
        );
        assert_eq!(p.get(&scope("r2"), &text), None);
        assert_eq!(p.get(&scope("r1"), &json!("call 555-0123-4568")), None);
        let mut other = scope("r1");
        other.session = "s2";
        assert_eq!(p.get(&other, &text), None);
    }

    #[test]
    fn the_oldest_verdicts_are_forgotten_first() {
        let p = Passed::default();
        for i in 0..MAX_ENTRIES + 10 {
            p.put(&scope("r"), &json!(i), Decided::Same);
        }
        assert_eq!(p.get(&scope("r"), &json!(0)), None);
        assert_eq!(p.get(&scope("r"), &json!(9)), None);
        assert_eq!(p.get(&scope("r"), &json!(10)), Some(Decided::Same));
        assert_eq!(p.lock().entries.len(), MAX_ENTRIES);
    }
}
