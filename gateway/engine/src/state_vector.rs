//! The state vector: `state[i]` belongs to hook i of a chain and lives on the trusted side. It goes
//! to the sandbox with every walk and comes back, slot by slot, in each ran hook's result. Hook B is
//! never handed hook A's slot by anything but the supervisor's indexing, and the gateway re-checks
//! the index of every result it applies.

use serde_json::Value;

#[derive(Clone, Debug, PartialEq)]
pub struct StateVector(Vec<Value>);

impl StateVector {
    /// A fresh vector: every slot `null`, as a hook sees it on its first call.
    pub fn fresh(hooks: usize) -> Self {
        Self(vec![Value::Null; hooks])
    }

    pub fn as_slice(&self) -> &[Value] {
        &self.0
    }

    pub fn get(&self, index: usize) -> Option<&Value> {
        self.0.get(index)
    }

    /// Replaces slot `index` with what hook `index` returned. Out-of-range indexes are ignored; the
    /// caller has already refused results whose index does not match the chain.
    pub fn set(&mut self, index: usize, value: Value) {
        if let Some(slot) = self.0.get_mut(index) {
            *slot = value;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn slots_are_independent_and_threaded() {
        let mut s = StateVector::fresh(3);
        assert_eq!(s.as_slice(), &[Value::Null, Value::Null, Value::Null]);
        s.set(1, json!({"seen": 1}));
        s.set(7, json!("ignored"));
        assert_eq!(s.get(0), Some(&Value::Null));
        assert_eq!(s.get(1), Some(&json!({"seen": 1})));
        let next = s.clone();
        s.set(1, json!({"seen": 2}));
        assert_eq!(
            next.get(1),
            Some(&json!({"seen": 1})),
            "a copy is a snapshot"
        );
    }
}
