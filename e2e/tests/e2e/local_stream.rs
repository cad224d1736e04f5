//! Gateway.Stream against real sandboxes: the two-path guarantees over random chunkings, state across
//! flushes, block mid-stream, many concurrent streams, cancellation and size limits.

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use sluice_e2e::{Harness, action, chain_yaml, chunk_at, text};
use sluice_proto::{self as proto, Action};
use std::time::Duration;

/// Idempotent, deterministic redactor of 8-character phone fragments and a multi-byte word.
const REDACT: &str = r#"import re
P = re.compile(r"\d{3}-\d{4}|Ωμέγα|a\r\nb")
def execute(context, settings):
    t = P.sub("[x]", context["outgoing"])
    return {"action": "modify", "outgoing": t} if t != context["outgoing"] else {"action": "pass"}
"#;

fn redact_chain() -> String {
    chain_yaml(
        "redact",
        "t-redact",
        "output",
        "streaming: {flushChars: 7, lookbackChars: 8}\npool: {warm: 2, max: 12}",
        &[("redact", "modify", REDACT)],
    )
}

fn python_pattern_matches(s: &str) -> bool {
    // The hook's pattern, checked on the trusted side: three digits, '-', four digits, or the words.
    let chars: Vec<char> = s.chars().collect();
    let digits = |w: &[char]| {
        w.len() == 8
            && w[..3].iter().all(|c| c.is_ascii_digit())
            && w[3] == '-'
            && w[4..].iter().all(|c| c.is_ascii_digit())
    };
    chars.windows(8).any(digits) || s.contains("Ωμέγα") || s.contains("a\r\nb")
}

fn text_strategy() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        Just("010-1234".to_string()),
        Just("Ωμέγα".to_string()),
        Just("a\r\nb".to_string()),
        "[a-z0-9 \\-]{1,5}",
        Just("日本語".to_string()),
        Just("\r\n".to_string()),
    ];
    prop::collection::vec(piece, 1..24).prop_map(|v| v.concat())
}

#[test]
fn streams_match_the_final_path_over_random_chunkings() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let chain = redact_chain();
    let h = rt.block_on(Harness::start(&[("redact.yaml", &chain)]));
    let mut runner = TestRunner::new(Config {
        cases: 24,
        failure_persistence: None,
        ..Config::default()
    });
    let strategy = (
        text_strategy(),
        prop::collection::vec(0usize..200, 0..30),
        any::<bool>(),
    );
    runner
        .run(&strategy, |(raw, cuts, one_char)| {
            let chunks = if one_char {
                raw.chars().map(String::from).collect()
            } else {
                chunk_at(&raw, &cuts)
            };
            let (streamed, whole) = rt.block_on(async {
                let s = h.stream("t-redact", "output", &chunks).await;
                let w = h.run_text("t-redact", "output", &raw).await.unwrap();
                (s, w)
            });
            prop_assert!(streamed.status.is_none(), "{:?}", streamed.status);
            let final_ = streamed.final_.as_ref().expect("a final");
            // 1. the final path equals running the chain on the whole reply.
            prop_assert_eq!(text(final_), text(&whole));
            // 2. nothing committed shows a match the final path removes.
            let shown = streamed.committed();
            prop_assert!(
                !python_pattern_matches(&shown),
                "a match was committed: {:?}",
                shown
            );
            // 3. for this idempotent redactor, the commits are exactly the final text.
            prop_assert_eq!(shown, text(final_));
            Ok(())
        })
        .unwrap();
    rt.block_on(h.stop_and_check_leaks());
}

/// Once the marker is seen, every later batch is masked: the hook remembers it in its state.
const LATCH: &str = r##"def execute(context, settings):
    on = bool(context["state"]) or "#mask-on" in context["outgoing"]
    if not on:
        return {"action": "pass", "state": False}
    masked = "".join("*" if c.isalpha() else c for c in context["outgoing"].replace("#mask-on", ""))
    return {"action": "modify", "outgoing": masked, "state": True}
