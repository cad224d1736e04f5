//! The CustomResourceDefinitions as served: what kube's derive generates, finished where the derive
//! cannot say it. A real description for each kind (the derive writes "Auto-generated derived
//! type..."), `format`s only from the set the API server knows (schemars' `uint32` draws a warning
//! on every apply from Kubernetes 1.34 on; the `minimum: 0` beside it still holds), and the CEL rule
//! that bounds the code of a whole HookChain.

use crate::{Capability, HookChain, MAX_CHAIN_CODE_BYTES};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;
use serde_json::{Value, json};

/// The formats of OpenAPI that Kubernetes validates (apiextensions-apiserver's list, the ones a
/// schema of Sluice may use); any other is dropped.
const KNOWN_FORMATS: [&str; 8] = [
    "int32",
    "int64",
    "float",
    "double",
    "byte",
    "date",
    "date-time",
    "duration",
];

const HOOKCHAIN: &str = "A HookChain runs ordered Python hooks, each in a fresh cell of a gVisor \
    sandbox, on every payload of one trigger point (input, output, before/after a model or tool \
    call) of one target. The operator keeps a warm pool of sandbox pods for it and reports in \
    status whether its code is valid and its pool ready; the gateway runs it for every request \
    that names its namespace, target and trigger point.";

const CAPABILITY: &str = "A Capability is an application function hooks may call by its \
    metadata.name through host_call: the gateway checks the payload against its JSON Schema, runs \
    its gates, executes it at its endpoint (gRPC, HTTP or built in) and runs its dispatch steps. \
    The operator reports in status whether its schema is valid and everything it names exists.";

pub fn hookchain() -> CustomResourceDefinition {
    // Characters, as CEL counts: at most the bytes the validation in Rust counts, so this is the
    // same bound or looser, never stricter.
    let rule = json!({
        "rule": format!("self.hooks.map(h, has(h.code) ? size(h.code) : 0).sum() <= {MAX_CHAIN_CODE_BYTES}"),
        "message": format!("the hooks' code together must be at most {} KiB", MAX_CHAIN_CODE_BYTES / 1024),
    });
    finish(HookChain::crd(), HOOKCHAIN, Some(rule))
}

pub fn capability() -> CustomResourceDefinition {
    finish(Capability::crd(), CAPABILITY, None)
}

fn finish(
    crd: CustomResourceDefinition,
    description: &str,
    spec_rule: Option<Value>,
) -> CustomResourceDefinition {
    let mut v = serde_json::to_value(&crd).expect("a CRD serializes");
    if let Some(versions) = v["spec"]["versions"].as_array_mut() {
        for version in versions {
            let schema = &mut version["schema"]["openAPIV3Schema"];
            schema["description"] = description.into();
            let props = &mut schema["properties"];
            // As controller-gen writes them, so `kubectl explain` describes every field.
            for (field, text) in [
                (
                    "apiVersion",
                    "The versioned schema of this object: sluice.dev/v1alpha1.",
                ),
                ("kind", "The kind of this object."),
            ] {
                if props.get(field).is_none() {
                    props[field] = json!({"type": "string"});
                }
                if props[field].get("description").is_none() {
                    props[field]["description"] = text.into();
                }
            }
            // `metadata` exactly as controller-gen writes it: a real API server refuses a CRD whose
            // schema says anything more about it ("must not specify anything other than name and
            // generateName"), a description included. `kubectl explain` describes it from ObjectMeta.
            props["metadata"] = json!({"type": "object"});
            if let Some(rule) = &spec_rule {
                props["spec"]["x-kubernetes-validations"] = json!([rule]);
            }
            known_formats_only(schema);
        }
    }
    serde_json::from_value(v).expect("a finished CRD is still a CRD")
}

fn known_formats_only(node: &mut Value) {
    match node {
        Value::Object(map) => {
            if map
                .get("format")
                .and_then(Value::as_str)
                .is_some_and(|f| !KNOWN_FORMATS.contains(&f))
            {
                map.remove("format");
            }
            for child in map.values_mut() {
                known_formats_only(child);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(known_formats_only),
        _ => {}
    }
}
