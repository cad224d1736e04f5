//! The registry: every HookChain and Capability the gateway serves, as one immutable snapshot that is
//! swapped atomically when the source (a local directory, or the cluster) changes. A run holds the
//! `Arc<Chain>` it started with, so a swap never changes a run in flight.
//!
//! Enforced chains of the platform namespace are kept apart as baselines, one per trigger point:
//! they run before the tenant's chain for every target (see `engine.rs`), and are never found as a
//! tenant's own chain.

use crate::chain::{Chain, ChainKey};
use sluice_crds::manifest::{LoadError, Located, Object};
use sluice_crds::{Capability, CapabilitySpec, TriggerPoint};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

#[derive(Debug)]
pub struct CapabilityEntry {
    pub namespace: String,
    pub name: String,
    pub spec: CapabilitySpec,
}

#[derive(Debug, Default)]
pub struct Registry {
    /// Tenant chains, by where they run.
    pub chains: HashMap<ChainKey, Arc<Chain>>,
    /// Enforced baseline chains of the platform namespace, by trigger point.
    pub baselines: HashMap<TriggerPoint, Arc<Chain>>,
    /// The namespace whose enforced chains are baselines.
    pub platform_namespace: String,
    /// By (namespace, name).
    pub capabilities: HashMap<(String, String), Arc<CapabilityEntry>>,
    /// Objects that could not be served, with file and line where known.
    pub errors: Vec<LoadError>,
}

impl Registry {
    /// Builds a registry from loaded objects with the default platform namespace.
    pub fn build(objects: Vec<Located<Object>>, errors: Vec<LoadError>) -> Self {
        Self::build_for(sluice_crds::DEFAULT_PLATFORM_NAMESPACE, objects, errors)
    }

    /// Builds a registry from loaded objects. Conflicts (two chains for one target and trigger
    /// point, two baselines for one trigger point, two capabilities of one name) keep the first in
    /// file order and report the rest. An enforced chain outside `platform_namespace` is not served:
    /// a tenant cannot make its own chain a baseline, and serving it as an ordinary chain would hide
    /// that its author expected more.
    pub fn build_for(
        platform_namespace: &str,
        objects: Vec<Located<Object>>,
        mut errors: Vec<LoadError>,
    ) -> Self {
        let mut chains: BTreeMap<ChainKey, (Arc<Chain>, String)> = BTreeMap::new();
        let mut baselines: BTreeMap<TriggerPoint, (Arc<Chain>, String)> = BTreeMap::new();
        let mut capabilities = HashMap::new();
        for o in objects {
            let at = |message: String| LoadError {
                file: o.file.clone(),
                line: o.line,
                message,
            };
            match o.value {
                Object::HookChain(hc) => match Chain::from_resource(&hc) {
                    Ok(chain) if chain.spec.enforced => {
                        let tp = chain.spec.trigger_point;
                        let here = format!("{}:{}", o.file.display(), o.line);
                        if chain.namespace != platform_namespace {
                            errors.push(at(format!(
                                "HookChain {:?}: spec.enforced is honoured only in the platform namespace {platform_namespace:?}, not in {:?}; not served",
                                chain.name, chain.namespace
                            )));
                        } else if let Some((other, there)) = baselines.get(&tp) {
                            errors.push(at(format!(
                                "HookChain {:?} is a second enforced baseline at {tp}, like {:?} ({there}); only the first is served (put both chains' hooks in one)",
                                chain.name, other.name
                            )));
                        } else {
                            baselines.insert(tp, (Arc::new(chain), here));
                        }
                    }
                    Ok(chain) => {
                        let key = chain.key();
                        let here = format!("{}:{}", o.file.display(), o.line);
                        if let Some((other, there)) = chains.get(&key) {
                            errors.push(at(format!(
                                "HookChain {:?} serves {}/{} at {} like {:?} ({there}); only the first is served",
                                chain.name, key.namespace, key.target, key.trigger_point, other.name
                            )));
                        } else {
                            chains.insert(key, (Arc::new(chain), here));
                        }
                    }
                    Err(e) => errors.push(at(format!("HookChain: {e}"))),
                },
                Object::Capability(cap) => {
                    let entry = capability_entry(&cap);
                    if let Some(schema) = &entry.spec.schema
                        && let Err(e) = crate::endpoint::check_schema(schema)
                    {
                        errors.push(at(format!("Capability {:?}: spec.schema: {e}", entry.name)));
                        continue;
                    }
                    let key = (entry.namespace.clone(), entry.name.clone());
                    match capabilities.entry(key) {
                        std::collections::hash_map::Entry::Occupied(o) => errors.push(at(format!(
                            "Capability {:?} is defined twice in {}; only the first is served",
                            o.key().1,
                            o.key().0
                        ))),
                        std::collections::hash_map::Entry::Vacant(v) => {
                            v.insert(Arc::new(entry));
                        }
                    }
                }
            }
        }
        // Gates and dispatch steps must name capabilities that exist in the same namespace.
        let mut broken = Vec::new();
        for ((ns, name), cap) in &capabilities {
            for step in cap.spec.gates.iter().chain(&cap.spec.dispatch) {
                if !capabilities.contains_key(&(ns.clone(), step.clone())) {
                    broken.push(((ns.clone(), name.clone()), step.clone()));
                }
            }
        }
        for (key, step) in broken {
            capabilities.remove(&key);
            errors.push(LoadError {
                file: Default::default(),
                line: 0,
                message: format!("Capability {:?} in {}: gate or dispatch step {step:?} does not exist; not served", key.1, key.0),
            });
        }
        // A hook may list a capability that is applied later; it is served, and reported meanwhile.
        for (chain, here) in chains.values().chain(baselines.values()) {
            for hook in &chain.spec.hooks {
                for name in &hook.capabilities {
                    if !capabilities.contains_key(&(chain.namespace.clone(), name.clone())) {
                        let (file, line) = here
                            .rsplit_once(':')
                            .map(|(f, l)| (f.into(), l.parse().unwrap_or(0)))
                            .unwrap_or_default();
                        errors.push(LoadError {
                            file,
                            line,
                            message: format!(
                                "HookChain {:?}: hook {:?} lists capability {name:?}, which does not exist in {}; its host_calls will fail until it does",
                                chain.name, hook.name, chain.namespace
                            ),
                        });
                    }
                }
            }
        }
        Self {
            chains: chains.into_iter().map(|(k, (c, _))| (k, c)).collect(),
            baselines: baselines.into_iter().map(|(k, (c, _))| (k, c)).collect(),
            platform_namespace: platform_namespace.to_string(),
            capabilities,
            errors,
        }
    }

