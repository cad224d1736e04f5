//! Property tests of the stream path's windowing, driven exactly as `stream.rs` drives it, over random
//! texts and random chunkings, with a deterministic idempotent redactor standing in for the chain.
//! (The same guarantees are checked against real sandboxes in e2e/tests/local_stream.rs.)

use proptest::prelude::*;
use sluice_gateway::stream::Window;

/// Patterns no longer than the lookback; the mask contains none of their characters.
const PATTERNS: [&str; 4] = ["010-1234", "secret", "Ωμέγα", "a\r\nb"];
const MASK: &str = "[x]";
const LOOKBACK: usize = 8;

fn redact(text: &str) -> String {
    let mut out = text.to_string();
    for p in PATTERNS {
        out = out.replace(p, MASK);
    }
    out
}

/// Runs the stream path over `chunks`: returns the commits.
fn stream(chunks: &[String], flush: usize) -> Vec<String> {
    let mut window = Window::new(flush, LOOKBACK);
    let mut commits = Vec::new();
    let n = chunks.len();
    for (i, chunk) in chunks.iter().map(Some).chain([None]).enumerate() {
        let last = i == n;
        if let Some(c) = chunk
            && !window.push(c)
        {
            continue;
        }
        let commit = match window.take_batch() {
            Some(batch) => window.settle(&redact(&batch), last),
            None if last => window.release_tail(),
            None => String::new(),
        };
        if !commit.is_empty() {
            commits.push(commit);
        }
    }
    commits
}

fn text_strategy() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        Just("010-1234".to_string()),
        Just("secret".to_string()),
        Just("Ωμέγα".to_string()),
        Just("a\r\nb".to_string()),
        "[a-z0-9 \\-]{1,6}",
        Just("日本".to_string()),
        Just("\r\n".to_string()),
    ];
    prop::collection::vec(piece, 0..40).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn commits_never_show_a_pattern_and_equal_the_final(text in text_strategy(), cuts in prop::collection::vec(0usize..400, 0..60), flush in 1usize..24) {
        let chunks = sluice_gateway::stream::chunk_at(&text, &cuts);
        let commits = stream(&chunks, flush);
        let shown = commits.concat();
        let final_ = redact(&text);
        for p in PATTERNS {
            prop_assert!(!shown.contains(p), "{p:?} shown in {shown:?}");
        }
        prop_assert_eq!(&shown, &final_);
    }

    #[test]
    fn one_character_chunks(text in text_strategy()) {
        let chunks: Vec<String> = text.chars().map(String::from).collect();
        prop_assert_eq!(stream(&chunks, 1).concat(), redact(&text));
    }
}
