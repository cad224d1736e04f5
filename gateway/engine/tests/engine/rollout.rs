//! Rolling out new hook code (`spec.rollout`): a shadow candidate is compared and never applied, a
//! canary serves a stable share of sessions, steps up and is promoted, or is rolled back on its own
//! when it fails; orders by annotation; revision history. Real supervisors (the process backend).

use crate::common;

use common::{Harness, NS, PLATFORM, TARGET, py, tenant};
use serde_json::{Value, json};
use sluice_crds::definition::{Definition, Origin, Spec};
use sluice_engine::RolloutStatus;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Answers which version ran: the payload becomes `tag`.
fn tagging(tag: &str) -> Value {
    py(
        "tag",
        "modify",
        &format!("return {{'action': 'modify', 'outgoing': {tag:?}}}"),
    )
}

/// Blocks anything that mentions "secret".
fn blocking() -> Value {
    py(
        "guard",
        "block",
        "if 'secret' in context['outgoing']:\n    return {'action': 'block', 'message': 'no secrets'}\nreturn {'action': 'pass'}",
    )
}

/// A tenant chain at input with `hooks` and `extra` spec fields, and a warm pool of two.
fn chain(hooks: Vec<Value>, mut extra: Value) -> Definition {
    extra["pool"] = json!({"warm": 2, "max": 4});
    tenant("input", hooks, extra)
}

fn with_annotation(mut d: Definition, key: &str, value: &str) -> Definition {
    match key {
        "sluice.dev/promote" => d.orders.promote = Some(value.into()),
        _ => d.orders.rollback = Some(value.into()),
    }
    d
}

fn status(h: &Harness) -> RolloutStatus {
    let all = h.engine.rollouts();
    all.into_iter()
        .find(|s| s.chain == format!("{NS}/tenant"))
        .expect("the tenant chain has a rollout status")
}

fn revision_of(d: &Definition) -> String {
    match &d.spec {
        Spec::HookChain(spec) => spec.code_hash().trim_start_matches("sha256:").to_string(),
        Spec::Capability(_) => unreachable!(),
    }
}

async fn text(h: &Harness, payload: &str, session: &str) -> String {
    let r = h
        .run_session("input", json!(payload), session)
        .await
        .expect("the run succeeds");
    match r.walk.action {
        sluice_crds::Action::Block => format!("blocked: {}", r.walk.message),
        _ => r.walk.payload.as_str().unwrap_or_default().to_string(),
    }
}

