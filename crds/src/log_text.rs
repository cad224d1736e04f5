//! Text someone else chose, as it may appear in a text log of the gateway or the operator: what
//! callers send (namespace, target, trigger point, session, context) and what tenants write into
//! their objects (names, `spec.target`, capability names, endpoints, and every error message that
//! quotes them). Control characters and line separators are escaped (`\n`, `\r`, `\u{1b}`), so such
//! a string can never start a forged log line or rewrite the terminal. The JSON audit needs none of
//! this: serde escapes it already. Kept here, in the crate operator and gateway share, so both escape
//! the same way.

use std::fmt;

/// Displays a string with its control characters and line separators escaped.
pub struct Escaped<'a>(pub &'a str);

fn unsafe_in_a_line(c: char) -> bool {
    c.is_control() || matches!(c, '\u{2028}' | '\u{2029}')
}

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut rest = self.0;
        while let Some(at) = rest.find(unsafe_in_a_line) {
            f.write_str(&rest[..at])?;
            let c = rest[at..].chars().next().unwrap_or_default();
            write!(f, "{}", c.escape_debug())?;
            rest = &rest[at + c.len_utf8()..];
        }
        f.write_str(rest)
    }
}

impl fmt::Debug for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::Escaped;

    #[test]
    fn control_characters_and_line_separators_are_escaped() {
        let s = Escaped("bot\nERROR x\r\u{1b}[2K\u{2028}é\t.").to_string();
        assert_eq!(s, "bot\\nERROR x\\r\\u{1b}[2K\\u{2028}é\\t.");
        assert_eq!(Escaped("plain-name").to_string(), "plain-name");
    }
}
