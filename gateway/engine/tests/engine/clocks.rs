//! What a hook sees of time: hooks of one run cannot measure each other. Every clock a hook can
//! read (wall and monotonic, through `time` and `datetime`) stands at the run's moment (its start,
//! to the whole second, which the gateway sends with every walk): in every hook and every walk of
//! the run, whichever sandbox serves it (the baseline's and the tenant's, a stream's flushes and its
//! final pass, a walk resumed in a fresh sandbox, a shadow run); module code run ahead of a walk (a
//! prepared instance) reads the Unix epoch; and the run id hooks get carries no time. Real
//! supervisors (the process backend), real cells.

use crate::common;

use common::dying::DyingBackend;
use common::{Harness, baseline, baseline_with, hook, tenant};
use serde_json::{Value, json};
use sluice_engine::RunResult;
use sluice_sandbox_process::ProcessBackend;
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// The moment the hooks of the run `run_id` read, in nanoseconds: its start to the whole second,
/// the time part of the run's id (as the audit shows it).
fn moment_of(run_id: &str) -> u64 {
    let ms = ulid::Ulid::from_string(run_id)
        .expect("the run id is a ULID")
        .timestamp_ms();
    ms / 1000 * 1_000_000_000
}

/// Each hook's findings, by the name the answer gives it.
fn findings_of(r: &RunResult) -> Vec<(String, Value)> {
    r.walk
        .hooks
        .iter()
        .map(|h| {
            let f = h.findings.clone();
            (
                h.shown_name(),
                f.unwrap_or_else(|| panic!("{h:?}: no findings")),
            )
        })
        .collect()
}

/// A walk that resumes under `Open` in a fresh sandbox, after the one it began in died, reads the
/// moment the dead sandbox's hooks read: the run's, not the moment the fresh sandbox first walked.
#[tokio::test]
async fn a_walk_resumed_in_a_fresh_sandbox_reads_the_runs_moment() {
    let process = ProcessBackend::new().expect("a temporary directory");
    let backend = DyingBackend::new(Arc::new(process), "before");
    let h = Harness::with_backend(
        Arc::new(backend),
        vec![tenant(
            "input",
            vec![
                hook("before", "detect", READER),
                hook("after", "detect", READER),
            ],
            json!({"failurePolicy": "Open"}),
        )],
        common::limits(),
    )
    .await;
    let r = h.run("input", json!("hi")).await.expect("the run succeeds");
    let found = findings_of(&r);
    let names: Vec<&str> = found.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["before", "after"], "{:?}", r.walk);
    assert!(
        r.walk.hooks.iter().all(|h| h.error.is_none()),
        "{:?}",
        r.walk
    );
    assert!(
        h.engine.metrics().retirements("broken") >= 1,
        "the first sandbox died mid-walk"
    );
    assert_eq!(
        found[1].1["before"], found[0].1["before"],
        "the hook after the resume reads what the hook before it read"
    );
    assert_eq!(found[0].1["before"][0], json!(moment_of(&r.run_id)));
    assert_eq!(found[0].1["before"][1], json!(moment_of(&r.run_id)));
}

/// The baseline and the tenant's chain run in sandboxes of their own (the baseline's claimed again
/// for each of its walks): their hooks read the one moment of the run.
#[tokio::test]
async fn the_baseline_and_the_tenant_of_one_run_read_its_moment() {
    let h = Harness::process(vec![
        baseline("input", vec![hook("base", "detect", READER)]),
        tenant("input", vec![hook("own", "detect", READER)], json!({})),
    ])
    .await;
    for _ in 0..2 {
        let r = h.run("input", json!("hi")).await.expect("the run succeeds");
        let found = findings_of(&r);
        let names: Vec<&str> = found.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["baseline/base", "own"], "{:?}", r.walk);
        assert_eq!(
            found[1].1["before"], found[0].1["before"],
            "the tenant's hook reads what the baseline's read"
        );
        let moment = moment_of(&r.run_id);
        assert_eq!(found[0].1["before"][0], json!(moment));
        assert_eq!(found[0].1["after"][1], json!(moment));
    }
}

/// A stream beside a baseline: the baseline's sandbox is handed back after each of its walks and
/// claimed again (a fresh cell each time), and still every flush and the final pass, of both
/// chains, read the stream's moment.
#[tokio::test]
async fn every_walk_of_a_stream_beside_a_baseline_reads_its_moment() {
    let clock = |name: &str| {
        json!({"name": name, "action": "detect", "capabilities": ["echo"], "code":
            "import time\ndef execute(context, settings):\n    context.host_call('echo', {'t': [time.time_ns(), time.monotonic_ns()]})\n    return {'action': 'pass'}\n"})
    };
    let window = json!({"streaming": {"flushChars": 4, "lookbackChars": 0}});
    let h = Harness::process(vec![
        baseline_with("output", vec![clock("base")], window.clone()),
        tenant("output", vec![clock("own")], window),
    ])
    .await;
    let s = h.stream(&["aaaa", "bbbb", "cccc"]).await;
    assert!(s.error.is_none(), "{:?}", s.error);
    let run_id = s.final_.expect("a final").run_id;
    let seen = h.capabilities.seen.lock().unwrap().clone();
    let chains: Vec<&str> = seen.iter().map(|c| c.chain.as_str()).collect();
    assert_eq!(
        chains.len(),
        8,
        "three flushes and the final pass, each through both chains: {chains:?}"
    );
    assert!(chains.contains(&"sluice-system/baseline") && chains.contains(&"team/tenant"));
    let moment = moment_of(&run_id);
    for call in &seen {
        assert_eq!(
            call.payload,
            json!({"t": [moment, moment]}),
            "{}: {seen:?}",
            call.chain
        );
    }
}

/// A rollout's candidate in shadow runs on the live run's payload, after it, in a sandbox of its
/// own: its hooks read the live run's moment.
#[tokio::test]
async fn a_shadow_run_reads_the_moment_of_its_live_run() {
    let reader = |marker: &str| {
        let code = format!("# {marker}\n{READER}");
        hook("clock", "detect", &code)
    };
    let pool = json!({"pool": {"warm": 1, "max": 4}});
    let h = Harness::process(vec![tenant("input", vec![reader("live")], pool.clone())]).await;
    let mut candidate = pool;
    candidate["rollout"] = json!({"strategy": "Shadow"});
    h.apply(vec![tenant("input", vec![reader("candidate")], candidate)])
        .await;
    assert!(
        h.engine.pools().wait_warm(Duration::from_secs(20)).await,
        "the candidate's pool never warmed"
    );
    let until = Instant::now() + Duration::from_secs(30);
    let (live, shadow) = loop {
        let r = h.run("input", json!("hi")).await.expect("the run succeeds");
        // A shadow run with no sandbox free at once is dropped: then the next run tries again.
        let given_up = Instant::now() + Duration::from_secs(3);
        let shadow = loop {
            let found = h
                .audit
                .events()
                .into_iter()
                .find(|e| e["mode"] == "shadow" && e["run_id"] == r.run_id.as_str());
            if found.is_some() || Instant::now() > given_up {
                break found;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        if let Some(shadow) = shadow {
            break (r, shadow);
        }
        assert!(Instant::now() < until, "no shadow run was made");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let live_reading = &findings_of(&live)[0].1["before"];
    let shadow_reading = &shadow["hooks"][0]["findings"]["before"];
    assert_eq!(
        shadow_reading, live_reading,
        "the shadow's hook reads what the live hook read: {shadow}"
    );
    assert_eq!(live_reading[0], json!(moment_of(&live.run_id)));
}
