//! Kubernetes resource quantities (`250m`, `128Mi`, `1G`) as numbers the sandboxes can use.

/// CPU in millicores: `250m` → 250, `1` → 1000, `0.5` → 500.
pub fn cpu_millis(q: &str) -> Result<u64, String> {
    let q = q.trim();
    if let Some(m) = q.strip_suffix('m') {
        return m
            .parse::<u64>()
            .map_err(|_| format!("cpu quantity {q:?} is not a number of millicores"));
    }
    let cores: f64 = q
        .parse()
        .map_err(|_| format!("cpu quantity {q:?} is not like 250m or 0.5"))?;
    if !(cores.is_finite() && cores > 0.0) {
        return Err(format!("cpu quantity {q:?} must be positive"));
    }
    Ok((cores * 1000.0).round() as u64)
}

/// Memory in bytes: `128Mi`, `1Gi`, `500M`, `1048576`.
pub fn memory_bytes(q: &str) -> Result<u64, String> {
    let q = q.trim();
    const UNITS: [(&str, u64); 8] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
    ];
    let (digits, unit) = UNITS
        .iter()
        .find_map(|(suffix, mult)| q.strip_suffix(suffix).map(|d| (d, *mult)))
        .unwrap_or((q, 1));
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("memory quantity {q:?} is not like 128Mi or 1Gi"))?;
    n.checked_mul(unit)
        .ok_or_else(|| format!("memory quantity {q:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu() {
        assert_eq!(cpu_millis("250m"), Ok(250));
        assert_eq!(cpu_millis("1"), Ok(1000));
        assert_eq!(cpu_millis("0.5"), Ok(500));
        assert!(cpu_millis("fast").is_err());
        assert!(cpu_millis("-1").is_err());
    }

    #[test]
    fn memory() {
        assert_eq!(memory_bytes("128Mi"), Ok(128 << 20));
        assert_eq!(memory_bytes("1Gi"), Ok(1 << 30));
        assert_eq!(memory_bytes("500M"), Ok(500_000_000));
        assert_eq!(memory_bytes("4096"), Ok(4096));
        assert!(memory_bytes("lots").is_err());
        assert!(memory_bytes("99999999999Ti").is_err());
    }
}
