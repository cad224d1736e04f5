//! A HookChain as the engine uses it: the spec plus what is derived from it once (code hash,
//! sandbox limits, normalised settings), shared immutably by every run that started on it.

use crate::sandbox::SandboxSpec;
use serde_json::Value;
use sluice_crds::validate::Problem;
use sluice_crds::{HookChainSpec, TriggerPoint};

#[derive(Debug)]
pub struct Chain {
    pub namespace: String,
    pub name: String,
    pub spec: HookChainSpec,
    pub code_hash: String,
    pub sandbox: SandboxSpec,
    /// Each hook's settings, `{}` where none were given.
    pub settings: Vec<Value>,
    /// Why a newer version of this chain is not served, when this is the last valid one.
    pub superseded: Option<String>,
    /// Where the chain was read from, and per hook where its code starts there (code line n is
    /// file line `code_lines[i] + n`), so errors can point at the file people edit.
    pub origin: sluice_crds::definition::Origin,
    pub code_lines: Vec<Option<usize>>,
    /// Promotion or rollback ordered by the object's annotations.
    pub orders: sluice_crds::definition::RolloutOrders,
    /// In a cluster: the rollout as the operator directs it.
    pub directed: Option<sluice_crds::definition::Directed>,
    /// Per hook, who signed its code, where the platform requires signed code (`Registry`
    /// verifies before it serves; the audit names them).
    pub signers: Vec<Option<sluice_crds::signing::SignedBy>>,
}

/// Why a HookChain cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    #[error("HookChain has no metadata.name")]
    NoName,
    #[error("{}", .0.iter().map(|p| p.to_string()).collect::<Vec<_>>().join("; "))]
    Invalid(Vec<Problem>),
}

/// Chains are found by where they run: (namespace, target, trigger point).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChainKey {
    pub namespace: String,
    pub target: String,
    pub trigger_point: TriggerPoint,
}

impl Chain {
    /// The chain `namespace/name` with this spec, if the spec passes the semantic rules.
    pub fn new(namespace: &str, name: &str, spec: &HookChainSpec) -> Result<Self, ChainError> {
        if name.is_empty() {
            return Err(ChainError::NoName);
        }
        let problems = sluice_crds::validate::hookchain(spec);
        if !problems.is_empty() {
            return Err(ChainError::Invalid(problems));
        }
        let sandbox = SandboxSpec::for_chain(namespace, name, &spec.resources);
        let settings = spec
            .hooks
            .iter()
            .map(|h| {
                h.settings
                    .clone()
                    .unwrap_or_else(|| Value::Object(Default::default()))
            })
            .collect();
        Ok(Self {
            namespace: namespace.to_string(),
            name: name.to_string(),
            code_hash: spec.code_hash(),
            spec: spec.clone(),
            sandbox,
            settings,
            superseded: None,
            origin: Default::default(),
            code_lines: Vec::new(),
            orders: Default::default(),
            directed: None,
            signers: Vec::new(),
        })
    }

    pub fn key(&self) -> ChainKey {
        ChainKey {
            namespace: self.namespace.clone(),
            target: self.spec.target.clone(),
            trigger_point: self.spec.trigger_point,
        }
    }

    /// Whether a cell opened for `other` runs exactly this chain's hooks (code, settings, actions,
    /// trigger point, failure policy): then it may serve this chain's trigger point.
    pub fn same_hooks(&self, other: &Chain) -> bool {
        std::ptr::eq(self, other)
            || (self.spec.hooks == other.spec.hooks
                && self.spec.trigger_point == other.spec.trigger_point
                && self.spec.failure_policy == other.spec.failure_policy)
    }

    /// The revision of the hooks: the code hash's digits, as status, annotations and the audit
    /// name it.
    pub fn revision(&self) -> &str {
        self.code_hash
            .strip_prefix("sha256:")
            .unwrap_or(&self.code_hash)
    }

    /// Who signed hook `index`'s code, when the platform requires signed code here.
    pub fn signer(&self, index: usize) -> Option<&sluice_crds::signing::SignedBy> {
        self.signers.get(index).and_then(Option::as_ref)
    }

    /// "namespace/name", as chains are named in logs, metrics and the audit.
    pub fn qualified_name(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}
