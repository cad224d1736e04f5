//! Capabilities: their status (`SchemaValid`, `Ready`) written by server-side apply on the status
//! subresource, and a Warning Event when one turns unusable, so a broken schema or a missing gate
//! shows on the Capability itself, not only on the chains that use it. A Capability is judged as it
//! arrives and whenever another of its namespace changes or goes (it may be one of its gates or
//! dispatch steps). Writes happen only when the status changes: the write's own watch event finds
//! nothing to do.

use super::build::FIELD_MANAGER;
use super::context::Context;
use super::status::{READY, condition};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::core::DeserializeGuard;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use sluice_crds::endpoints::AllowedEndpoints;
use sluice_crds::{Capability, CapabilityStatus};

/// The Capability's spec and its JSON Schema are usable.
pub const SCHEMA_VALID: &str = "SchemaValid";

/// `Ready=False` reason of a Capability whose endpoint the platform does not allow.
pub(crate) const ENDPOINT_NOT_ALLOWED: &str = "EndpointNotAllowed";

type Guarded = DeserializeGuard<Capability>;

/// Judges every Capability of `namespace` in the cache and writes the statuses that changed.
pub async fn check_namespace(ctx: &Context, namespace: &str) {
    // Not before the first full list: a gate not yet listed would look missing.
    if ctx.capabilities.wait_until_ready().await.is_err() {
        return;
    }
    let caps = ctx
        .capabilities
        .state_filter(|c| c.namespace().as_deref() == Some(namespace));
    for cap in caps {
        check(ctx, &cap).await;
    }
}

/// The conditions of `cap`, judged against the Capabilities `others` (its namespace's) and where
/// the platform lets capabilities point.
fn judge(
    cap: &Guarded,
    others: &[std::sync::Arc<Guarded>],
    allowed: &AllowedEndpoints,
    now: Timestamp,
) -> Vec<Condition> {
    let meta = cap.meta();
    let previous: &[Condition] = match &cap.0 {
        Ok(c) => c
            .status
            .as_ref()
            .map(|s| s.conditions.as_slice())
            .unwrap_or_default(),
        Err(_) => &[],
    };
    let generation = meta.generation;
    let cond = |type_: &str, status: &str, reason: &str, message: String| {
        condition(previous, type_, status, reason, message, generation, now)
    };
    let spec = match &cap.0 {
        Ok(c) => &c.spec,
        Err(e) => {
            let why = format!("does not match the Capability schema: {}", e.error);
            return vec![
                cond(SCHEMA_VALID, "False", "InvalidObject", why.clone()),
                cond(READY, "False", "InvalidObject", why),
            ];
        }
    };
    let problems = super::validate::capability_problems(&cap.name_any(), spec);
    if !problems.is_empty() {
        let why = problems.join("; ");
        return vec![
            cond(SCHEMA_VALID, "False", "InvalidSpec", why.clone()),
            cond(READY, "False", "InvalidSpec", why),
        ];
    }
    let valid = cond(
        SCHEMA_VALID,
        "True",
        "Valid",
        "spec and JSON Schema are usable".into(),
    );
    if let Err(why) = allowed.check(&spec.endpoint) {
        return vec![
            valid,
            cond(READY, "False", ENDPOINT_NOT_ALLOWED, why.to_string()),
        ];
    }
    let mut missing = Vec::new();
    let mut invalid = Vec::new();
    for (role, name) in spec
        .gates
        .iter()
        .map(|g| ("gate", g))
        .chain(spec.dispatch.iter().map(|d| ("dispatch step", d)))
    {
        match others.iter().find(|o| o.name_any() == *name) {
            None => missing.push(format!("{role} {name:?}")),
            Some(o) => {
                let usable = match &o.0 {
                    Ok(c) => {
                        super::validate::capability_problems(name, &c.spec).is_empty()
                            && allowed.check(&c.spec.endpoint).is_ok()
                    }
                    Err(_) => false,
                };
                if !usable {
                    invalid.push(format!("{role} {name:?}"));
                }
            }
        }
    }
    let ready = if !missing.is_empty() {
        cond(
            READY,
            "False",
            "UnknownCapability",
            format!(
                "not defined in namespace {}: {}",
                meta.namespace.as_deref().unwrap_or_default(),
                missing.join(", ")
            ),
        )
    } else if !invalid.is_empty() {
        cond(
            READY,
            "False",
            "InvalidCapability",
            format!("invalid: {}", invalid.join(", ")),
        )
    } else {
        cond(
            READY,
            "True",
            "Ready",
            "usable by hooks that declare it".into(),
        )
    };
    vec![valid, ready]
}

