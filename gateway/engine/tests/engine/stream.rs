//! `Engine::stream` without a transport, on the real supervisor: the window (flush, lookback, a split
//! pattern never committed), the state vector across flushes and a fresh one on the final path, a
//! block mid-stream, and the ways a stream is refused or cut short.

use crate::common;

use common::{Harness, py, tenant};
use serde_json::json;
use sluice_crds::Action;
use sluice_engine::{EngineError, StreamError, StreamInput};

const REDACT: &str = "import re\nreturn {'action': 'modify', 'outgoing': re.sub(r'010-\\d{4}-\\d{4}', '[phone]', context['outgoing'])}";

fn redactor(flush: u32, lookback: u32) -> sluice_crds::definition::Definition {
    tenant(
        "output",
        vec![py("phone", "modify", REDACT)],
        json!({"streaming": {"flushChars": flush, "lookbackChars": lookback}}),
    )
}

#[tokio::test]
async fn commits_hold_back_the_lookback_and_the_final_is_the_whole_reply() {
    let h = Harness::process(vec![tenant(
        "output",
        vec![py("noop", "modify", "return {'action': 'pass'}")],
        json!({"streaming": {"flushChars": 4, "lookbackChars": 2}}),
    )])
    .await;
    let s = h.stream(&["abcd", "ef"]).await;
    assert!(s.error.is_none(), "{:?}", s.error);
    assert_eq!(
        s.commits,
        ["ab", "cdef"],
        "the last 2 characters wait for the next batch"
    );
    let f = s.final_.expect("a final");
    assert_eq!(f.walk.payload, json!("abcdef"));
    assert_eq!(f.walk.action, Action::Pass);
}

#[tokio::test]
async fn a_pattern_split_across_chunks_is_never_committed() {
    let h = Harness::process(vec![redactor(8, 16)]).await;
    let s = h
        .stream(&["call me at 010-", "1234-", "5678 or not", " at all"])
        .await;
    let shown = s.commits.concat();
    assert!(!shown.contains("010-1234"), "{shown:?}");
    assert!(!shown.contains("1234-5678"), "{shown:?}");
    assert_eq!(shown, "call me at [phone] or not at all");
    let f = s.final_.expect("a final");
    assert_eq!(f.walk.payload, json!("call me at [phone] or not at all"));
    assert_eq!(f.walk.action, Action::Modify);
}

#[tokio::test]
async fn a_block_mid_stream_stops_commits_and_is_the_final() {
    let h = Harness::process(vec![tenant(
        "output",
        vec![py(
            "stop",
            "block",
            "if 'forbidden' in context['outgoing']:\n    return {'action': 'block', 'message': 'stopped'}\nreturn {'action': 'pass'}",
        )],
        json!({"streaming": {"flushChars": 4, "lookbackChars": 0}}),
    )])
    .await;
    let s = h
        .stream(&["fine ", "text ", "forbidden ", "more ", "text"])
        .await;
    assert_eq!(s.blocked, Some(("stopped".to_string(), "stop".to_string())));
    assert_eq!(s.commits_after_block, 0);
    assert!(!s.commits.concat().contains("forbidden"));
    let f = s.final_.expect("a final");
    assert_eq!(
        (f.walk.action, f.walk.terminal_index),
        (Action::Block, Some(0))
    );
}

#[tokio::test]
async fn state_threads_across_flushes_and_the_final_path_starts_fresh() {
    let h = Harness::process(vec![tenant(
        "output",
        vec![py(
            "count",
            "detect",
            "n = (context['state'] or 0) + 1\nreturn {'action': 'detect', 'findings': {'flush': n}, 'state': n}",
        )],
        json!({"streaming": {"flushChars": 3, "lookbackChars": 0}}),
    )])
    .await;
    let s = h.stream(&["aaa", "bbb", "ccc"]).await;
    let f = s.final_.expect("a final");
    assert_eq!(
        f.walk.hooks[0].findings,
        Some(json!({"flush": 1})),
        "the final path's vector is fresh"
    );
    // The stream path counted its three flushes: the audit records them.
    let events = h.audit.events();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["stream"]["flushes"], 3);
    assert_eq!(events[0]["mode"], "stream");
}

