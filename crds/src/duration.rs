//! The one way Sluice reads a duration from a flag or a file: a number with a unit (`500ms`, `2s`,
//! `1m`, `1h`, `1m30s`), parsed by jiff's "friendly" format. A bare number is refused rather than
//! guessed: the operator used to read `30` as seconds and the gateway as milliseconds.

use jiff::SignedDuration;
use jiff::fmt::friendly::SpanParser;
use std::time::Duration;

/// What every duration error tells the user is accepted.
const FORMS: &str = "a number with a unit, like 500ms, 2s, 1m, 1h or 1m30s";

/// A duration that could not be read, with the text that was given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("{input:?} has no unit: write {FORMS}")]
    BareNumber { input: String },
    #[error("{input:?} is not a duration: write {FORMS} ({reason})")]
    Invalid { input: String, reason: String },
    #[error("{input:?} is negative: write {FORMS}")]
    Negative { input: String },
}

/// Parses `500ms`, `2s`, `1m`, `1h`, `1m30s` (and jiff's spelled-out units: `2 hours 30 mins`).
/// Units larger than hours are refused (a day is not always 24 hours), as are ISO 8601 (`PT5S`)
/// and bare numbers.
pub fn parse_duration(input: &str) -> Result<Duration, DurationError> {
    static PARSER: SpanParser = SpanParser::new();
    let text = input.trim();
    if !text.is_empty() && text.parse::<f64>().is_ok() {
        return Err(DurationError::BareNumber {
            input: input.into(),
        });
    }
    let signed: SignedDuration =
        PARSER
            .parse_duration(text)
            .map_err(|e| DurationError::Invalid {
                input: input.into(),
                reason: e.to_string(),
            })?;
    Duration::try_from(signed).map_err(|_| DurationError::Negative {
        input: input.into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(s: &str) -> Duration {
        parse_duration(s).unwrap_or_else(|e| panic!("{s:?}: {e}"))
    }

    #[test]
    fn the_documented_forms_parse() {
        assert_eq!(ok("500ms"), Duration::from_millis(500));
        assert_eq!(ok("2s"), Duration::from_secs(2));
        assert_eq!(ok("1m"), Duration::from_secs(60));
        assert_eq!(ok("1h"), Duration::from_secs(3600));
        assert_eq!(ok("1m30s"), Duration::from_secs(90));
        assert_eq!(ok("1h1m1s500ms"), Duration::from_millis(3_661_500));
        assert_eq!(ok("300s"), Duration::from_secs(300));
        assert_eq!(ok("1500ms"), Duration::from_millis(1500));
        assert_eq!(ok(" 2s "), Duration::from_secs(2));
        assert_eq!(ok("1.5s"), Duration::from_millis(1500));
    }

    #[test]
    fn zero_is_a_duration_when_it_has_a_unit() {
        assert_eq!(ok("0s"), Duration::ZERO);
        assert_eq!(ok("0ms"), Duration::ZERO);
        assert!(matches!(
            parse_duration("0"),
            Err(DurationError::BareNumber { .. })
        ));
    }

    #[test]
    fn bare_numbers_are_refused_with_the_accepted_forms() {
        for s in ["30", "1500", "2.5", "-1"] {
            let e = parse_duration(s).unwrap_err();
            assert!(matches!(e, DurationError::BareNumber { .. }), "{s}: {e}");
            let msg = e.to_string();
            assert!(
                msg.contains("500ms") && msg.contains("1m30s"),
                "{s}: message should name the accepted forms: {msg}"
            );
        }
    }

    #[test]
    fn other_text_is_refused() {
        for s in [
            "",
            "soon",
            "5d",
            "1 day",
            "2w",
            "PT5S",
            "s",
            "5 parsecs",
            "1m30",
        ] {
            let e = parse_duration(s).expect_err(s);
            assert!(matches!(e, DurationError::Invalid { .. }), "{s}: {e}");
            assert!(e.to_string().contains("500ms, 2s, 1m, 1h"), "{e}");
        }
    }

    #[test]
    fn negative_durations_are_refused() {
        for s in ["-5s", "5s ago"] {
            assert!(
                matches!(parse_duration(s), Err(DurationError::Negative { .. })),
                "{s}: {:?}",
                parse_duration(s)
            );
        }
    }

    #[test]
    fn overflow_is_an_error_not_a_panic() {
        for s in [
            "99999999999999999999999h",
            "9223372036854775807h",
            "18446744073709551616s",
        ] {
            assert!(
                matches!(parse_duration(s), Err(DurationError::Invalid { .. })),
                "{s}: {:?}",
                parse_duration(s)
            );
        }
    }
}