"##;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_set_early_still_acts_later_and_streams_do_not_share_it() {
    let chain = chain_yaml(
        "latch",
        "t-latch",
        "output",
        "streaming: {flushChars: 8, lookbackChars: 4}\npool: {warm: 2, max: 8}",
        &[("latch", "modify", LATCH)],
    );
    let h = Harness::start(&[("latch.yaml", &chain)]).await;
    let filler = "abc def ghi ".repeat(20);
    let with_marker: Vec<String> = chunk_at(
        &format!("#mask-on {filler} secret words"),
        &(1..40).map(|i| i * 7).collect::<Vec<_>>(),
    );
    let without: Vec<String> = chunk_at(
        &format!("plain {filler} secret words"),
        &(1..40).map(|i| i * 7).collect::<Vec<_>>(),
    );
    let (a, b) = tokio::join!(
        h.stream("t-latch", "output", &with_marker),
        h.stream("t-latch", "output", &without)
    );
    let shown_a = a.committed();
    assert!(
        !shown_a.contains("secret"),
        "state set far before (beyond the lookback) did not act: {shown_a:?}"
    );
    assert!(shown_a.ends_with("****** *****"), "{shown_a:?}");
    let shown_b = b.committed();
    assert!(
        shown_b.contains("secret words"),
        "the other stream saw this stream's state: {shown_b:?}"
    );
    assert_eq!(text(a.final_.as_ref().unwrap()), shown_a);
    h.stop_and_check_leaks().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_mid_stream_stops_commits_and_the_final_is_block() {
    let blocker = "def execute(context, settings):\n    if 'forbidden' in context['outgoing']:\n        return {'action': 'block', 'message': 'reply withheld'}\n    return {'action': 'pass'}\n";
    let chain = chain_yaml(
        "blk",
        "t-blk",
        "output",
        "streaming: {flushChars: 10, lookbackChars: 10}",
        &[("guard", "block", blocker)],
    );
    let h = Harness::start(&[("blk.yaml", &chain)]).await;
    // Interactive: the safe part first, and only once some of it is committed, the rest.
    let (tx, mut responses) = h.open_stream("t-blk", "output").await;
    let send = |t: &str| proto::StreamRequest {
        msg: Some(proto::stream_request::Msg::Chunk(t.to_string())),
    };
    for piece in chunk_at(&"fine text ".repeat(6), &[5, 17, 29, 41]) {
        tx.send(send(&piece)).await.unwrap();
    }
    let mut s = sluice_e2e::StreamResult::default();
    match responses.message().await.unwrap().and_then(|m| m.msg) {
        Some(proto::stream_response::Msg::Commit(c)) => s.commits.push(c),
        other => panic!("expected a commit of the safe text, got {other:?}"),
    }
    for piece in chunk_at(
        &format!(" forbidden {}", "more text ".repeat(6)),
        &[4, 9, 15, 30],
    ) {
        tx.send(send(&piece)).await.unwrap();
    }
    tx.send(proto::StreamRequest {
        msg: Some(proto::stream_request::Msg::Finish(proto::StreamFinish {})),
    })
    .await
    .unwrap();
    while let Some(m) = responses.message().await.unwrap() {
        match m.msg {
            Some(proto::stream_response::Msg::Commit(c)) => {
                assert!(s.blocked.is_none(), "a commit after blocked");
                s.commits.push(c)
            }
            Some(proto::stream_response::Msg::Blocked(b)) => s.blocked = Some(b),
            Some(proto::stream_response::Msg::Final(f)) => s.final_ = Some(f),
            None => {}
        }
    }
    let blocked = s.blocked.as_ref().expect("blocked");
    assert_eq!(
        (blocked.message.as_str(), blocked.hook.as_str()),
        ("reply withheld", "guard")
    );
    assert!(
        !s.committed().contains("forbidden") && !s.committed().contains("more"),
        "{:?}",
        s.commits
    );
    let f = s.final_.as_ref().unwrap();
    assert_eq!(action(f), Action::Block);
    let audit = h.audit();
    assert_eq!(audit.len(), 1);
    assert_eq!(audit[0]["stream"]["stopped"], true);
    h.stop_and_check_leaks().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_concurrent_streams_are_all_correct() {
    let chain = chain_yaml(
        "many",
        "t-many",
        "output",
        "streaming: {flushChars: 16, lookbackChars: 8}\npool: {warm: 4, max: 40}",
        &[("redact", "modify", REDACT)],
    );
    let h = Harness::start(&[("many.yaml", &chain)]).await;
    let streams = (0..32).map(|i| {
        let h = &h;
        async move {
            let raw = format!(
                "stream {i}: call 010-{:04} now, then {i} again and again",
                1000 + i
            );
            let chunks = chunk_at(&raw, &[3, 9, 14, 20, 27, 33]);
            (i, h.stream("t-many", "output", &chunks).await)
        }
    });
    for (i, s) in futures::future::join_all(streams).await {
        let expected = format!("stream {i}: call [x] now, then {i} again and again");
        assert_eq!(s.committed(), expected);
        assert_eq!(text(s.final_.as_ref().unwrap()), expected);
    }
    assert_eq!(h.audit().len(), 32);
    h.stop_and_check_leaks().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_and_oversized_streams_end_cleanly() {
    let chain = redact_chain();
    let h = Harness::start_with(&[("redact.yaml", &chain)], |o| o.limits.stream_bytes = 4096).await;

    // The client goes away mid-stream.
    let (tx, mut responses) = h.open_stream("t-redact", "output").await;
    tx.send(proto::StreamRequest {
        msg: Some(proto::stream_request::Msg::Chunk(
            "hello 010-1234 and more text".into(),
        )),
    })
    .await
    .unwrap();
    let first = responses.message().await.unwrap();
    assert!(matches!(
        first.and_then(|m| m.msg),
        Some(proto::stream_response::Msg::Commit(_))
    ));
    drop(responses);
    drop(tx);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while h.audit().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "a cancelled stream was never audited"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let event = &h.audit()[0];
    assert!(
        event["error"].as_str().unwrap().contains("without finish"),
        "{event}"
    );

    // A reply over the configured maximum ends with a clear status.
    let big: Vec<String> = (0..10).map(|_| "x".repeat(1000)).collect();
    let s = h.stream("t-redact", "output", &big).await;
    let status = s.status.expect("an error status");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    assert!(
        status.message().contains("4096 bytes"),
        "{}",
        status.message()
    );

    // A stream that does not start with open, and one at a structured trigger point.
    let s = h.stream("nobody", "output", &[]).await;
    assert_eq!(s.status.unwrap().code(), tonic::Code::NotFound);
    let s = h.stream("t-redact", "before_tool", &[]).await;
    assert_eq!(s.status.unwrap().code(), tonic::Code::InvalidArgument);
    h.stop_and_check_leaks().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_stream_redactor_masks_a_key_split_across_many_chunks() {
    let example = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/stream-redactor.yaml"
    ))
    .unwrap();
    let example = example.replace("pool: {warm: 2, max: 20}", "pool: {warm: 1, max: 4}");
    let h = Harness::start(&[("ex.yaml", &example)]).await;
    let key_line = "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7VJTUt9Us8cKj";
    let raw = format!(
        "Here is the config. Call 010-555-0100 or mail ops@example.com.\n-----BEGIN RSA PRIVATE KEY-----\n{}\n-----END RSA PRIVATE KEY-----\nThat is all.",
        [key_line; 6].join("\n")
    );
    let chunks = chunk_at(&raw, &(1..200).map(|i| i * 5).collect::<Vec<_>>());
    let s = h.stream("support-bot", "output", &chunks).await;
    let shown = s.committed();
    assert!(
        !shown.contains("MIIEvQ") && !shown.contains("j\n"),
        "key material was shown: {shown}"
    );
    assert!(
        !shown.contains("010-555-0100") && !shown.contains("ops@example.com"),
        "{shown}"
    );
    assert!(
        shown.contains("[phone]")
            && shown.contains("[email]")
            && shown.contains("[key]")
            && shown.ends_with("That is all."),
        "{shown}"
    );
    let final_text = text(s.final_.as_ref().unwrap());
    assert!(!final_text.contains("MIIEvQ"), "{final_text}");
    h.stop_and_check_leaks().await;
}

/// A streamed run, real sandboxes and the real capability runner: a hook that calls a capability on
/// each of 200 flushes and on the final pass gets the run's 16 host_calls in all (docs/hooks.md §6).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streams_flushes_and_final_pass_share_the_runs_host_calls() {
    let chain = "apiVersion: sluice.dev/v1alpha1\nkind: Capability\nmetadata: {name: echo, namespace: default}\nspec: {endpoint: {builtin: echo}}\n---\napiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata: {name: calls, namespace: default}\nspec:\n  target: t-calls\n  triggerPoint: output\n  streaming: {flushChars: 4, lookbackChars: 0}\n  pool: {warm: 1, max: 4}\n  hooks:\n    - name: ask\n      action: detect\n      capabilities: [echo]\n      code: |\n        def execute(context, settings):\n            try:\n                context.host_call('echo', {'n': len(context['outgoing'])})\n                ok = 1\n            except HostCallError:\n                ok = 0\n            return {'action': 'detect', 'findings': {'ok': ok}}\n";
    let h = Harness::start(&[("calls.yaml", chain)]).await;
    let (tx, mut responses) = h.open_stream("t-calls", "output").await;
    // One chunk at a time, each committed before the next is sent: 200 flushes.
    for _ in 0..200 {
        tx.send(proto::StreamRequest {
            msg: Some(proto::stream_request::Msg::Chunk("abcd".into())),
        })
        .await
        .expect("send a chunk");
        match responses.message().await.expect("the stream goes on") {
            Some(proto::StreamResponse {
                msg: Some(proto::stream_response::Msg::Commit(c)),
            }) => assert_eq!(c, "abcd"),
            other => panic!("expected a commit, got {other:?}"),
        }
    }
    tx.send(proto::StreamRequest {
        msg: Some(proto::stream_request::Msg::Finish(proto::StreamFinish {})),
    })
    .await
    .expect("send finish");
    let final_ = loop {
        match responses.message().await.expect("the stream goes on") {
            Some(proto::StreamResponse {
                msg: Some(proto::stream_response::Msg::Final(f)),
            }) => break f,
            Some(_) => {}
            None => panic!("the stream ended without its final"),
        }
    };
    assert_eq!(final_.hooks.len(), 1, "{final_:?}");
    drop(tx);
    let event = h
        .audit()
        .into_iter()
        .find(|e| e["mode"] == "stream")
        .expect("the stream's audit event");
    let counts = event["host_call_summary"]["by"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let ok: u64 = counts
        .iter()
        .filter(|c| c["result"] == "ok")
        .filter_map(|c| c["count"].as_u64())
        .sum();
    assert_eq!(ok, 16, "one budget for the whole stream: {event}");
    assert_eq!(event["host_call_summary"]["total"], 201, "{event}");
    h.stop_and_check_leaks().await;
}