/// Whether two condition lists say the same (times aside).
fn same(a: &[Condition], b: &[Condition]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            (
                &x.type_,
                &x.status,
                &x.reason,
                &x.message,
                x.observed_generation,
            ) == (
                &y.type_,
                &y.status,
                &y.reason,
                &y.message,
                y.observed_generation,
            )
        })
}

async fn check(ctx: &Context, cap: &Guarded) {
    let Some(namespace) = cap.namespace() else {
        return;
    };
    let others = ctx
        .capabilities
        .state_filter(|c| c.namespace().as_deref() == Some(namespace.as_str()));
    let conditions = judge(cap, &others, &ctx.allowed_endpoints, Timestamp::now());
    let current: Vec<Condition> = match &cap.0 {
        Ok(c) => c
            .status
            .as_ref()
            .map(|s| s.conditions.clone())
            .unwrap_or_default(),
        Err(_) => Vec::new(),
    };
    if same(&current, &conditions) {
        return;
    }
    let name = cap.name_any();
    let was_valid = current
        .iter()
        .find(|c| c.type_ == SCHEMA_VALID)
        .map(|c| c.status.as_str());
    if let Some(schema) = conditions.iter().find(|c| c.type_ == SCHEMA_VALID)
        && schema.status == "False"
    {
        ctx.publish(
            &cap.object_ref(&()),
            EventType::Warning,
            "InvalidCapability",
            format!("hooks cannot use this capability: {}", schema.message),
        )
        .await;
    } else if was_valid == Some("False") {
        ctx.publish(
            &cap.object_ref(&()),
            EventType::Normal,
            "CapabilityValid",
            "the capability is usable again".into(),
        )
        .await;
    }
    let status = CapabilityStatus {
        observed_generation: cap.meta().generation,
        conditions,
    };
    let patch = serde_json::json!({
        "apiVersion": "sluice.dev/v1alpha1",
        "kind": "Capability",
        "status": status,
    });
    let api: Api<Capability> = Api::namespaced(ctx.client.clone(), &namespace);
    // Best effort: the next change of the namespace's Capabilities (or the resync) retries.
    if let Err(e) = api
        .patch_status(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
    {
        tracing::warn!(capability = %format!("{namespace}/{name}"), error = %sluice_crds::log_text::Escaped(&e.to_string()), "cannot write Capability status");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::error_boundary::InvalidObject;
    use std::sync::Arc;

    fn cap(name: &str, spec: serde_json::Value) -> Arc<Guarded> {
        let mut c = Capability::new(name, serde_json::from_value(spec).unwrap());
        c.metadata.namespace = Some("team".into());
        c.metadata.generation = Some(2);
        Arc::new(DeserializeGuard(Ok(c)))
    }

    fn none() -> AllowedEndpoints {
        AllowedEndpoints::default()
    }

    fn of<'a>(conditions: &'a [Condition], type_: &str) -> (&'a str, &'a str) {
        let c = conditions.iter().find(|c| c.type_ == type_).unwrap();
        (c.status.as_str(), c.reason.as_str())
    }

    #[test]
    fn a_capability_is_ready_when_it_and_its_gates_are_valid() {
        let check = cap(
            "credit.check",
            serde_json::json!({"endpoint": {"builtin": "echo"}}),
        );
        let llm = cap(
            "llm.run",
            serde_json::json!({"endpoint": {"builtin": "echo"}, "gates": ["credit.check"],
                               "schema": {"type": "object"}}),
        );
        let all = vec![check.clone(), llm.clone()];
        let c = judge(&llm, &all, &none(), Timestamp::now());
        assert_eq!(of(&c, SCHEMA_VALID), ("True", "Valid"));
        assert_eq!(of(&c, READY), ("True", "Ready"));
        assert_eq!(c[0].observed_generation, Some(2));

        // Its gate missing: schema valid, not ready, and the message names the gate.
        let c = judge(&llm, std::slice::from_ref(&llm), &none(), Timestamp::now());
        assert_eq!(of(&c, SCHEMA_VALID), ("True", "Valid"));
        assert_eq!(of(&c, READY), ("False", "UnknownCapability"));
        assert!(
            c[1].message.contains("gate \"credit.check\""),
            "{}",
            c[1].message
        );

        // Its gate broken.
        let broken = cap(
            "credit.check",
            serde_json::json!({"endpoint": {"http": "ftp://x"}}),
        );
        let c = judge(&llm, &[llm.clone(), broken], &none(), Timestamp::now());
        assert_eq!(of(&c, READY), ("False", "InvalidCapability"));
    }

    /// The same refusal as the webhook's and `sluice check`'s, as the reason `EndpointNotAllowed`;
    /// a chain's capability gated by it is not usable either.
    #[test]
    fn an_endpoint_outside_the_allowed_ones_is_not_ready() {
        let allowed: AllowedEndpoints = "billing/ledger".parse().unwrap();
        let ledger = cap(
            "credit.check",
            serde_json::json!({"endpoint": {"http": "http://ledger.billing.svc/check"}}),
        );
        let c = judge(
            &ledger,
            std::slice::from_ref(&ledger),
            &allowed,
            Timestamp::now(),
        );
        assert_eq!(of(&c, READY), ("True", "Ready"));
        let elsewhere = cap(
            "credit.check",
            serde_json::json!({"endpoint": {"http": "http://collector.evil.example/"}}),
        );
        let c = judge(
            &elsewhere,
            std::slice::from_ref(&elsewhere),
            &allowed,
            Timestamp::now(),
        );
        assert_eq!(of(&c, SCHEMA_VALID), ("True", "Valid"));
        assert_eq!(of(&c, READY), ("False", ENDPOINT_NOT_ALLOWED));
        let expected = allowed
            .check(&sluice_crds::Endpoint {
                http: Some("http://collector.evil.example/".into()),
                ..Default::default()
            })
            .unwrap_err();
        assert_eq!(c[1].message, expected.to_string());
        let llm = cap(
            "llm.run",
            serde_json::json!({"endpoint": {"builtin": "echo"}, "gates": ["credit.check"]}),
        );
        let c = judge(&llm, &[llm.clone(), elsewhere], &allowed, Timestamp::now());
        assert_eq!(of(&c, READY), ("False", "InvalidCapability"));
    }

    #[test]
    fn a_bad_schema_or_an_unreadable_object_is_not_schema_valid() {
        let bad = cap(
            "llm.run",
            serde_json::json!({"endpoint": {"builtin": "echo"}, "schema": {"type": "no-such-type"}}),
        );
        let c = judge(&bad, std::slice::from_ref(&bad), &none(), Timestamp::now());
        assert_eq!(of(&c, SCHEMA_VALID), ("False", "InvalidSpec"));
        assert_eq!(of(&c, READY), ("False", "InvalidSpec"));
        assert!(c[0].message.contains("spec.schema"), "{}", c[0].message);

        let unreadable: Guarded = DeserializeGuard(Err(InvalidObject {
            error: "spec.timeoutMs: invalid type".into(),
            metadata: Default::default(),
        }));
        let c = judge(&unreadable, &[], &none(), Timestamp::now());
        assert_eq!(of(&c, SCHEMA_VALID), ("False", "InvalidObject"));
    }

    #[test]
    fn an_unchanged_judgement_is_not_written_again() {
        let c = cap("echo", serde_json::json!({"endpoint": {"builtin": "echo"}}));
        let first = judge(&c, std::slice::from_ref(&c), &none(), Timestamp::now());
        let later = judge(
            &c,
            std::slice::from_ref(&c),
            &none(),
            Timestamp::now() + k8s_openapi::jiff::SignedDuration::from_secs(60),
        );
        assert!(same(&first, &later));
        let other = cap(
            "echo",
            serde_json::json!({"endpoint": {"builtin": "echo"}, "gates": ["x"]}),
        );
        assert!(!same(
            &first,
            &judge(
                &other,
                std::slice::from_ref(&other),
                &none(),
                Timestamp::now()
            )
        ));
    }
}
