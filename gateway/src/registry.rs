//! The registry: every HookChain and Capability the gateway serves, as one immutable snapshot that is
//! swapped atomically when the source (a local directory, or the cluster) changes. A run holds the
//! `Arc<Chain>` it started with, so a swap never changes a run in flight.

use crate::chain::{Chain, ChainKey};
use sluice_crds::manifest::{LoadError, Located, Object};
use sluice_crds::{Capability, CapabilitySpec};
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
    pub chains: HashMap<ChainKey, Arc<Chain>>,
    /// By (namespace, name).
    pub capabilities: HashMap<(String, String), Arc<CapabilityEntry>>,
    /// Objects that could not be served, with file and line where known.
    pub errors: Vec<LoadError>,
}

impl Registry {
    /// Builds a registry from loaded objects. Conflicts (two chains for one target and trigger
    /// point, two capabilities of one name) keep the first in file order and report the rest.
    pub fn build(objects: Vec<Located<Object>>, mut errors: Vec<LoadError>) -> Self {
        let mut chains: BTreeMap<ChainKey, (Arc<Chain>, String)> = BTreeMap::new();
        let mut capabilities = HashMap::new();
        for o in objects {
            let at = |message: String| LoadError {
                file: o.file.clone(),
                line: o.line,
                message,
            };
            match o.value {
                Object::HookChain(hc) => match Chain::from_resource(&hc) {
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
        for (chain, here) in chains.values() {
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
            capabilities,
            errors,
        }
    }

    pub fn chain(&self, key: &ChainKey) -> Option<&Arc<Chain>> {
        self.chains.get(key)
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
