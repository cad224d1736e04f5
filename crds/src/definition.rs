//! HookChains and Capabilities as the gateway serves them: namespace, name and spec, without the
//! Kubernetes envelope, each with where it came from (a file and line in local mode, the object's
//! kind and name in kube mode). What `manifest` reads and what the kube watches list both become
//! these, so the engine that serves them needs neither YAML nor kube.

use crate::{CapabilitySpec, HookChainSpec};
use std::fmt;
use std::path::PathBuf;

/// Where a definition came from. `line` is 0 where there is no line (a cluster object).
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Origin {
    pub file: PathBuf,
    pub line: usize,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.file.display(), self.line)
    }
}

/// The spec of a served resource.
#[derive(Clone, Debug, PartialEq)]
pub enum Spec {
    HookChain(Box<HookChainSpec>),
    Capability(Box<CapabilitySpec>),
}

/// One resource to serve.
#[derive(Clone, Debug, PartialEq)]
pub struct Definition {
    pub origin: Origin,
    pub namespace: String,
    /// `metadata.name`; empty when the object had none.
    pub name: String,
    pub spec: Spec,
    /// Set when this is not the newest version of the resource but the last one that passed its
    /// checks: says why the newest is not served. Runs on it say so in their audit.
    pub superseded: Option<String>,
    /// Per hook, where its code sits in `origin.file`: code line n is file line `code_lines[i] + n`.
    /// Empty where unknown (a cluster object).
    pub code_lines: Vec<Option<usize>>,
    /// What the object's annotations order of a rollout in progress (`sluice.dev/promote`,
    /// `sluice.dev/rollback`).
    pub orders: RolloutOrders,
    /// In a cluster: the rollout as the operator keeps it (`status.rollout`) and, when the live
    /// revision is not the spec's, the live revision's spec (from its ControllerRevision). None in
    /// local mode, where the gateway keeps the rollout itself.
    pub directed: Option<Directed>,
}

/// A rollout directed by the cluster's operator.
#[derive(Clone, Debug, PartialEq)]
pub struct Directed {
    pub state: crate::rollout::RolloutState,
    /// The live revision's spec, when it is not the spec's own; None when it could not be read
    /// (then the gateway serves what it served before, or the spec).
    pub live: Option<Box<HookChainSpec>>,
}

/// The annotation that promotes a rollout's candidate, naming it (a prefix of its revision, as
/// status and the audit show it): an annotation left over from an earlier rollout names a revision
/// that is not the candidate and does nothing.
pub const PROMOTE_ANNOTATION: &str = "sluice.dev/promote";
/// The annotation that rolls a rollout's candidate back, naming it likewise.
pub const ROLLBACK_ANNOTATION: &str = "sluice.dev/rollback";

/// Promotion and rollback ordered by hand, each naming the revision it is for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RolloutOrders {
    pub promote: Option<String>,
    pub rollback: Option<String>,
}

impl RolloutOrders {
    /// Reads the two annotations; blank values are no order.
    pub fn from_annotations(
        annotations: Option<&std::collections::BTreeMap<String, String>>,
    ) -> Self {
        let get = |key: &str| {
            annotations
                .and_then(|a| a.get(key))
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        Self {
            promote: get(PROMOTE_ANNOTATION),
            rollback: get(ROLLBACK_ANNOTATION),
        }
    }
}

/// A resource that is not served, with where it came from and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{origin}: {message}")]
pub struct NotServed {
    pub origin: Origin,
    pub message: String,
}

#[cfg(feature = "kube")]
mod from_manifest {
    use super::*;
    use crate::manifest::{LoadError, Located, Object, namespace_of};

    impl From<Located<Object>> for Definition {
        fn from(o: Located<Object>) -> Self {
            let origin = Origin {
                file: o.file,
                line: o.line,
            };
            let (meta, spec) = match o.value {
                Object::HookChain(hc) => (hc.metadata, Spec::HookChain(Box::new(hc.spec))),
                Object::Capability(cap) => (cap.metadata, Spec::Capability(Box::new(cap.spec))),
            };
            Self {
                origin,
                namespace: namespace_of(&meta),
                orders: RolloutOrders::from_annotations(meta.annotations.as_ref()),
                directed: None,
                name: meta.name.unwrap_or_default(),
                spec,
                superseded: None,
                code_lines: Vec::new(),
            }
        }
    }

    impl From<LoadError> for NotServed {
        fn from(e: LoadError) -> Self {
            Self {
                origin: Origin {
                    file: e.file,
                    line: e.line,
                },
                message: e.message,
            }
        }
    }
}