/// Waits until the shadow runs started so far are all compared or dropped.
async fn shadows_settled(h: &Harness, started: u64) -> RolloutStatus {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let s = status(h);
        let shadow = s.shadow.clone().expect("a shadow summary");
        if shadow.runs + shadow.dropped >= started {
            return s;
        }
        assert!(Instant::now() < until, "shadow runs never finished: {s:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn metric(h: &Harness, name: &str, labels: &[(&str, &str)]) -> u64 {
    let mut out = Vec::new();
    prometheus::Encoder::encode(
        &prometheus::TextEncoder::new(),
        &h.engine.metrics().registry.gather(),
        &mut out,
    )
    .expect("metrics render");
    let text = String::from_utf8(out).expect("metrics are text");
    text.lines()
        .filter(|l| {
            l.starts_with(name)
                && labels
                    .iter()
                    .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

#[tokio::test]
async fn a_shadow_candidate_that_blocks_more_is_measured_and_never_changes_a_live_answer() {
    let live = chain(
        vec![py("guard", "block", "return {'action': 'pass'}")],
        json!({}),
    );
    let h = Harness::process(vec![live]).await;
    let candidate = chain(vec![blocking()], json!({"rollout": {"strategy": "Shadow"}}));
    let candidate_revision = revision_of(&candidate);
    h.apply(vec![candidate]).await;
    assert_eq!(status(&h).phase, "Shadowing");
    let mut answers = Vec::new();
    for i in 0..12 {
        let payload = if i % 2 == 0 { "a secret plan" } else { "hello" };
        answers.push(text(&h, payload, &format!("s-{i}")).await);
        // Give the shadow run its sandbox back before the next live run: the comparison, not the
        // budget, is what this test is about.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Not one live answer changed: the live hook passes everything.
    for (i, a) in answers.iter().enumerate() {
        let expected = if i % 2 == 0 { "a secret plan" } else { "hello" };
        assert_eq!(a, expected, "live answer {i} changed");
    }
    let s = shadows_settled(&h, 12).await;
    let shadow = s.shadow.expect("a shadow summary");
    assert!(
        shadow.runs >= 6,
        "too few shadow runs were made: {shadow:?}"
    );
    assert_eq!(shadow.errors, 0, "{shadow:?}");
    // Every compared run with "secret" disagreed (block vs pass), the others agreed.
    assert_eq!(
        shadow.action_differs + shadow.agreed,
        shadow.runs,
        "{shadow:?}"
    );
    assert!(
        shadow.action_differs >= 1 && shadow.agreed >= 1,
        "{shadow:?}"
    );
    assert!(
        shadow.disagreement_percent > 0.0 && shadow.disagreement_percent < 100.0,
        "{shadow:?}"
    );
    let hook = shadow
        .hooks
        .iter()
        .find(|x| x.hook == "guard")
        .expect("the guard hook is compared");
    assert_eq!(hook.differs, shadow.action_differs, "{hook:?}");
    assert!(
        hook.p99_ms >= hook.p50_ms && hook.live_p50_ms.is_some(),
        "{hook:?}"
    );
    // The same counts in the metrics.
    let chain = format!("{NS}/tenant");
    assert_eq!(
        metric(
            &h,
            "sluice_gateway_shadow_runs_total",
            &[("chain", &chain), ("verdict", "action_differs")]
        ),
        shadow.action_differs
    );
    // The audit: live events name the live revision and the shadow run; shadow events the verdict.
    let events = h.audit.events();
    let live_events: Vec<&Value> = events.iter().filter(|e| e["mode"] == "run").collect();
    let shadow_events: Vec<&Value> = events.iter().filter(|e| e["mode"] == "shadow").collect();
    assert!(live_events.iter().all(
        |e| e["rollout"][0]["answered_by"] == "live" && e["rollout"][0]["strategy"] == "Shadow"
    ));
    assert!(
        live_events
            .iter()
            .filter(|e| e["rollout"][0]["shadow"] == "started")
            .all(|e| e["rollout"][0]["shadow_revision"] == json!(candidate_revision))
    );
    assert_eq!(shadow_events.len() as u64, shadow.runs);
    assert!(
        shadow_events
            .iter()
            .all(|e| e["code_hash"] == json!(format!("sha256:{candidate_revision}")))
    );
    assert_eq!(
        shadow_events
            .iter()
            .filter(|e| e["shadow_verdict"] == "action_differs")
            .count() as u64,
        shadow.action_differs
    );
}

#[tokio::test]
async fn a_canary_at_ten_percent_serves_about_a_tenth_of_sessions_each_one_consistently() {
    let h = Harness::process(vec![chain(vec![tagging("v1")], json!({}))]).await;
    h.apply(vec![chain(
        vec![tagging("v2")],
        json!({"rollout": {"strategy": "Canary", "steps": [10], "stepDuration": "1h"}}),
    )])
    .await;
    assert_eq!(status(&h).canary_percent, 10);
    let mut by_session: HashMap<String, Vec<String>> = HashMap::new();
    for round in 0..2 {
        for i in 0..150 {
            let session = format!("conversation-{i}");
            let answer = text(&h, "hi", &session).await;
            by_session.entry(session).or_default().push(answer);
        }
        let _ = round;
    }
    for (session, answers) in &by_session {
        assert!(
            answers.iter().all(|a| *a == answers[0]),
            "{session} saw both versions: {answers:?}"
        );
    }
    let canary = by_session.values().filter(|a| a[0] == "v2").count();
    assert!(
        (5..=30).contains(&canary),
        "{canary} of 150 sessions on the canary at 10%"
    );
    let s = status(&h);
    let [live, cand] = s.canary.expect("canary tallies");
    assert_eq!(cand.runs as usize, canary * 2);
    assert_eq!(live.runs as usize, (150 - canary) * 2);
}

#[tokio::test]
async fn runs_without_a_session_are_placed_each_on_its_own() {
    let h = Harness::process(vec![chain(vec![tagging("v1")], json!({}))]).await;
    h.apply(vec![chain(
        vec![tagging("v2")],
        json!({"rollout": {"strategy": "Canary", "steps": [50], "stepDuration": "1h"}}),
    )])
    .await;
    let mut answers = Vec::new();
    for _ in 0..40 {
        answers.push(text(&h, "hi", "").await);
    }
    let on_canary = answers.iter().filter(|a| *a == "v2").count();
    assert!(
        (5..=35).contains(&on_canary),
        "{on_canary} of 40 runs without a session on a 50% canary"
    );
}

#[tokio::test]
async fn a_canary_that_errors_is_rolled_back_on_its_own_and_the_live_hooks_serve_everyone() {
    let h = Harness::process(vec![chain(
        vec![tagging("v1")],
        json!({"failurePolicy": "Open"}),
    )])
    .await;
    let failing = py("tag", "modify", "raise ValueError('broken')");
    let candidate = chain(
        vec![failing],
        json!({"failurePolicy": "Open", "rollout": {"strategy": "Canary", "steps": [50], "minRuns": 4, "stepDuration": "1h"}}),
    );
    h.apply(vec![candidate.clone()]).await;
    let mut served_candidate = 0;
    for i in 0..60 {
        // Under Open, a failing hook passes the payload on unchanged.
        if text(&h, "hi", &format!("s-{i}")).await == "hi" {
            served_candidate += 1;
        }
        if status(&h).phase == "RolledBack" {
            break;
        }
    }
    let s = status(&h);
    assert_eq!(s.phase, "RolledBack", "{s:?}");
    assert!(s.message.contains("error rate"), "{}", s.message);
    assert!(
        served_candidate >= 4,
        "it was judged on {served_candidate} runs"
    );
    assert_eq!(s.candidate_revision, None);
    // Everyone is on the live revision again, and the same candidate applied again stays out.
    for i in 0..20 {
        assert_eq!(text(&h, "hi", &format!("s-{i}")).await, "v1");
    }
    h.apply(vec![candidate]).await;
    assert_eq!(status(&h).phase, "RolledBack");
    assert_eq!(text(&h, "hi", "s-1").await, "v1");
    let chain_name = format!("{NS}/tenant");
    assert_eq!(
        metric(
            &h,
            "sluice_gateway_rollout_events_total",
            &[("chain", &chain_name), ("event", "rolled_back")]
        ),
        1
    );
}

#[tokio::test]
async fn a_canary_steps_up_and_is_promoted_for_every_session() {
    let v1 = chain(vec![tagging("v1")], json!({}));
    let h = Harness::process(vec![v1.clone()]).await;
    let v2 = chain(
        vec![tagging("v2")],
        json!({"rollout": {"strategy": "Canary", "steps": [20, 60], "minRuns": 3, "stepDuration": "200ms"}}),
    );
    h.apply(vec![v2.clone()]).await;
    let until = Instant::now() + Duration::from_secs(60);
    let mut steps_seen = vec![status(&h).canary_percent];
    let mut i = 0;
    while status(&h).phase == "Progressing" {
        assert!(Instant::now() < until, "never promoted: {:?}", status(&h));
        text(&h, "hi", &format!("s-{i}")).await;
        i += 1;
        let p = status(&h).canary_percent;
        if steps_seen.last() != Some(&p) {
            steps_seen.push(p);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let s = status(&h);
    assert_eq!(s.phase, "RolledOut", "{s:?}");
    assert_eq!(s.live_revision, revision_of(&v2));
    assert_eq!(steps_seen[..2], [20, 60], "{steps_seen:?}");
    for i in 0..30 {
        assert_eq!(text(&h, "hi", &format!("after-{i}")).await, "v2");
    }
    // The audit names the revision that answered.
    let last = h.audit.events().pop().expect("an audit event");
    assert_eq!(
        last["code_hash"],
        json!(format!("sha256:{}", revision_of(&v2)))
    );
}

#[tokio::test]
async fn orders_by_annotation_promote_or_roll_back_the_candidate_they_name() {
    let v1 = chain(vec![tagging("v1")], json!({}));
    let h = Harness::process(vec![v1.clone()]).await;
    let shadowed = |tag: &str| {
        chain(
            vec![tagging(tag)],
            json!({"rollout": {"strategy": "Shadow"}}),
        )
    };
    // A stale order (naming another revision) does nothing.
    let v2 = with_annotation(shadowed("v2"), "sluice.dev/rollback", "0000000000");
    h.apply(vec![v2.clone()]).await;
    assert_eq!(status(&h).phase, "Shadowing");
    // Rolling back restores the previous revision's code hash for everyone.
    let v2_back = with_annotation(
        shadowed("v2"),
        "sluice.dev/rollback",
        &revision_of(&v2)[..8],
    );
    h.apply(vec![v2_back]).await;
    let s = status(&h);
    assert_eq!(s.phase, "RolledBack");
    assert_eq!(s.live_revision, revision_of(&v1));
    assert_eq!(text(&h, "hi", "s").await, "v1");
    // A new candidate, promoted by name.
    let v3 = shadowed("v3");
    h.apply(vec![v3.clone()]).await;
    assert_eq!(status(&h).phase, "Shadowing");
    h.apply(vec![with_annotation(
        v3.clone(),
        "sluice.dev/promote",
        &revision_of(&v3),
    )])
    .await;
    assert_eq!(status(&h).live_revision, revision_of(&v3));
    assert_eq!(text(&h, "hi", "s").await, "v3");
    // Removing spec.rollout promotes as well.
    h.apply(vec![shadowed("v4")]).await;
    assert_eq!(
        text(&h, "hi", "s").await,
        "v3",
        "a shadow candidate never answers"
    );
    h.apply(vec![chain(vec![tagging("v4")], json!({}))]).await;
    assert_eq!(status(&h).phase, "RolledOut");
    assert_eq!(text(&h, "hi", "s").await, "v4");
}

#[tokio::test]
async fn a_restarted_gateway_goes_on_with_the_live_hooks_and_the_canary_step_it_had() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let file = dir.path().join("state/rollouts.json");
    let v1 = chain(vec![tagging("v1")], json!({}));
    let v2 = chain(
        vec![tagging("v2")],
        json!({"rollout": {"strategy": "Canary", "steps": [10, 30], "minRuns": 1, "stepDuration": "1ms"}}),
    );
    let first = Harness::process(vec![]).await;
    first.engine.keep_rollouts_in(file.clone());
    first.apply(vec![v1.clone()]).await;
    first.apply(vec![v2.clone()]).await;
    // Step up once: one candidate run, then one more run to judge it.
    let mut i = 0;
    while status(&first).canary_percent == 10 {
        text(&first, "hi", &format!("s-{i}")).await;
        i += 1;
        assert!(i < 500, "the canary never stepped up");
    }
    assert_eq!(status(&first).canary_percent, 30);
    drop(first);
    // A new gateway, the same chain file (the candidate) and the same state.
    let second = Harness::process(vec![]).await;
    second.engine.keep_rollouts_in(file);
    second.apply(vec![v2.clone()]).await;
    let s = status(&second);
    assert_eq!(s.phase, "Progressing", "{s:?}");
    assert_eq!(
        s.live_revision,
        revision_of(&v1),
        "the candidate must not go live on a restart"
    );
    assert_eq!(s.canary_percent, 30);
    assert_eq!(s.revisions.len(), 2);
    // Without the state, the chain file's hooks would be live at once.
    let third = Harness::process(vec![v2.clone()]).await;
    assert_eq!(status(&third).live_revision, revision_of(&v2));
}

#[tokio::test]
async fn an_unreadable_state_file_is_started_over_not_fatal() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let file = dir.path().join("rollouts.json");
    std::fs::write(&file, "{not json").expect("write");
    let h = Harness::process(vec![]).await;
    h.engine.keep_rollouts_in(file.clone());
    let v1 = chain(vec![tagging("v1")], json!({}));
    h.apply(vec![v1.clone()]).await;
    assert_eq!(status(&h).live_revision, revision_of(&v1));
    assert_eq!(text(&h, "hi", "s").await, "v1");
    // And the file is good again.
    let saved: Value = serde_json::from_slice(&std::fs::read(&file).expect("read")).expect("JSON");
    assert_eq!(saved[0]["name"], "tenant");
}

#[tokio::test]
async fn history_keeps_the_newest_revisions_up_to_the_limit() {
    let h = Harness::process(vec![chain(
        vec![tagging("v0")],
        json!({"revisionHistoryLimit": 3}),
    )])
    .await;
    let mut revisions = Vec::new();
    for i in 1..=5 {
        let d = chain(
            vec![tagging(&format!("v{i}"))],
            json!({"revisionHistoryLimit": 3}),
        );
        revisions.push(revision_of(&d));
        h.apply(vec![d]).await;
    }
    let s = status(&h);
    let kept: Vec<&str> = s.revisions.iter().map(|r| r.revision.as_str()).collect();
    assert_eq!(
        kept,
        revisions[2..]
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>()
    );
    let numbers: Vec<u64> = s.revisions.iter().map(|r| r.number).collect();
    assert_eq!(numbers, [4, 5, 6]);
    assert_eq!(s.live_revision, revisions[4]);
}

#[tokio::test]
async fn hooks_in_shadow_call_only_capabilities_safe_to_repeat() {
    let capability = |name: &str, safe: bool| Definition {
        origin: Origin {
            file: "caps.yaml".into(),
            line: 1,
        },
        namespace: NS.into(),
        name: name.into(),
        spec: Spec::Capability(Box::new(
            serde_json::from_value(json!({"endpoint": {"builtin": "echo"}, "safeToRepeat": safe}))
                .expect("a valid Capability spec"),
        )),
        superseded: None,
        code_lines: Vec::new(),
        orders: Default::default(),
        directed: None,
    };
    let calling = |tag: &str| {
        let mut hook = py(
            "tag",
            "modify",
            &format!(
                "for name in ('echo', 'charge'):\n    try:\n        context.host_call(name, {{'n': 1}})\n    except HostCallError:\n        pass\nreturn {{'action': 'modify', 'outgoing': {tag:?}}}"
            ),
        );
        hook["capabilities"] = json!(["echo", "charge"]);
        hook
    };
    let h = Harness::process(vec![
        chain(vec![calling("v1")], json!({})),
        capability("echo", true),
        capability("charge", false),
    ])
    .await;
    h.apply(vec![
        chain(
            vec![calling("v2")],
            json!({"rollout": {"strategy": "Shadow"}}),
        ),
        capability("echo", true),
        capability("charge", false),
    ])
    .await;
    for i in 0..4 {
        assert_eq!(text(&h, "hi", &format!("s-{i}")).await, "v1");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let shadow = shadows_settled(&h, 4)
        .await
        .shadow
        .expect("a shadow summary");
    assert!(shadow.runs >= 1, "{shadow:?}");
    assert_eq!(
        shadow.host_calls_refused, shadow.runs,
        "one charge refused per shadow run"
    );
    let seen = h.capabilities.seen.lock().unwrap().clone();
    let count = |name: &str| seen.iter().filter(|c| c.name == name).count() as u64;
    assert_eq!(count("charge"), 4, "only the live runs charged");
    assert_eq!(
        count("echo"),
        4 + shadow.runs,
        "echo is safe to repeat: shadows called it too"
    );
    let _ = (PLATFORM, TARGET);
}

/// A capability safe to repeat is still not called in shadow when one of its gates or dispatch
/// steps is not: they would reserve or charge a second time for what the live run already paid.
#[tokio::test]
async fn a_shadow_never_reaches_a_gate_or_dispatch_step_not_safe_to_repeat() {
    let capability = |name: &str, spec: Value| Definition {
        origin: Origin {
            file: "caps.yaml".into(),
            line: 1,
        },
        namespace: NS.into(),
        name: name.into(),
        spec: Spec::Capability(Box::new(
            serde_json::from_value(spec).expect("a valid Capability spec"),
        )),
        superseded: None,
        code_lines: Vec::new(),
        orders: Default::default(),
        directed: None,
    };
    let calling = |tag: &str| {
        let mut hook = py(
            "tag",
            "modify",
            &format!(
                "for name in ('echo', 'gated', 'settled'):\n    try:\n        context.host_call(name, {{'n': 1}})\n    except HostCallError:\n        pass\nreturn {{'action': 'modify', 'outgoing': {tag:?}}}"
            ),
        );
        hook["capabilities"] = json!(["echo", "gated", "settled"]);
        hook
    };
    let capabilities = || {
        vec![
            capability(
                "echo",
                json!({"endpoint": {"builtin": "echo"}, "safeToRepeat": true}),
            ),
            capability(
                "gated",
                json!({"endpoint": {"builtin": "echo"}, "safeToRepeat": true, "gates": ["credit.check"]}),
            ),
            capability(
                "settled",
                json!({"endpoint": {"builtin": "echo"}, "safeToRepeat": true, "dispatch": ["credit.consume"]}),
            ),
            capability("credit.check", json!({"endpoint": {"builtin": "echo"}})),
            capability(
                "credit.consume",
                json!({"endpoint": {"builtin": "echo"}, "safeToRepeat": false}),
            ),
        ]
    };
    let mut live = vec![chain(vec![calling("v1")], json!({}))];
    live.extend(capabilities());
    let h = Harness::process(live).await;
    let mut shadowed = vec![chain(
        vec![calling("v2")],
        json!({"rollout": {"strategy": "Shadow"}}),
    )];
    shadowed.extend(capabilities());
    h.apply(shadowed).await;
    for i in 0..4 {
        assert_eq!(text(&h, "hi", &format!("s-{i}")).await, "v1");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let shadow = shadows_settled(&h, 4)
        .await
        .shadow
        .expect("a shadow summary");
    assert!(shadow.runs >= 1, "{shadow:?}");
    let seen = h.capabilities.seen.lock().unwrap().clone();
    let count = |name: &str| seen.iter().filter(|c| c.name == name).count() as u64;
    assert_eq!(count("gated"), 4, "only the live runs reached credit.check");
    assert_eq!(
        count("settled"),
        4,
        "only the live runs reached credit.consume"
    );
    assert_eq!(
        count("echo"),
        4 + shadow.runs,
        "echo has no steps: shadows call it"
    );
    assert_eq!(
        shadow.host_calls_refused,
        2 * shadow.runs,
        "two refused per shadow run"
    );
    assert_eq!(
        metric(&h, "sluice_gateway_shadow_host_calls_refused_total", &[]),
        2 * shadow.runs
    );
}
