//! Capability JSON Schemas: whether one compiles (checked when a Capability is loaded, by the gateway
//! and the operator alike) and whether a host_call payload satisfies it. Compiled validators are
//! cached per distinct schema.

use serde_json::Value;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// A schema that does not compile, or a payload that does not match one.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SchemaError {
    #[error("the capability's schema is invalid: {0}")]
    Invalid(String),
    /// The first failing places, each with its JSON pointer.
    #[error("{0}")]
    Mismatch(String),
}

/// Checks that a schema compiles.
pub fn check_schema(schema: &Value) -> Result<(), SchemaError> {
    compiled(schema).map(|_| ())
}

/// Validates `payload` against a JSON Schema; the error names the first failing places.
pub fn validate(schema: &Value, payload: &Value) -> Result<(), SchemaError> {
    let validator = compiled(schema)?;
    let errors: Vec<String> = validator
        .iter_errors(payload)
        .take(3)
        .map(|e| {
            let at = e.instance_path().to_string();
            if at.is_empty() {
                e.to_string()
            } else {
                format!("{at}: {e}")
            }
        })
        .collect();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(SchemaError::Mismatch(errors.join("; ")))
    }
}

/// Compiles (once per distinct schema) a validator.
fn compiled(schema: &Value) -> Result<Arc<jsonschema::Validator>, SchemaError> {
    static CACHE: OnceLock<Mutex<HashMap<String, Arc<jsonschema::Validator>>>> = OnceLock::new();
    let key = schema.to_string();
    let cache = CACHE.get_or_init(Mutex::default);
    if let Some(v) = cache.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return Ok(v.clone());
    }
    let v = Arc::new(
        jsonschema::validator_for(schema).map_err(|e| SchemaError::Invalid(e.to_string()))?,
    );
    let mut c = cache.lock().unwrap_or_else(|p| p.into_inner());
    if c.len() > 1024 {
        c.clear();
    }
    c.insert(key, v.clone());
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn payloads_are_checked_and_bad_schemas_refused() {
        let schema = json!({"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}});
        assert_eq!(validate(&schema, &json!({"prompt": "hi"})), Ok(()));
        let err = validate(&schema, &json!({"prompt": 3})).unwrap_err();
        assert!(err.to_string().starts_with("/prompt: "), "{err}");
        assert!(matches!(
            check_schema(&json!({"type": "no-such-type"})),
            Err(SchemaError::Invalid(_))
        ));
    }
}
