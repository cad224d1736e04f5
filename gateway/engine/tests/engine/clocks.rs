//! What a hook sees of time: hooks of one walk cannot measure each other. Every clock a hook can
//! read (wall and monotonic, through `time` and `datetime`) stands at the moment the cell's first
//! walk began, in every hook and every walk of the trigger point; module code run ahead of a walk
//! (a prepared instance) reads the Unix epoch; and the run id hooks get carries no time. Real supervisors (the process
//! backend), real cells.

use crate::common;

use common::{Harness, hook, tenant};
use serde_json::{Value, json};

/// Reads every clock before and after some work, in module code and in `execute`.
const READER: &str = "import time, datetime
AT_LOAD = time.time_ns()
def readings():
    return [time.time_ns(), time.monotonic_ns(), time.perf_counter_ns(), datetime.datetime.now().timestamp()]
def execute(context, settings):
    before = readings()
    n = 0
    for i in range(300000):
        n += i % 7
    after = readings()
    return {'action': 'detect', 'findings': {'before': before, 'after': after, 'at_load': AT_LOAD, 'n': n}}
";

#[tokio::test]
async fn hooks_of_one_walk_read_the_same_standing_clocks() {
    let h = Harness::process(vec![tenant(
        "input",
        vec![
            hook("first", "detect", READER),
            hook("second", "detect", READER),
            hook("third", "detect", READER),
        ],
        json!({}),
    )])
    .await;
    let r = h.run("input", json!("hi")).await.expect("the run succeeds");
    assert_eq!(r.walk.hooks.len(), 3, "{:?}", r.walk);
    let findings: Vec<&Value> = r
        .walk
        .hooks
        .iter()
        .map(|h| h.findings.as_ref().expect("findings"))
        .collect();
    let first = &findings[0]["before"];
    assert!(
        first[0].as_u64().is_some_and(|ns| ns > 0),
        "the wall clock reads the walk's start, not the epoch: {first}"
    );
    for f in &findings {
        assert_eq!(&f["before"], first, "{findings:?}");
        assert_eq!(&f["after"], first, "{findings:?}");
        assert!(
            f["at_load"] == json!(0) || f["at_load"] == first[0],
            "module code reads the epoch ahead of the walk, the walk's moment in it: {f}"
        );
    }
}

#[tokio::test]
async fn every_flush_and_the_final_pass_of_a_stream_read_the_same_clocks() {
    let h = Harness::process(vec![tenant(
        "output",
        vec![json!({"name": "clock", "action": "detect", "capabilities": ["echo"], "code":
            "import time\ndef execute(context, settings):\n    context.host_call('echo', {'t': [time.time_ns(), time.monotonic_ns()]})\n    return {'action': 'pass'}\n"})],
        json!({"streaming": {"flushChars": 4, "lookbackChars": 0}}),
    )])
    .await;
    let s = h.stream(&["aaaa", "bbbb", "cccc"]).await;
    assert!(s.error.is_none(), "{:?}", s.error);
    assert!(s.final_.is_some());
    let seen = h.capabilities.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 4, "three flushes and the final pass");
    for call in &seen {
        assert_eq!(call.payload, seen[0].payload, "{seen:?}");
    }
}

#[tokio::test]
async fn the_run_id_a_hook_sees_carries_no_time() {
    let h = Harness::process(vec![tenant(
        "input",
        vec![hook(
            "id",
            "detect",
            "def execute(context, settings):\n    return {'action': 'detect', 'findings': {'run_id': context['run_id']}}\n",
        )],
        json!({}),
    )])
    .await;
    let r = h.run("input", json!("hi")).await.expect("the run succeeds");
    let seen = r.walk.hooks[0].findings.as_ref().expect("findings")["run_id"]
        .as_str()
        .expect("a run id")
        .to_string();
    let real = ulid::Ulid::from_string(&r.run_id).expect("the run id is a ULID");
    let hooks = ulid::Ulid::from_string(&seen).expect("hooks get a ULID");
    assert!(real.timestamp_ms() > 0);
    assert_eq!(hooks.timestamp_ms(), 0, "{seen}: no time in it");
    assert_eq!(
        hooks.random(),
        real.random(),
        "{seen} and {}: the same run, as the audit names it",
        r.run_id
    );
}
