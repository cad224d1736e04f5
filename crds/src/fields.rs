//! A document checked against its CRD's own OpenAPI schema, the way `kubectl apply` with strict
//! field validation judges it: every unknown field (with the known field it most likely meant) and
//! every value of the wrong type or outside its enum, all at once, each with the place it is at and
//! the line of the document it is on.

use serde_json::Value;
use std::collections::BTreeSet;

/// One step of a path into a document: a mapping key or a list index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Seg {
    Key(String),
    Index(usize),
}

/// A path as people read it: `spec.hooks[0].settings`.
pub fn display(path: &[Seg]) -> String {
    let mut out = String::new();
    for seg in path {
        match seg {
            Seg::Key(k) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(k);
            }
            Seg::Index(i) => out.push_str(&format!("[{i}]")),
        }
    }
    out
}

/// Parses `spec.hooks[0].name` (as `validate::Problem::field` writes it) back into segments.
pub fn parse_dotted(field: &str) -> Vec<Seg> {
    let mut out = Vec::new();
    for part in field.split('.') {
        let mut rest = part;
        if let Some(open) = rest.find('[') {
            if open > 0 {
                out.push(Seg::Key(rest[..open].to_string()));
            }
            rest = &rest[open..];
            while let Some(stripped) = rest.strip_prefix('[') {
                let Some(close) = stripped.find(']') else {
                    break;
                };
                if let Ok(i) = stripped[..close].parse() {
                    out.push(Seg::Index(i));
                }
                rest = &stripped[close + 1..];
            }
        } else if !rest.is_empty() {
            out.push(Seg::Key(rest.to_string()));
        }
    }
    out
}

/// One problem of a document against its schema.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldProblem {
    pub path: Vec<Seg>,
    pub message: String,
}

/// What `metadata` may hold (`ObjectMeta`); the CRD schema leaves it to the API server.
const METADATA: &[&str] = &[
    "name",
    "namespace",
    "labels",
    "annotations",
    "generateName",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "finalizers",
    "ownerReferences",
    "managedFields",
    "selfLink",
];

pub use crate::did_you_mean;

/// Every field of `value` its schema does not know, with a suggestion where one is close.
fn unknown_fields(schema: &Value, value: &Value, path: &mut Vec<Seg>, out: &mut Vec<FieldProblem>) {
    if schema.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true)) {
        return;
    }
    match value {
        Value::Object(map) => {
            let Some(props) = schema.get("properties").and_then(Value::as_object) else {
                return;
            };
            for (key, v) in map {
                path.push(Seg::Key(key.clone()));
                match props.get(key) {
                    Some(sub) => unknown_fields(sub, v, path, out),
                    None => {
                        let hint = did_you_mean(key, props.keys().map(String::as_str))
                            .map(|k| format!("; did you mean {k:?}?"))
                            .unwrap_or_else(|| {
                                let known: BTreeSet<&str> =
                                    props.keys().map(String::as_str).collect();
                                format!(
                                    " (known fields: {})",
                                    known.into_iter().collect::<Vec<_>>().join(", ")
                                )
                            });
                        out.push(FieldProblem {
                            path: path.clone(),
                            message: format!("unknown field {key:?}{hint}"),
                        });
                    }
                }
                path.pop();
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for (i, v) in items.iter().enumerate() {
                    path.push(Seg::Index(i));
                    unknown_fields(item_schema, v, path, out);
                    path.pop();
                }
            }
        }
        _ => {}
    }
}

/// Checks a whole object (`apiVersion`, `kind`, `metadata`, `spec`) against the CRD schema
/// `open_api` (its `openAPIV3Schema`): unknown fields first, then every schema violation.
pub fn check(open_api: &Value, object: &Value) -> Vec<FieldProblem> {
    let mut out = Vec::new();
    let mut top = open_api.clone();
    if let Some(props) = top.get_mut("properties").and_then(Value::as_object_mut) {
        for k in ["apiVersion", "kind"] {
            props
                .entry(k)
                .or_insert_with(|| serde_json::json!({"type": "string"}));
        }
        let meta: serde_json::Map<String, Value> = METADATA
            .iter()
            .map(|k| {
                (
                    k.to_string(),
                    serde_json::json!({"x-kubernetes-preserve-unknown-fields": true}),
                )
            })
            .collect();
        props.insert(
            "metadata".into(),
            serde_json::json!({"type": "object", "properties": meta}),
        );
    }
    unknown_fields(&top, object, &mut Vec::new(), &mut out);
    // Unknown fields are already said; the validator is told to allow them so it does not repeat.
    let schema_errors = match jsonschema::validator_for(open_api) {
        Ok(validator) => validator
            .iter_errors(object)
            .map(|e| FieldProblem {
                path: pointer_segments(&e.instance_path().to_string()),
                message: match (e.kind(), e.instance().as_ref()) {
                    (
                        jsonschema::error::ValidationErrorKind::Enum { options },
                        Value::String(got),
                    ) => one_of(got, options),
                    _ => without_long_value(e.to_string(), e.instance()),
                },
            })
            .collect::<Vec<_>>(),
        Err(_) => Vec::new(),
    };
    for p in schema_errors {
        if !out.iter().any(|o| o.path == p.path) {
            out.push(p);
        }
    }
    out
}

