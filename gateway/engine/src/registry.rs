//! The registry: every HookChain and Capability the gateway serves, as one immutable snapshot that is
//! swapped atomically when the source (a local directory, or the cluster) changes. A run holds the
//! `Arc<Chain>` it started with, so a swap never changes a run in flight.
//!
//! Enforced chains of the platform namespace are kept apart as baselines, one per trigger point:
//! they run before the tenant's chain for every target (see `pipeline.rs`), and are never found as a
//! tenant's own chain.

use crate::chain::{Chain, ChainKey};
use crate::log_text::Escaped;
use sluice_crds::definition::{Definition, NotServed, Origin, Spec};
use sluice_crds::signing::Policy;
use sluice_crds::{CapabilitySpec, TriggerPoint};
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
    chains: HashMap<ChainKey, Arc<Chain>>,
    /// Enforced baseline chains of the platform namespace, by trigger point.
    baselines: HashMap<TriggerPoint, Arc<Chain>>,
    /// By (namespace, name).
    capabilities: HashMap<(String, String), Arc<CapabilityEntry>>,
    /// Objects that could not be served, with file and line where known.
    errors: Vec<NotServed>,
}

impl Registry {
    /// Builds a registry from loaded objects. Conflicts (two chains for one target and trigger
    /// point, two baselines for one trigger point, two capabilities of one name) keep the first in
    /// file order and report the rest. An enforced chain outside `platform_namespace` is not served:
    /// a tenant cannot make its own chain a baseline, and serving it as an ordinary chain would hide
    /// that its author expected more.
    ///
    /// Where `signing` requires signed code, a chain is served only when every hook of it (and of
    /// the live revision a cluster's rollout keeps) verifies against the trusted signers now: an
    /// object written past the webhook, or signed by a key the platform no longer trusts, never
    /// runs.
    pub fn build_for(
        platform_namespace: &str,
        definitions: Vec<Definition>,
        mut errors: Vec<NotServed>,
        signing: &Policy,
    ) -> Self {
        let mut chains: BTreeMap<ChainKey, (Arc<Chain>, Origin)> = BTreeMap::new();
        let mut baselines: BTreeMap<TriggerPoint, (Arc<Chain>, Origin)> = BTreeMap::new();
        let mut capabilities = HashMap::new();
        for d in definitions {
            let at = |message: String| NotServed {
                origin: d.origin.clone(),
                message,
            };
            match &d.spec {
                Spec::HookChain(spec) => {
                    let live = d.directed.as_ref().and_then(|x| x.live.as_deref());
                    let signers = match signing.check(&d.namespace, &d.name, spec).and_then(|s| {
                        live.map_or(Ok(()), |l| {
                            signing.check(&d.namespace, &d.name, l).map(drop)
                        })
                        .map(|()| s)
                    }) {
                        Ok(signers) => signers,
                        Err(refused) => {
                            errors
                                .push(at(format!("HookChain {:?}: {refused}; not served", d.name)));
                            continue;
                        }
                    };
                    match Chain::new(&d.namespace, &d.name, spec).map(|mut c| {
                        c.signers = signers;
                        c.superseded = d.superseded.clone();
                        c.origin = d.origin.clone();
                        c.code_lines = d.code_lines.clone();
                        c.orders = d.orders.clone();
                        c.directed = d.directed.clone();
                        c
                    }) {
                        Ok(chain) if chain.spec.enforced => {
                            let tp = chain.spec.trigger_point;
                            let here = d.origin.clone();
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
                            let here = d.origin.clone();
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
                    }
                }
                Spec::Capability(spec) => {
                    let entry = CapabilityEntry {
                        namespace: d.namespace.clone(),
                        name: d.name.clone(),
                        spec: (**spec).clone(),
                    };
                    if let Some(schema) = &entry.spec.schema
                        && let Err(e) = sluice_crds::schema::check_schema(schema)
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
            errors.push(NotServed {
                origin: Origin::default(),
                message: format!("Capability {:?} in {}: gate or dispatch step {step:?} does not exist; not served", key.1, key.0),
            });
        }
        // A hook may list a capability that is applied later; it is served, and reported meanwhile.
        for (chain, here) in chains.values().chain(baselines.values()) {
            for hook in &chain.spec.hooks {
                for name in &hook.capabilities {
                    if !capabilities.contains_key(&(chain.namespace.clone(), name.clone())) {
                        errors.push(NotServed {
                            origin: here.clone(),
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
            capabilities,
            errors,
        }
    }

    /// Chains served from their last valid version because the newest one fails its checks.
    pub fn superseded(&self) -> usize {
        self.all_chains().filter(|c| c.superseded.is_some()).count()
    }

    /// What could not be served, with where it came from and why.
    pub fn errors(&self) -> &[NotServed] {
        &self.errors
    }

    /// Logs what is served and every error, after a (re)load.
    pub fn log_summary(&self) {
        // Errors quote what tenants wrote (names, targets, file names): escaped, like the list.
        for e in &self.errors {
            tracing::error!("{}", Escaped(&e.to_string()));
        }
        let mut chains: Vec<String> = self
            .all_chains()
            .map(|c| {
                format!(
                    "{} ({} at {}{})",
                    c.qualified_name(),
                    c.spec.target,
                    c.spec.trigger_point,
                    if c.spec.enforced { ", enforced" } else { "" }
                )
            })
            .collect();
        chains.sort();
        tracing::info!(
            chains = chains.len(),
            capabilities = self.capabilities.len(),
            errors = self.errors.len(),
            superseded = self.superseded(),
            "registry loaded: {}",
            Escaped(&chains.join(", "))
        );
    }

    pub fn chain(&self, key: &ChainKey) -> Option<&Arc<Chain>> {
        self.chains.get(key)
    }

    /// Whether a tenant chain of `namespace` serves `target` at any trigger point (baselines,
    /// which serve every target, do not count).
    pub fn serves_target(&self, namespace: &str, target: &str) -> bool {
        TriggerPoint::ALL.iter().any(|tp| {
            self.chains.contains_key(&ChainKey {
                namespace: namespace.to_string(),
                target: target.to_string(),
                trigger_point: *tp,
            })
        })
    }

    /// The enforced baseline at a trigger point, if the platform declared one.
    pub fn baseline(&self, tp: TriggerPoint) -> Option<&Arc<Chain>> {
        self.baselines.get(&tp)
    }

    /// Every chain served, baselines included: each needs a warm pool.
    pub fn all_chains(&self) -> impl Iterator<Item = &Arc<Chain>> {
        self.chains.values().chain(self.baselines.values())
    }

    /// Every Capability served, in no particular order.
    pub fn capabilities(&self) -> impl Iterator<Item = &Arc<CapabilityEntry>> {
        self.capabilities.values()
    }

    pub fn capability(&self, namespace: &str, name: &str) -> Option<&Arc<CapabilityEntry>> {
        self.capabilities
            .get(&(namespace.to_string(), name.to_string()))
    }

    /// The Capabilities of one namespace.
    pub fn capabilities_in<'a>(
        &'a self,
        namespace: &'a str,
    ) -> impl Iterator<Item = &'a Arc<CapabilityEntry>> + 'a {
        self.capabilities
            .iter()
            .filter(move |((ns, _), _)| ns == namespace)
            .map(|(_, c)| c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chain(name: &str, ns: &str, target: &str, enforced: bool) -> Definition {
        let spec = json!({"target": target, "triggerPoint": "before_model", "enforced": enforced,
            "hooks": [{"name": "h", "action": "block", "code": "def execute(c, s): return {\"action\": \"pass\"}"}]});
        Definition {
            origin: Origin {
                file: "x.yaml".into(),
                line: 1,
            },
            namespace: ns.into(),
            name: name.into(),
            spec: Spec::HookChain(Box::new(
                serde_json::from_value(spec).expect("a valid spec"),
            )),
            superseded: None,
            code_lines: Vec::new(),
            orders: Default::default(),
            directed: None,
        }
    }

    fn build(platform: &str, definitions: Vec<Definition>) -> Registry {
        Registry::build_for(platform, definitions, vec![], &Policy::default())
    }

    #[test]
    fn enforced_chains_of_the_platform_namespace_are_baselines_and_only_those() {
        let r = build(
            "platform",
            vec![
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
        let r = build("sluice-system", vec![chain("base", "platform", "*", true)]);
        assert!(r.baselines.is_empty());
        assert_eq!(r.errors.len(), 1);
    }
}
