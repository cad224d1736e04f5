//! A HookChain as the engine uses it: the spec plus what is derived from it once (code hash,
//! sandbox limits, normalised settings), shared immutably by every run that started on it.

use crate::sandbox::SandboxSpec;
use serde_json::Value;
use sluice_crds::{HookChain, HookChainSpec, TriggerPoint};

#[derive(Debug)]
pub struct Chain {
    pub namespace: String,
    pub name: String,
    pub spec: HookChainSpec,
    pub code_hash: String,
    pub sandbox: SandboxSpec,
    /// Each hook's settings, `{}` where none were given.
    pub settings: Vec<Value>,
}

/// Chains are found by where they run: (namespace, target, trigger point).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChainKey {
    pub namespace: String,
    pub target: String,
    pub trigger_point: TriggerPoint,
}

impl Chain {
    pub fn from_resource(hc: &HookChain) -> Result<Self, String> {
        let namespace = sluice_crds::manifest::namespace_of(&hc.metadata);
        let name = hc
            .metadata
            .name
            .clone()
            .ok_or("HookChain has no metadata.name")?;
        let problems = sluice_crds::validate::hookchain(&hc.spec);
        if !problems.is_empty() {
            let list: Vec<String> = problems.iter().map(|p| p.to_string()).collect();
            return Err(list.join("; "));
        }
        let sandbox =
            SandboxSpec::for_chain(&namespace, &name, &hc.spec.resources, hc.spec.hooks.len())?;
        let settings = hc
            .spec
            .hooks
            .iter()
            .map(|h| {
                h.settings
                    .clone()
                    .unwrap_or_else(|| Value::Object(Default::default()))
            })
            .collect();
        Ok(Self {
            namespace,
            name,
            code_hash: hc.spec.code_hash(),
            spec: hc.spec.clone(),
            sandbox,
            settings,
        })
    }

    pub fn key(&self) -> ChainKey {
        ChainKey {
            namespace: self.namespace.clone(),
            target: self.spec.target.clone(),
            trigger_point: self.spec.trigger_point,
        }
    }

    /// "namespace/name", as chains are named in logs, metrics and the audit.
    pub fn qualified_name(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}
