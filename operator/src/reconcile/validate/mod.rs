//! Stage 2, validate: the chain's verdict (`CodeValid`) from the semantic rules, the hook code
//! analysis (cached by code hash: python3 runs once per version of a chain's hooks) and the
//! capabilities its hooks name. Never fails: a checker that cannot run makes the verdict Unknown.

pub mod rules;

pub use rules::*;

use super::context::{Context, lock};
use crate::reconcile::status::Verdict;
use kube::Resource;
use kube::core::DeserializeGuard;
use sluice_crds::HookChain;

pub(crate) async fn validate(
    chain: &HookChain,
    namespace: &str,
    name: &str,
    ctx: &Context,
) -> Verdict {
    let code = code_check(chain, ctx).await;
    let verdict = rules::verdict(name, &chain.spec, namespace, &code, |cap| {
        capability_state(ctx, namespace, cap)
    });
    let verdict = rules::within_cpu_limit(verdict, &chain.spec, ctx.settings.sandbox_cpu_limit);
    let policy = crate::signing().map(|s| s.current());
    rules::signed(verdict, namespace, name, &chain.spec, policy.as_deref())
}

async fn code_check(chain: &HookChain, ctx: &Context) -> rules::CodeCheck {
    let hash = chain.spec.code_hash();
    if let Some(hit) = lock(&ctx.code_checks).get(&hash) {
        return Ok(hit.clone());
    }
    let spec = chain.spec.clone();
    let result = tokio::task::spawn_blocking(move || rules::check_code(&spec))
        .await
        .unwrap_or_else(|e| Err(e.into()));
    if let Ok(found) = &result {
        let mut cache = lock(&ctx.code_checks);
        // Bounded: hook versions come and go; losing the cache only costs a python3 run.
        if cache.len() > 1000 {
            cache.clear();
        }
        cache.insert(hash, found.clone());
    }
    result
}

fn capability_state(ctx: &Context, namespace: &str, name: &str) -> CapabilityState {
    let found = ctx.capabilities.find(|c| {
        c.meta().namespace.as_deref() == Some(namespace) && c.meta().name.as_deref() == Some(name)
    });
    match found.as_deref() {
        None => CapabilityState::Missing,
        Some(DeserializeGuard(Err(e))) => {
            CapabilityState::Invalid(format!("does not match the Capability schema: {}", e.error))
        }
        Some(DeserializeGuard(Ok(cap))) => {
            let mut problems = rules::capability_problems(name, &cap.spec);
            problems.extend(
                ctx.allowed_endpoints
                    .check(&cap.spec.endpoint)
                    .err()
                    .map(|refused| refused.to_string()),
            );
            if problems.is_empty() {
                CapabilityState::Valid
            } else {
                CapabilityState::Invalid(problems.join("; "))
            }
        }
    }
}
