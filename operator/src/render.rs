//! `sluice-operator render FILE`: the objects the operator would create for the HookChains in a
//! file, as multi-document YAML, built by the same functions the reconciler uses. A chain whose
//! spec or hook code is invalid gets no pods (as in a cluster): its problems go to the error list.

use crate::reconcile::build::{self, Settings};
use crate::reconcile::validate::{self, CapabilityState};
use sluice_crds::manifest::{self, Object};
use std::path::Path;

/// What render produced: the YAML of every object, and every problem as `file:line: message`.
#[derive(Debug, Default)]
pub struct Rendered {
    pub yaml: String,
    pub problems: Vec<String>,
}

fn push<T: serde::Serialize>(
    out: &mut String,
    object: &T,
) -> Result<(), serde_saphyr::SerializeError> {
    out.push_str("---\n");
    out.push_str(&manifest::to_yaml(object)?);
    Ok(())
}

pub fn render(file: &Path, settings: &Settings) -> Rendered {
    let mut r = Rendered::default();
    let text = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) => {
            r.problems
                .push(format!("{}: cannot read: {e}", file.display()));
            return r;
        }
    };
    for doc in manifest::parse(file, &text) {
        let located = match doc {
            Ok(l) => l,
            Err(e) => {
                r.problems.push(e.to_string());
                continue;
            }
        };
        let Object::HookChain(mut chain) = located.value else {
            continue;
        };
        chain.metadata.namespace = Some(manifest::namespace_of(&chain.metadata));
        let name = chain.metadata.name.clone().unwrap_or_default();
        let ns = chain.metadata.namespace.clone().unwrap_or_default();
        // Capabilities live in the cluster, not necessarily in this file: they are not judged here.
        let verdict = validate::verdict(
            &name,
            &chain.spec,
            &ns,
            &validate::check_code(&chain.spec),
            |_| CapabilityState::Valid,
        );
        let mut objects = String::new();
        // A name that is no valid label value makes the policy's selector invalid too.
        let mut result = if validate::name_problem(&name).is_none() {
            push(&mut objects, &build::network_policy(&chain, settings))
        } else {
            Ok(())
        };
        if verdict.is_invalid() {
            r.problems.push(format!(
                "{}:{}: HookChain {name:?}: {} (no pods would be created)",
                located.file.display(),
                located.line,
                verdict.message
            ));
        } else {
            let pod = build::pod(&chain, settings);
            for _ in 0..chain.spec.pool.warm.min(chain.spec.pool.max) {
                result = result.and_then(|_| push(&mut objects, &pod));
            }
        }
        match result {
            Ok(()) => r.yaml.push_str(&objects),
            Err(e) => r.problems.push(format!(
                "{}:{}: HookChain {name:?}: cannot write YAML: {e}",
                located.file.display(),
                located.line
            )),
        }
    }
    r
}
