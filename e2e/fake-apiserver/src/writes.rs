//! Every write the API server took, counted by verb and resource, as an API server's audit log would
//! count them: the clients' requests (the gateway's claims and deletes, the operator's creates,
//! status and Events, Leases) and what the fake's scheduler and kubelet stand-ins write in their
//! place (bindings, pod status, the kubelet's Events and its final delete). What a cluster pays per
//! trigger point is read from here.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Mutex;

/// The verb of a write, as the API server's audit log names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Verb {
    Create,
    Update,
    Patch,
    Delete,
}

impl Verb {
    pub fn as_str(self) -> &'static str {
        match self {
            Verb::Create => "create",
            Verb::Update => "update",
            Verb::Patch => "patch",
            Verb::Delete => "delete",
        }
    }

    /// The verb of an HTTP method, if it writes.
    pub fn of_method(method: &str) -> Option<Verb> {
        match method {
            "POST" => Some(Verb::Create),
            "PUT" => Some(Verb::Update),
            "PATCH" => Some(Verb::Patch),
            "DELETE" => Some(Verb::Delete),
            _ => None,
        }
    }
}

impl fmt::Display for Verb {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What was written: a verb on a resource (`pods`, `pods/exec`, `hookchains/status`, `events`, ...).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Write {
    pub verb: Verb,
    pub resource: String,
}

/// Writes counted so far, by verb and resource.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Writes {
    pub counts: BTreeMap<Write, u64>,
}

impl Writes {
    /// All writes.
    pub fn total(&self) -> u64 {
        self.counts.values().sum()
    }

    /// Writes of `verb` on `resource`.
    pub fn get(&self, verb: Verb, resource: &str) -> u64 {
        self.counts
            .get(&Write {
                verb,
                resource: resource.to_string(),
            })
            .copied()
            .unwrap_or(0)
    }

    /// Writes of any verb on `resource`.
    pub fn on(&self, resource: &str) -> u64 {
        self.counts
            .iter()
            .filter(|(w, _)| w.resource == resource)
            .map(|(_, n)| n)
            .sum()
    }

    /// What was written after `earlier` (a snapshot of the same server) was taken.
    pub fn since(&self, earlier: &Writes) -> Writes {
        let counts = self
            .counts
            .iter()
            .map(|(w, n)| {
                (
                    w.clone(),
                    n.saturating_sub(earlier.counts.get(w).copied().unwrap_or(0)),
                )
            })
            .filter(|(_, n)| *n > 0)
            .collect();
        Writes { counts }
    }
}

/// One line per verb and resource, then the total.
impl fmt::Display for Writes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (w, n) in &self.counts {
            writeln!(f, "{:>7} {:<24} {n:>6}", w.verb, w.resource)?;
        }
        write!(f, "{:>7} {:<24} {:>6}", "", "total", self.total())
    }
}

/// The counter the server and its stand-ins write into.
#[derive(Default)]
pub(crate) struct Counter(Mutex<Writes>);

impl Counter {
    pub(crate) fn count(&self, verb: Verb, resource: &str) {
        let mut w = self.0.lock().unwrap_or_else(|p| p.into_inner());
        *w.counts
            .entry(Write {
                verb,
                resource: resource.to_string(),
            })
            .or_default() += 1;
    }

    pub(crate) fn snapshot(&self) -> Writes {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_by_verb_and_resource_and_differences() {
        let c = Counter::default();
        c.count(Verb::Create, "pods");
        let before = c.snapshot();
        c.count(Verb::Create, "pods");
        c.count(Verb::Patch, "pods/status");
        c.count(Verb::Delete, "pods");
        let now = c.snapshot();
        assert_eq!(now.get(Verb::Create, "pods"), 2);
        assert_eq!(now.on("pods"), 3);
        assert_eq!(now.total(), 4);
        let after = now.since(&before);
        assert_eq!(after.total(), 3);
        assert_eq!(after.get(Verb::Create, "pods"), 1);
        let printed = now.to_string();
        assert!(printed.contains("pods/status"), "{printed}");
        assert!(
            printed
                .lines()
                .last()
                .is_some_and(|l| l.contains("total") && l.ends_with('4'))
        );
    }
}
