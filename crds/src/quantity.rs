//! Kubernetes resource quantities (`250m`, `0.5Gi`, `128Mi`, `1e3`) as numbers the sandboxes can
//! use. Parsing is `kube_quantity`'s, over k8s-openapi's `Quantity`; this module only turns the
//! parsed value into whole millicores or bytes, rounding up like the API server's `MilliValue()`
//! and `Value()`.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube_quantity::ParsedQuantity;

/// A quantity that cannot be used as a sandbox's CPU or memory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    #[error("{resource} quantity {input:?} is not a Kubernetes quantity like {example}")]
    Invalid {
        resource: &'static str,
        input: String,
        example: &'static str,
    },
    #[error("{resource} quantity {input:?} is negative")]
    Negative {
        resource: &'static str,
        input: String,
    },
    #[error("{resource} quantity {input:?} is too large")]
    TooLarge {
        resource: &'static str,
        input: String,
    },
}

/// CPU in millicores: `250m` → 250, `1` → 1000, `0.5` → 500, `1e3` → 1 000 000.
pub fn cpu_millis(q: &str) -> Result<u64, QuantityError> {
    whole("cpu", "250m or 0.5", q, 1000.0)
}

/// Memory in bytes: `128Mi`, `0.5Gi`, `500M`, `1e9`, `1048576`.
pub fn memory_bytes(q: &str) -> Result<u64, QuantityError> {
    whole("memory", "128Mi or 0.5Gi", q, 1.0)
}

/// The quantity times `unit`, rounded up to a whole number.
fn whole(
    resource: &'static str,
    example: &'static str,
    input: &str,
    unit: f64,
) -> Result<u64, QuantityError> {
    let text = input.trim();
    let invalid = || QuantityError::Invalid {
        resource,
        input: input.into(),
        example,
    };
    // kube_quantity reads a missing number as 0 (`Mi` parses as 0Mi); the API server refuses it.
    if !text.starts_with(|c: char| c.is_ascii_digit() || matches!(c, '.' | '+' | '-')) {
        return Err(invalid());
    }
    let parsed = ParsedQuantity::try_from(&Quantity(text.to_string())).map_err(|_| invalid())?;
    // `to_bytes_u64` truncates the mantissa before scaling (`0.5Gi` would be 0): go through f64,
    // exact for every quantity below 2^53.
    let value = parsed.to_bytes_f64().ok_or_else(invalid)? * unit;
    if !value.is_finite() {
        return Err(invalid());
    }
    if value < 0.0 {
        return Err(QuantityError::Negative {
            resource,
            input: input.into(),
        });
    }
    // 0.1 * 1000 is 100.00000000000001 in f64: snap near-integers before rounding up.
    let nearest = value.round();
    let value = if (value - nearest).abs() <= nearest.max(1.0) * 1e-9 {
        nearest
    } else {
        value.ceil()
    };
    // u64::MAX as f64 rounds up to 2^64, which does not fit.
    if value >= u64::MAX as f64 {
        return Err(QuantityError::TooLarge {
            resource,
            input: input.into(),
        });
    }
    Ok(value as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu() {
        assert_eq!(cpu_millis("250m"), Ok(250));
        assert_eq!(cpu_millis("1"), Ok(1000));
        assert_eq!(cpu_millis("0.5"), Ok(500));
        assert_eq!(cpu_millis("1.5"), Ok(1500));
        assert_eq!(cpu_millis("0.1"), Ok(100));
        assert_eq!(cpu_millis("1e3"), Ok(1_000_000));
        assert_eq!(cpu_millis("2k"), Ok(2_000_000));
        // The API server's MilliValue() rounds up.
        assert_eq!(cpu_millis("0.0001"), Ok(1));
        assert_eq!(cpu_millis("0"), Ok(0));
    }

    #[test]
    fn memory() {
        assert_eq!(memory_bytes("128Mi"), Ok(128 << 20));
        assert_eq!(memory_bytes("1Gi"), Ok(1 << 30));
        assert_eq!(memory_bytes("0.5Gi"), Ok(512 << 20));
        assert_eq!(memory_bytes("1.5Gi"), Ok(3 << 29));
        assert_eq!(memory_bytes("500M"), Ok(500_000_000));
        assert_eq!(memory_bytes("1e3"), Ok(1000));
        assert_eq!(memory_bytes("1.5"), Ok(2), "a fraction of a byte rounds up");
        assert_eq!(memory_bytes("4096"), Ok(4096));
        assert_eq!(memory_bytes("250m"), Ok(1), "0.25 bytes rounds up");
    }

    #[test]
    fn invalid_strings_say_what_was_expected() {
        for q in [
            "lots", "", "Mi", "1Qi", "12 Mi", "0x10", "1.2.3", "NaN", "inf", "1Gi2",
        ] {
            let e = memory_bytes(q).expect_err(q);
            assert!(matches!(e, QuantityError::Invalid { .. }), "{q}: {e}");
            assert!(e.to_string().contains("128Mi"), "{e}");
        }
        for q in ["fast", "m", "1 core"] {
            let e = cpu_millis(q).expect_err(q);
            assert!(e.to_string().starts_with("cpu quantity"), "{e}");
        }
    }

    #[test]
    fn negative_values_are_refused() {
        assert!(matches!(
            cpu_millis("-1"),
            Err(QuantityError::Negative { .. })
        ));
        assert!(matches!(
            memory_bytes("-128Mi"),
            Err(QuantityError::Negative { .. })
        ));
    }

    #[test]
    fn too_large_is_an_error_not_a_wrap() {
        assert!(matches!(
            memory_bytes("99999999999Ti"),
            Err(QuantityError::TooLarge { .. })
        ));
        assert!(matches!(
            cpu_millis("20000P"),
            Err(QuantityError::TooLarge { .. })
        ));
    }
}