#[tokio::test]
async fn flushes_see_the_state_the_previous_flush_left() {
    let h = Harness::process(vec![tenant(
        "output",
        vec![py(
            "count",
            "modify",
            "n = (context['state'] or 0) + 1\nreturn {'action': 'modify', 'outgoing': context['outgoing'] + str(n), 'state': n}",
        )],
        json!({"streaming": {"flushChars": 2, "lookbackChars": 0}}),
    )])
    .await;
    let s = h.stream(&["ab", "cd", "ef"]).await;
    assert_eq!(s.commits, ["ab1", "cd2", "ef3"]);
    assert_eq!(s.final_.expect("a final").walk.payload, json!("abcdef1"));
}

#[tokio::test]
async fn chunks_already_waiting_are_run_as_one_flush() {
    let h = Harness::process(vec![tenant(
        "output",
        vec![py(
            "count",
            "modify",
            "n = (context['state'] or 0) + 1\nreturn {'action': 'modify', 'outgoing': context['outgoing'] + str(n), 'state': n}",
        )],
        json!({"streaming": {"flushChars": 2, "lookbackChars": 0}}),
    )])
    .await;
    let mut inputs = vec![StreamInput::Open(h.open("output"))];
    inputs.extend(["ab", "cd", "ef"].map(|c| StreamInput::Chunk(c.into())));
    inputs.push(StreamInput::Finish);
    let s = h.stream_all_at_once(inputs).await;
    assert_eq!(
        s.commits,
        ["abcdef1"],
        "a client ahead of the chain gets one batch"
    );
}

#[tokio::test]
async fn a_stream_must_start_with_open_and_open_only_once() {
    let h = Harness::process(vec![redactor(8, 4)]).await;
    let s = h.stream_inputs(vec![StreamInput::Chunk("hi".into())]).await;
    assert!(
        matches!(&s.error, Some(StreamError::Refused(EngineError::InvalidArgument(m))) if m.contains("starts with open")),
        "{:?}",
        s.error
    );
    let open = StreamInput::Open(h.open("output"));
    let s = h.stream_inputs(vec![open.clone(), open]).await;
    assert!(
        matches!(&s.error, Some(StreamError::Refused(EngineError::InvalidArgument(m))) if m.contains("only once")),
        "{:?}",
        s.error
    );
    assert!(s.final_.is_none());
}

#[tokio::test]
async fn structured_trigger_points_cannot_be_streamed() {
    let h = Harness::process(vec![redactor(8, 4)]).await;
    let s = h
        .stream_inputs(vec![
            StreamInput::Open(h.open("before_model")),
            StreamInput::Finish,
        ])
        .await;
    assert!(
        matches!(&s.error, Some(StreamError::Refused(EngineError::InvalidArgument(m))) if m.contains("structured payload")),
        "{:?}",
        s.error
    );
}

#[tokio::test]
async fn a_stream_closed_without_finish_is_cancelled_and_audited() {
    let h = Harness::process(vec![redactor(8, 4)]).await;
    let s = h
        .stream_inputs(vec![
            StreamInput::Open(h.open("output")),
            StreamInput::Chunk("partial".into()),
        ])
        .await;
    assert!(
        matches!(&s.error, Some(StreamError::Cancelled(m)) if m.contains("without finish")),
        "{:?}",
        s.error
    );
    assert!(s.final_.is_none());
    let events = h.audit.events();
    assert_eq!(events.len(), 1);
    assert!(
        events[0]["error"]
            .as_str()
            .unwrap_or_default()
            .contains("without finish")
    );
}

#[tokio::test]
async fn a_reply_over_the_stream_limit_is_refused() {
    let backend = common::process_backend();
    let mut limits = common::limits();
    limits.stream_bytes = 10;
    let h = Harness::with_backend(std::sync::Arc::new(backend), vec![redactor(4, 0)], limits).await;
    let s = h.stream(&["0123456789", "x"]).await;
    assert!(
        matches!(s.error, Some(StreamError::TooLarge(10))),
        "{:?}",
        s.error
    );
}

