//! One AdmissionReview judged: a HookChain or Capability being created or updated is admitted only
//! when `sluice check`'s rules find nothing wrong with it, and refused with every problem, worded as
//! `sluice check` words it (the same functions of `sluice_crds`: the CRD schema with unknown fields
//! and "did you mean", the semantic rules, the hook code analysis, the capability schema). What
//! `check` reports as a likely mistake rather than a failure comes back as a warning.
//!
//! Rules that need other objects (a capability a hook names, two chains for one target) are not
//! judged here: objects are often applied in any order, and the operator's `CodeValid` condition
//! and the gateway's registry report them.

use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use serde_json::Value;
use sluice_crds::code::FindingKind;
use sluice_crds::manifest::{self, Object};
use std::path::Path;

/// What the judge needs besides the request.
#[derive(Clone, Debug)]
pub struct Judge {
    /// What parses hook code: the sandboxes' CPython (the cell beside the operator), or a python3.
    pub python: sluice_crds::code::Interpreter,
    /// Where enforced (baseline) chains are honoured and capabilities may point.
    pub rules: manifest::PlatformRules,
}

/// A body that is not an AdmissionReview at all: answered with HTTP 400, as there is no request
/// uid to answer.
#[derive(Debug, thiserror::Error)]
pub enum MalformedReview {
    #[error("the body is not JSON: {0}")]
    NotJson(serde_json::Error),
    #[error(
        "the body is not an admission.k8s.io/v1 AdmissionReview (apiVersion {api_version:?}, kind {kind:?})"
    )]
    NotAReview { api_version: String, kind: String },
    #[error("the AdmissionReview has no request.uid")]
    NoUid,
}

/// Longest refusal message; the API server passes it to kubectl whole, so keep it readable.
const MAX_MESSAGE: usize = 16 << 10;

/// Judges the AdmissionReview in `body` and returns the AdmissionReview to answer with. Blocking:
/// hook code is parsed by python.
pub fn review(
    body: &[u8],
    judge: &Judge,
) -> Result<AdmissionReview<DynamicObject>, MalformedReview> {
    let raw: Value = serde_json::from_slice(body).map_err(MalformedReview::NotJson)?;
    let api_version = raw["apiVersion"].as_str().unwrap_or_default();
    let kind = raw["kind"].as_str().unwrap_or_default();
    if api_version != "admission.k8s.io/v1" || kind != "AdmissionReview" {
        return Err(MalformedReview::NotAReview {
            api_version: api_version.into(),
            kind: kind.into(),
        });
    }
    let uid = raw["request"]["uid"]
        .as_str()
        .filter(|u| !u.is_empty())
        .ok_or(MalformedReview::NoUid)?
        .to_string();
    // The uid is known from here on: every answer, a refusal of an unreadable request included,
    // carries it, so the API server can match it.
    let request: AdmissionRequest<DynamicObject> =
        match serde_json::from_value::<AdmissionReview<DynamicObject>>(raw.clone())
            .map_err(|e| e.to_string())
            .and_then(|r| {
                r.try_into()
                    .map_err(|e: kube::core::admission::ConvertAdmissionReviewError| e.to_string())
            }) {
            Ok(r) => r,
            Err(e) => {
                let mut response = AdmissionResponse::invalid(format!(
                    "sluice admission webhook: cannot read the AdmissionReview's request: {e}"
                ));
                response.uid = uid;
                response.result.code = 400;
                return Ok(response.into_review());
            }
        };
    let response = AdmissionResponse::from(&request);
    let verdict = judge_request(&request, &raw["request"]["object"], judge);
    let response = match verdict {
        Verdict::Admit { warnings } => {
            let mut response = response;
            response.warnings = (!warnings.is_empty()).then_some(warnings);
            response
        }
        Verdict::Refuse { problems, warnings } => {
            let mut response = response.deny(refusal(&request, &problems));
            response.result.code = 422;
            response.result.reason = "Invalid".into();
            response.warnings = (!warnings.is_empty()).then_some(warnings);
            response
        }
    };
    Ok(response.into_review())
}

