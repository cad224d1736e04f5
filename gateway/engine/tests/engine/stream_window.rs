//! Property tests of the stream path over random texts and random chunkings, through the real
//! `Engine::stream` and its window, with a scripted sandbox whose chain is a deterministic,
//! idempotent redactor. (The same guarantees are checked against runsc sandboxes in
//! e2e/tests/e2e/local_stream.rs.)

use crate::common;

use common::scripted::{Chunk, ScriptedBackend, honest};
use common::{Harness, hook};
use proptest::prelude::*;
use serde_json::json;
use sluice_crds::Action;
use sluice_engine::{StreamInput, StreamOpen, chunk_at};
use std::sync::{Arc, OnceLock};

/// Patterns no longer than the lookback; the mask contains none of their characters.
const PATTERNS: [&str; 4] = ["010-1234", "secret", "Ωμέγα", "a\r\nb"];
const MASK: &str = "[x]";
const LOOKBACK: usize = 8;
const FLUSHES: std::ops::Range<usize> = 1..24;

fn redact(text: &str) -> String {
    let mut out = text.to_string();
    for p in PATTERNS {
        out = out.replace(p, MASK);
    }
    out
}

/// Masks every run of four or more digits: unlike the literal patterns, the start of a match is a
/// match too, as it is for e-mail addresses, phone and card numbers.
fn redact_numbers(text: &str) -> String {
    let mut out = String::new();
    let mut digits = String::new();
    let flush = |digits: &mut String, out: &mut String| {
        if digits.chars().count() >= 4 {
            out.push_str(MASK);
        } else {
            out.push_str(digits);
        }
        digits.clear();
    };
    for c in text.chars() {
        if c.is_ascii_digit() {
            digits.push(c);
        } else {
            flush(&mut digits, &mut out);
            out.push(c);
        }
    }
    flush(&mut digits, &mut out);
    out
}

type Engine = (tokio::runtime::Runtime, Harness);

/// One engine for every case, with a chain per flush size (target `f<flush>`).
fn engine() -> &'static Engine {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    ENGINE.get_or_init(|| engine_with(redact))
}

/// The same, whose chain masks numbers (`redact_numbers`).
fn numbers_engine() -> &'static Engine {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    ENGINE.get_or_init(|| engine_with(redact_numbers))
}

fn engine_with(redactor: fn(&str) -> String) -> Engine {
    {
        let rt = tokio::runtime::Runtime::new().expect("a runtime");
        let chains = FLUSHES
            .map(|flush| {
                common::chain(
                    common::NS,
                    &format!("f{flush}"),
                    &format!("f{flush}"),
                    "output",
                    vec![hook("redact", "modify", "x")],
                    json!({"streaming": {"flushChars": flush, "lookbackChars": LOOKBACK}}),
                )
            })
            .collect();
        let backend = ScriptedBackend::new(Arc::new(move |c: &Chunk| honest(c, redactor)));
        let harness = rt.block_on(Harness::with_backend(
            Arc::new(backend),
            chains,
            common::limits(),
        ));
        (rt, harness)
    }
}

/// Streams `chunks` through the chain of flush size `flush` (`paced`: a client slower than the
/// chain; otherwise every chunk is waiting from the start): the commits and the final payload.
fn stream(chunks: &[String], flush: usize, paced: bool) -> (Vec<String>, String) {
    stream_through(engine(), chunks, flush, paced)
}