#[tokio::test]
async fn the_audit_records_what_hooks_did_on_the_stream_path() {
    // Fails on the short batches of the stream path, redacts on the final path's whole reply.
    let h = Harness::process(vec![tenant(
        "output",
        vec![py(
            "phone",
            "modify",
            "if len(context['outgoing']) < 20:\n    raise RuntimeError('too short to judge')\nimport re\nreturn {'action': 'modify', 'outgoing': re.sub(r'010-\\d{4}-\\d{4}', '[phone]', context['outgoing'])}",
        )],
        json!({"failurePolicy": "Open", "streaming": {"flushChars": 8, "lookbackChars": 0}}),
    )])
    .await;
    let s = h.stream(&["call me ", "at 010-12", "34-5678 ", "ok"]).await;
    assert!(s.error.is_none(), "{:?}", s.error);
    let f = s.final_.expect("a final");
    assert_eq!(f.walk.payload, json!("call me at [phone] ok"));
    let event = &h.audit.events()[0];
    let stream = &event["stream"];
    assert_eq!(
        stream["committed_while_failing"], true,
        "text was shown while the redactor was failing: {event}"
    );
    let hooks = stream["hooks"].as_array().expect("per hook");
    assert_eq!(hooks.len(), 1, "{event}");
    assert_eq!(hooks[0]["name"], "phone");
    assert_eq!(hooks[0]["errors"], 4, "{event}");
    assert_eq!(hooks[0]["actions"]["pass"], 4, "{event}");
    assert!(
        hooks[0]["error"]
            .as_str()
            .is_some_and(|e| e.contains("too short to judge")),
        "{event}"
    );
}

#[tokio::test]
async fn a_clean_stream_path_is_recorded_as_such() {
    let h = Harness::process(vec![redactor(8, 16)]).await;
    let s = h.stream(&["call me at 010-", "1234-", "5678 or not"]).await;
    assert!(s.error.is_none(), "{:?}", s.error);
    let stream = &h.audit.events()[0]["stream"];
    assert_eq!(stream["committed_while_failing"], false, "{stream}");
    let hooks = stream["hooks"].as_array().expect("per hook");
    assert_eq!(hooks[0]["errors"], 0, "{stream}");
    assert!(
        hooks[0]["actions"]["modify"].as_u64().unwrap_or(0) >= 1,
        "{stream}"
    );
}

/// Text was shown while a hook was failing on the stream path (under `Open`), and the final pass
/// went clean: the run's audit still says a failure was passed over, which one, and the failing
/// hook counts in the hook error metric.
#[tokio::test]
async fn failures_on_the_stream_path_are_in_the_audit_even_when_the_final_pass_is_clean() {
    let h = Harness::process(vec![tenant(
        "output",
        vec![py(
            "judge",
            "modify",
            "if len(context['outgoing']) < 20:\n    raise RuntimeError('too short to judge')\nreturn {'action': 'pass'}",
        )],
        json!({"failurePolicy": "Open", "streaming": {"flushChars": 8, "lookbackChars": 0}}),
    )])
    .await;
    let s = h.stream(&["call me ", "at 010-12", "34-5678 ", "ok"]).await;
    assert!(s.error.is_none(), "{:?}", s.error);
    assert!(!s.commits.is_empty(), "text was committed");
    let event = &h.audit.events()[0];
    assert_eq!(event["stream"]["committed_while_failing"], true, "{event}");
    assert_eq!(event["policy_outcome"], "passed_over", "{event}");
    assert!(
        event["failure_reason"]
            .as_str()
            .is_some_and(|r| r.contains("judge") && r.contains("too short to judge")),
        "{event}"
    );
    let errors = h
        .engine
        .metrics()
        .registry
        .gather()
        .into_iter()
        .find(|f| f.name() == "sluice_gateway_hook_errors_total")
        .map(|f| {
            f.get_metric()
                .iter()
                .map(|m| m.get_counter().get_value())
                .sum::<f64>()
        })
        .unwrap_or_default();
    assert_eq!(errors, 4.0, "one per failed flush");
}