/// The judgement of one request.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    Admit {
        warnings: Vec<String>,
    },
    Refuse {
        problems: Vec<String>,
        warnings: Vec<String>,
    },
}

fn judge_request(
    request: &AdmissionRequest<DynamicObject>,
    object: &Value,
    judge: &Judge,
) -> Verdict {
    let ours = request.kind.group == "sluice.dev"
        && matches!(request.kind.kind.as_str(), "HookChain" | "Capability");
    if !ours || !matches!(request.operation, Operation::Create | Operation::Update) {
        // Deletes, and kinds the webhook is not configured for, are not its business.
        return Verdict::Admit { warnings: vec![] };
    }
    if request.operation == Operation::Update && object.get("spec") == request_old_spec(request) {
        // Labels, annotations, finalizers (a deletion's cleanup included): the spec that was
        // admitted (or was there before the webhook) is unchanged, and refusing would only block
        // cleanup. A deletion under way is no reason to skip more: a finalizer can hold an object
        // there for ever, and its spec still serves until it is gone.
        return Verdict::Admit { warnings: vec![] };
    }
    if !object.is_object() {
        return Verdict::Refuse {
            problems: vec!["the request carries no object to check".into()],
            warnings: vec![],
        };
    }
    let mut object = object.clone();
    // The API server fills metadata.namespace; a review without it is judged in the request's.
    if object["metadata"]["namespace"]
        .as_str()
        .is_none_or(str::is_empty)
        && let (Some(ns), Some(meta)) = (
            request.namespace.as_deref(),
            object.get_mut("metadata").and_then(Value::as_object_mut),
        )
    {
        meta.insert("namespace".into(), Value::String(ns.into()));
    }
    judge_object(&object, judge)
}

fn request_old_spec(request: &AdmissionRequest<DynamicObject>) -> Option<&Value> {
    request.old_object.as_ref().and_then(|o| o.data.get("spec"))
}

/// Every problem `sluice check` finds in one object (a HookChain or Capability as JSON), and the
/// likely mistakes it reports, which are warnings here.
pub fn judge_object(object: &Value, judge: &Judge) -> Verdict {
    let mut problems = Vec::new();
    let mut warnings = Vec::new();
    // The loader reads YAML with lines; JSON written out as YAML is the same object.
    match manifest::to_yaml(object) {
        Err(e) => problems.push(format!("the object cannot be read: {e}")),
        Ok(text) => {
            for loaded in manifest::parse(Path::new("<admission>"), &text) {
                match loaded {
                    Err(e) => problems.push(e.message),
                    Ok(o) => {
                        problems.extend(manifest::object_problems(&o.value, &judge.rules));
                        if let Object::HookChain(hc) = &o.value
                            && let Some(p) = hc
                                .metadata
                                .name
                                .as_deref()
                                .and_then(crate::reconcile::validate::name_problem)
                        {
                            problems.push(format!("HookChain: {p}"));
                        }
                    }
                }
            }
        }
    }
    match sluice_crds::code::document_findings(&judge.python, object) {
        Ok(found) => {
            for f in found {
                match f.kind {
                    FindingKind::Problem | FindingKind::UndeclaredSetting { subscript: true } => {
                        problems.push(f.message)
                    }
                    FindingKind::Hint | FindingKind::UndeclaredSetting { subscript: false } => {
                        warnings.push(f.message)
                    }
                }
            }
        }
        // Code that cannot be checked is not admitted: it could not be served either.
        Err(e) => problems.push(format!("{e}; the hook code was not checked")),
    }
    if problems.is_empty() {
        Verdict::Admit { warnings }
    } else {
        Verdict::Refuse { problems, warnings }
    }
}

