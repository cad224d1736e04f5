//! The committed CRD YAML must be exactly what the Rust types generate (`make crds` refreshes it), and
//! must be a structural schema a real API server accepts.

use std::path::Path;

#[test]
fn committed_crd_yaml_matches_the_types() {
    for (name, generated) in sluice_crds::crd_yaml() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(name);
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == generated,
            "{} is stale: run `make crds` and commit the result",
            path.display()
        );
    }
}

/// Walks a schema and returns the paths of nodes that a structural schema forbids or lacks.
fn structural_violations(node: &serde_json::Value, path: &str, out: &mut Vec<String>) {
    let Some(obj) = node.as_object() else { return };
    for banned in ["oneOf", "anyOf", "allOf", "$ref", "nullable"] {
        if obj.contains_key(banned) && banned != "nullable" {
            out.push(format!("{path}: {banned}"));
        }
    }
    let preserves =
        obj.get("x-kubernetes-preserve-unknown-fields") == Some(&serde_json::Value::Bool(true));
    let int_or_string =
        obj.get("x-kubernetes-int-or-string") == Some(&serde_json::Value::Bool(true));
    if !obj.contains_key("type") && !preserves && !int_or_string {
        out.push(format!("{path}: no type"));
    }
    if let Some(props) = obj.get("properties").and_then(|p| p.as_object()) {
        for (k, v) in props {
            if v.get("description").is_none()
                && !path.contains("conditions")
                && !path.starts_with(".metadata")
            {
                out.push(format!("{path}.{k}: no description"));
            }
            structural_violations(v, &format!("{path}.{k}"), out);
        }
    }
    if let Some(items) = obj.get("items") {
        structural_violations(items, &format!("{path}[]"), out);
    }
}

#[test]
fn crds_are_structural_and_every_field_is_described() {
    for (name, yaml) in sluice_crds::crd_yaml() {
        let crd: serde_json::Value = serde_saphyr::from_str(&yaml).unwrap();
        let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
        let mut out = Vec::new();
        for part in ["spec", "status"] {
            if let Some(s) = schema["properties"].get(part) {
                structural_violations(s, &format!(".{part}"), &mut out);
            }
        }
        assert!(
            out.is_empty(),
            "{name} is not structural or lacks descriptions: {out:#?}"
        );
    }
}

#[test]
fn the_api_server_enforces_exactly_one_endpoint() {
    let (_, yaml) = sluice_crds::crd_yaml()
        .into_iter()
        .find(|(n, _)| *n == "capability.yaml")
        .unwrap();
    let crd: serde_json::Value = serde_saphyr::from_str(&yaml).unwrap();
    let endpoint = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        ["endpoint"];
    let rules = endpoint["x-kubernetes-validations"]
        .as_array()
        .expect("a CEL rule on spec.endpoint");
    assert!(
        rules.iter().any(|r| r["rule"]
            .as_str()
            .unwrap_or_default()
            .contains(".size() == 1")),
        "{rules:?}"
    );
}

fn crd(name: &str) -> serde_json::Value {
    let (_, yaml) = sluice_crds::crd_yaml()
        .into_iter()
        .find(|(n, _)| *n == name)
        .expect("generated");
    serde_saphyr::from_str(&yaml).unwrap()
}

fn formats(node: &serde_json::Value, out: &mut Vec<String>) {
    match node {
        serde_json::Value::Object(map) => {
            if let Some(f) = map.get("format").and_then(|f| f.as_str()) {
                out.push(f.to_string());
            }
            map.values().for_each(|v| formats(v, out));
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| formats(v, out)),
        _ => {}
    }
}

/// What `kubectl explain`, `kubectl get` and the API server make of the CRDs: a real description on
/// the kind itself, only formats Kubernetes knows (no warning on apply from 1.34), the Ready reason
/// as a column, and a Capability status subresource with its columns.
#[test]
fn crds_say_what_a_platform_engineer_needs() {
    for name in ["hookchain.yaml", "capability.yaml"] {
        let crd = crd(name);
        let version = &crd["spec"]["versions"][0];
        let schema = &version["schema"]["openAPIV3Schema"];
        let top = schema["description"].as_str().unwrap_or_default();
        assert!(
            top.len() > 80 && !top.contains("Auto-generated"),
            "{name}: {top}"
        );
        for field in ["apiVersion", "kind", "spec", "status"] {
            assert!(
                schema["properties"][field]["description"].is_string(),
                "{name}: .{field} has no description"
            );
        }
        // A real API server refuses a CRD that says anything about metadata but its type.
        assert_eq!(
            schema["properties"]["metadata"],
            serde_json::json!({"type": "object"}),
            "{name}"
        );
        let mut found = Vec::new();
        formats(schema, &mut found);
        found.retain(|f| !["int32", "int64", "date-time"].contains(&f.as_str()));
        assert!(found.is_empty(), "{name}: unrecognised formats {found:?}");
        let columns: Vec<&str> = version["additionalPrinterColumns"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect();
        assert!(
            columns.starts_with(&["Ready", "Reason"]),
            "{name}: {columns:?}"
        );
        assert!(version["subresources"]["status"].is_object(), "{name}");
    }
    let hc = crd("hookchain.yaml");
    let rule = &hc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["x-kubernetes-validations"]
        [0];
    assert_eq!(
        rule["rule"],
        "self.hooks.map(h, has(h.code) ? size(h.code) : 0).sum() <= 524288"
    );
}