/// A value outside an enum: every option named (the validator says "or 3 other candidates"), and
/// the one meant when one is close (`Block` → `block`).
fn one_of(got: &str, options: &Value) -> String {
    let names: Vec<&str> = options
        .as_array()
        .map(|o| o.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let listed = names
        .iter()
        .map(|n| format!("{n:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    match did_you_mean(got, names.iter().copied()) {
        Some(meant) => format!("{got:?} is not one of {listed}; did you mean {meant:?}?"),
        None => format!("{got:?} is not one of {listed}"),
    }
}

/// The validator's message with a long offending value (a hook's whole code) said by its size
/// instead of quoted whole: the place and the rule are what a person needs.
fn without_long_value(message: String, value: &Value) -> String {
    let shown = value.to_string();
    if shown.len() <= 200 {
        return message;
    }
    let what = match value {
        Value::String(s) => format!("a text of {} characters", s.chars().count()),
        Value::Array(items) => format!("a list of {} items", items.len()),
        Value::Object(map) => format!("a mapping of {} keys", map.len()),
        _ => "the value".to_string(),
    };
    message.replacen(&shown, &what, 1)
}

fn pointer_segments(pointer: &str) -> Vec<Seg> {
    pointer
        .split('/')
        .skip(1)
        .map(|s| {
            let s = s.replace("~1", "/").replace("~0", "~");
            match s.parse() {
                Ok(i) => Seg::Index(i),
                Err(_) => Seg::Key(s),
            }
        })
        .collect()
}

/// The 0-based line of `doc` that `path` is on, found by following the keys and list items in
/// order through the text (block and flow style alike); the nearest line found where the rest of
/// the path cannot be followed.
pub fn line_of(doc: &str, path: &[Seg]) -> usize {
    let lines: Vec<&str> = doc.lines().collect();
    let mut at = 0;
    let mut found = 0;
    let mut parent_indent: Option<usize> = None;
    for seg in path {
        match seg {
            Seg::Key(key) => {
                let hit = (at..lines.len()).find(|&i| has_key(lines[i], key));
                let Some(i) = hit else { return found };
                found = i;
                at = i;
                parent_indent = Some(indent(lines[i]));
            }
            Seg::Index(n) => {
                // The (n+1)-th `- ` item after the key line, at the indentation of the first one.
                let mut item_indent = None;
                let mut seen = 0;
                let mut hit = None;
                for (i, line) in lines.iter().enumerate().skip(at + 1) {
                    let t = line.trim_start();
                    if t.is_empty() || t.starts_with('#') {
                        continue;
                    }
                    let ind = indent(line);
                    if parent_indent.is_some_and(|p| ind < p) {
                        break;
                    }
                    if t.starts_with("- ") || t == "-" {
                        match item_indent {
                            None => item_indent = Some(ind),
                            Some(ii) if ii != ind => continue,
                            _ => {}
                        }
                        if seen == *n {
                            hit = Some(i);
                            break;
                        }
                        seen += 1;
                    } else if item_indent.is_some_and(|ii| ind <= ii) && !t.starts_with("- ") {
                        break;
                    }
                }
                let Some(i) = hit else { return found };
                found = i;
                // Keys of the item sit on its own line or below it.
                at = i;
                parent_indent = item_indent;
            }
        }
    }
    found
}

fn indent(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

/// Whether `line` holds `key:` as a mapping key (block, list item or flow style).
fn has_key(line: &str, key: &str) -> bool {
    let t = line.trim_start();
    let t = t.strip_prefix("- ").unwrap_or(t).trim_start();
    let plain = |s: &str| {
        s.strip_prefix(key)
            .is_some_and(|r| r.starts_with(':') || r.trim_start().starts_with(':'))
    };
    if plain(t) || plain(t.trim_start_matches(['"', '\''])) {
        return true;
    }
    [
        format!("{{{key}:"),
        format!("{{ {key}:"),
        format!(", {key}:"),
        format!(",{key}:"),
    ]
    .iter()
    .any(|p| line.contains(p.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = "apiVersion: x\nkind: HookChain\nmetadata: {name: c}\nspec:\n  target: bot\n  hooks:\n    - name: a\n      code: x\n    - name: b\n      setting: {a: 1}\n";

    #[test]
    fn lines_follow_keys_and_list_items() {
        assert_eq!(line_of(DOC, &parse_dotted("spec.target")), 4);
        assert_eq!(line_of(DOC, &parse_dotted("spec.hooks[1].setting")), 9);
        assert_eq!(line_of(DOC, &parse_dotted("spec.hooks[1]")), 8);
        assert_eq!(line_of(DOC, &parse_dotted("metadata.name")), 2);
    }

    #[test]
    fn long_values_are_said_by_their_size() {
        let schema = serde_json::json!({"type": "object", "properties": {"code": {"type": "string", "maxLength": 10}}});
        let p = check(&schema, &serde_json::json!({"code": "x".repeat(300)}));
        assert_eq!(p.len(), 1, "{p:?}");
        assert_eq!(
            p[0].message, "a text of 300 characters is longer than 10 characters",
            "{p:?}"
        );
        let p = check(&schema, &serde_json::json!({"code": "x".repeat(11)}));
        assert!(
            p[0].message.starts_with("\"xxxxxxxxxxx\" is longer"),
            "{p:?}"
        );
    }

    #[test]
    fn suggestions_find_the_meant_field() {
        let known = ["settings", "failurePolicy", "timeoutMs", "name"];
        assert_eq!(did_you_mean("setting", known), Some("settings"));
        assert_eq!(did_you_mean("failurepolicy", known), Some("failurePolicy"));
        assert_eq!(did_you_mean("zzz", known), None);
    }
}