fn refusal(request: &AdmissionRequest<DynamicObject>, problems: &[String]) -> String {
    let mut message = format!(
        "{} {:?} is invalid ({} problem(s), as `sluice check` reports them):",
        request.kind.kind,
        request.name,
        problems.len()
    );
    for (i, p) in problems.iter().enumerate() {
        if message.len() + p.len() > MAX_MESSAGE {
            message.push_str(&format!("\n- ... and {} more", problems.len() - i));
            break;
        }
        message.push_str("\n- ");
        message.push_str(p);
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn update(object: &Value, old: &Value) -> Vec<u8> {
        serde_json::to_vec(&json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {
                "uid": "uid-1",
                "kind": {"group": "sluice.dev", "version": "v1alpha1", "kind": "HookChain"},
                "resource": {"group": "sluice.dev", "version": "v1alpha1", "resource": "hookchains"},
                "name": "c", "namespace": "ns", "operation": "UPDATE",
                "userInfo": {"username": "alice"},
                "object": object, "oldObject": old,
            }
        }))
        .unwrap()
    }

    fn allowed(body: &[u8]) -> bool {
        let judge = Judge {
            python: "python3".into(),
            rules: manifest::PlatformRules::new("billing/ledger".parse().unwrap()),
        };
        let answer = review(body, &judge).expect("a review");
        let response = answer.response.expect("a response");
        response.allowed
    }

    /// A deletion under way (a finalizer holds the object) is no licence to write any spec: only an
    /// update that leaves the spec as it was goes unjudged.
    #[test]
    fn an_object_being_deleted_is_still_judged_when_its_spec_changes() {
        let good = json!({
            "apiVersion": "sluice.dev/v1alpha1", "kind": "HookChain",
            "metadata": {"name": "c", "namespace": "ns", "finalizers": ["example.com/hold"],
                         "deletionTimestamp": "2026-11-26T01:00:00Z"},
            "spec": {"target": "bot", "triggerPoint": "input",
                     "hooks": [{"name": "h", "action": "modify",
                                "code": "def execute(c, s):\n    return {'action': 'pass'}\n"}]}
        });
        let mut rewritten = good.clone();
        rewritten["spec"]["hooks"][0]["code"] = json!("def (");
        assert!(
            !allowed(&update(&rewritten, &good)),
            "a broken spec written during deletion was admitted"
        );
        // The finalizer's removal (spec untouched) is what a deletion needs: admitted, even for a
        // spec that would not pass today.
        let mut released = rewritten.clone();
        released["metadata"]["finalizers"] = json!([]);
        assert!(allowed(&update(&released, &rewritten)));
    }

    /// The object is judged through YAML text: every string must come back as it was sent.
    #[test]
    fn objects_survive_the_trip_through_yaml() {
        let nasty = [
            "def execute(context, settings):\n\treturn {'action': 'pass'}\n",
            "def execute(c, s):\r\n    return {'action': 'pass'}\r\n",
            "---\n...\n# ünïcödé ✓ \u{7f}\ndef execute(c, s): return {'action': 'pass'}",
            "  leading spaces\ntrailing spaces   \n\n\n",
            "yes",
            "0x1F",
            "'quoted' \"double\" \\back: colon # hash & anchor * alias ! tag % | >",
        ];
        for code in nasty {
            let object = json!({
                "apiVersion": "sluice.dev/v1alpha1", "kind": "HookChain",
                "metadata": {"name": "c", "namespace": "ns"},
                "spec": {"target": "bot", "triggerPoint": "input",
                         "hooks": [{"name": "h", "action": "modify", "settings": {"on": "no", "n": "1.0"}, "code": code}]}
            });
            let text = manifest::to_yaml(&object).unwrap();
            let parsed = manifest::parse(Path::new("x"), &text);
            let [Ok(loaded)] = parsed.as_slice() else {
                panic!("{code:?}: {parsed:?}\n{text}");
            };
            let Object::HookChain(hc) = &loaded.value else {
                panic!("not a chain")
            };
            assert_eq!(hc.spec.hooks[0].code, code, "{text}");
            assert_eq!(
                hc.spec.hooks[0].settings,
                Some(json!({"on": "no", "n": "1.0"})),
                "{text}"
            );
        }
    }
}