fn stream_through(
    (rt, h): &Engine,
    chunks: &[String],
    flush: usize,
    paced: bool,
) -> (Vec<String>, String) {
    let mut inputs = vec![StreamInput::Open(StreamOpen {
        namespace: common::NS.into(),
        target: format!("f{flush}"),
        trigger_point: "output".into(),
        ..Default::default()
    })];
    inputs.extend(chunks.iter().cloned().map(StreamInput::Chunk));
    inputs.push(StreamInput::Finish);
    let s = rt.block_on(async {
        if paced {
            h.stream_inputs(inputs).await
        } else {
            h.stream_all_at_once(inputs).await
        }
    });
    assert!(s.error.is_none(), "{:?}", s.error);
    let f = s.final_.expect("a final");
    assert_ne!(f.walk.action, Action::Block);
    let final_ = f.walk.payload.as_str().unwrap_or_default().to_string();
    (s.commits, final_)
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

/// Words and numbers of 4 to `LOOKBACK` digits, a number never touching another.
fn numbers_strategy() -> impl Strategy<Value = String> {
    let piece = prop_oneof!["[a-z \\-]{1,6}", " [0-9]{4,8}", Just("\r\n".to_string())];
    prop::collection::vec(piece, 0..30).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// A batch that ends inside a number shows its start as a whole number: the window must hold
    /// back what the chain changed at the end of a batch as the raw text it was, or the rest of the
    /// number follows the mask ("[x]56").
    #[test]
    fn a_match_cut_by_the_end_of_a_batch_is_masked_whole(text in numbers_strategy(), cuts in prop::collection::vec(0usize..300, 0..40), flush in FLUSHES, paced in any::<bool>()) {
        let chunks = chunk_at(&text, &cuts);
        let (commits, final_) = stream_through(numbers_engine(), &chunks, flush, paced);
        prop_assert_eq!(&final_, &redact_numbers(&text));
        prop_assert_eq!(commits.concat(), final_);
    }

    #[test]
    fn commits_never_show_a_pattern_and_equal_the_final(text in text_strategy(), cuts in prop::collection::vec(0usize..400, 0..60), flush in FLUSHES, paced in any::<bool>()) {
        let chunks = chunk_at(&text, &cuts);
        let (commits, final_) = stream(&chunks, flush, paced);
        let shown = commits.concat();
        for p in PATTERNS {
            prop_assert!(!shown.contains(p), "{p:?} shown in {shown:?}");
        }
        prop_assert_eq!(&final_, &redact(&text));
        prop_assert_eq!(&shown, &final_);
    }

    #[test]
    fn one_character_chunks(text in text_strategy()) {
        let chunks: Vec<String> = text.chars().map(String::from).collect();
        let (commits, final_) = stream(&chunks, 1, true);
        prop_assert_eq!(commits.concat(), redact(&text));
        prop_assert_eq!(final_, redact(&text));
    }
}

/// `chunk_by_chunk` (what `sluice test` asks for): chunks the client sent at once are still handled
/// one by one, each flushed as it fills the window, as a slow model's reply would be; without it
/// the gateway takes them in one batch. A pattern split across chunks thus meets the lookback.
#[test]
fn chunk_by_chunk_flushes_each_chunk_even_when_all_are_waiting() {
    let (rt, h) = engine();
    let chunks = ["call 010-", "1234 now ", "and again"];
    let run = |chunk_by_chunk: bool| {
        let mut inputs = vec![StreamInput::Open(StreamOpen {
            namespace: common::NS.into(),
            target: "f1".into(),
            trigger_point: "output".into(),
            chunk_by_chunk,
            ..Default::default()
        })];
        inputs.extend(chunks.iter().map(|c| StreamInput::Chunk(c.to_string())));
        inputs.push(StreamInput::Finish);
        let s = rt.block_on(h.stream_all_at_once(inputs));
        assert!(s.error.is_none(), "{:?}", s.error);
        s.commits
    };
    let joined = run(false);
    let each = run(true);
    assert_eq!(joined.concat(), each.concat());
    assert!(!each.concat().contains("010-1234"), "{each:?}");
    // Text of the first chunk beyond the lookback is shown before the second chunk is taken.
    assert!(
        each.len() >= chunks.len() && joined.len() < each.len(),
        "each chunk on its own: {each:?}; at once: {joined:?}"
    );
}