    pub fn chain(&self, key: &ChainKey) -> Option<&Arc<Chain>> {
        self.chains.get(key)
    }

    /// The enforced baseline at a trigger point, if the platform declared one.
    pub fn baseline(&self, tp: TriggerPoint) -> Option<&Arc<Chain>> {
        self.baselines.get(&tp)
    }

    /// Every chain served, baselines included: each needs a warm pool.
    pub fn all_chains(&self) -> impl Iterator<Item = &Arc<Chain>> {
        self.chains.values().chain(self.baselines.values())
    }

    pub fn capability(&self, namespace: &str, name: &str) -> Option<&Arc<CapabilityEntry>> {
        self.capabilities
            .get(&(namespace.to_string(), name.to_string()))
    }
}

fn capability_entry(cap: &Capability) -> CapabilityEntry {
    CapabilityEntry {
        namespace: sluice_crds::manifest::namespace_of(&cap.metadata),
        name: cap.metadata.name.clone().unwrap_or_default(),
        spec: cap.spec.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(name: &str, ns: &str, target: &str, enforced: bool) -> String {
        format!(
            "apiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  target: {target:?}\n  triggerPoint: before_model\n  enforced: {enforced}\n  hooks:\n    - {{name: h, action: block, code: 'def execute(c, s): return {{\"action\": \"pass\"}}'}}\n"
        )
    }

    fn build(platform: &str, docs: &[String]) -> Registry {
        let text = docs.join("---\n");
        let (objects, errors): (Vec<_>, Vec<_>) =
            sluice_crds::manifest::parse("x.yaml".as_ref(), &text)
                .into_iter()
                .partition(Result::is_ok);
        let errors: Vec<LoadError> = errors.into_iter().filter_map(Result::err).collect();
        assert!(errors.is_empty(), "{errors:?}");
        Registry::build_for(platform, objects.into_iter().flatten().collect(), vec![])
    }

    #[test]
    fn enforced_chains_of_the_platform_namespace_are_baselines_and_only_those() {
        let r = build(
            "platform",
            &[
                chain("base", "platform", "*", true),
                chain("tenant-base", "team-a", "*", true),
                chain("second", "platform", "*", true),
                chain("own", "team-a", "bot", false),
            ],
        );
        let base = r.baseline(TriggerPoint::BeforeModel).expect("a baseline");
        assert_eq!(base.qualified_name(), "platform/base");
        assert_eq!(r.chains.len(), 1, "the baseline is not a tenant chain");
        assert_eq!(r.all_chains().count(), 2, "pools cover the baseline too");
        let messages: Vec<&str> = r.errors.iter().map(|e| e.message.as_str()).collect();
        assert_eq!(messages.len(), 2, "{messages:?}");
        assert!(
            messages[0].contains("\"tenant-base\"")
                && messages[0].contains("only in the platform namespace"),
            "{messages:?}"
        );
        assert!(
            messages[1].contains("\"second\"") && messages[1].contains("second enforced baseline"),
            "{messages:?}"
        );
        // The same files under another platform namespace: no baseline at all.
        let r = build("sluice-system", &[chain("base", "platform", "*", true)]);
        assert!(r.baselines.is_empty());
        assert_eq!(r.errors.len(), 1);
    }
}
