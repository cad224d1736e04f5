//! Cells in real gVisor sandboxes: one sandbox serves trigger point after trigger point, and each
//! trigger point finds nothing of the one before it, in both pool modes; bursts are served without
//! an error.

use serde_json::Value;
use sluice_e2e::{Harness, chain_yaml, text};

/// Redacts `RAW-SECRET-<n>`; keeps a secret in its globals and gets one in its settings.
const REDACT: &str = r#"import re
GLOBAL = "GLOBAL-" + "SECRET"
P = re.compile(r"RAW-SECRET-[0-9]+")
def execute(context, settings):
    return {"action": "modify", "outgoing": P.sub("[gone]", context["outgoing"])}
"#;

/// On "leave", leaves everything a hook can try to leave behind (state in the interpreter, its
/// modules and builtins; files, threads, processes, timers, sockets, environment where it can); on
/// "daemon", tries to start something that outlives it; on "look", reports what it can see of any of
/// it, of other hooks, of the raw payload and of the sandbox, appended to the payload as JSON.
const SNEAKY: &str = r#"import builtins, gc, json, os, random, sys
def attempt(f):
    try:
        f()
        return "done"
    except BaseException as e:
        return type(e).__name__
def leave():
    builtins.LEFT = "x"
    json.LEFT = "x"
    sys.modules["left_behind"] = sys
    sys.setrecursionlimit(123)
    tried = {
        "tmp": attempt(lambda: open("/tmp/left", "w").write("x")),
        "env": attempt(lambda: os.environ.__setitem__("LEFT", "1")),
        "cwd": attempt(lambda: os.chdir("/")),
        "thread": attempt(lambda: __import__("threading").Thread(target=lambda: None).start()),
        "timer": attempt(lambda: __import__("signal").setitimer(0, 0.05, 0.05)),
        "socket": attempt(lambda: __import__("socket").socket()),
    }
    return tried
def daemon():
    return {"fork": attempt(lambda: os.fork())}
def listing(path):
    try:
        return sorted(os.listdir(path))
    except OSError as e:
        return type(e).__name__
def look(payload):
    # Built here, so that the hook's own constants are not what it finds.
    secrets = ["RAW-", "SETTINGS-", "GLOBAL-"]
    secrets = [s + "SECRET" for s in secrets]
    found = []
    for o in gc.get_objects():
        items = list(o.keys()) + list(o.values()) if isinstance(o, dict) else o if isinstance(o, (list, tuple)) else ()
        for v in items:
            if isinstance(v, (str, bytes)) and v not in secrets and v != payload:
                text = v if isinstance(v, str) else v.decode("utf-8", "replace")
                found += [s for s in secrets if s in text]
    return {
        "procs": listing("/proc"),
        "tmp": listing("/tmp"),
        "left": [n for n in dir(builtins) + dir(json) if n.startswith("LEFT")] + [m for m in sys.modules if m.startswith("left")],
        "recursion": sys.getrecursionlimit(),
        "env": "LEFT" in os.environ,
        "found": sorted(set(found)),
    }
def execute(context, settings):
    out = context["outgoing"]
    seen = {"random": [random.random() for _ in range(3)]}
    if out.startswith("leave"):
        seen["tried"] = leave()
    elif out.startswith("daemon"):
        seen["tried"] = daemon()
    else:
        seen.update(look(out))
    return {"action": "modify", "outgoing": out + " SEEN:" + json.dumps(seen)}
"#;

fn chain(reuse: &str) -> String {
    let spec = format!(
        "failurePolicy: Closed\ntimeoutMs: 5000\npool: {{warm: 1, max: 1, reuse: {reuse}}}\nresources: {{cpu: '1', memory: 256Mi, pids: 64}}"
    );
    chain_yaml(
        "cells",
        "cells",
        "input",
        &spec,
        &[("redact", "modify", REDACT), ("sneaky", "modify", SNEAKY)],
    )
    .replace(
        "      action: modify\n      code: |\n        import re",
        "      action: modify\n      settings: {token: SETTINGS-SECRET}\n      code: |\n        import re",
    )
}

fn seen(out: &str) -> Value {
    let json = out.split(" SEEN:").nth(1).expect("the hook reported");
    serde_json::from_str(json).expect("JSON")
}

async fn look(h: &Harness, n: u32) -> Value {
    let looked = text(
        &h.run_text("cells", "input", &format!("look RAW-SECRET-{n}"))
            .await
            .unwrap(),
    )
    .to_string();
    assert!(looked.starts_with("look [gone] SEEN:"), "{looked}");
    seen(&looked)
}

fn assert_sees_nothing(after: &Value, before: &Value) {
    // No filesystem in a cell but its own in-memory /tmp: nothing to find, nothing left.
    assert_eq!(after["procs"], "FileNotFoundError", "{after}");
    assert_eq!(after["tmp"], serde_json::json!([]), "{after}");
    assert_eq!(after["left"], serde_json::json!([]), "{after}");
    assert_ne!(
        after["recursion"], 123,
        "the interpreter's settings survived: {after}"
    );
    assert_eq!(after["env"], false, "the environment survived: {after}");
    assert_eq!(after["found"], serde_json::json!([]), "{after}");
    assert_ne!(
        before["random"], after["random"],
        "two trigger points share a random sequence"
    );
}

/// What a hook tried to leave behind failed, every one of it but its own interpreter state.
fn assert_could_not_leave(left: &Value) {
    for (what, outcome) in left["tried"].as_object().expect("tried").iter() {
        if what == "env" || what == "cwd" || what == "tmp" {
            continue; // they change only the instance, which is gone with the call
        }
        assert_ne!(outcome, "done", "{what} succeeded: {left}");
    }
}

async fn next_trigger_point_sees_nothing(reuse: &str) {
    let yaml = chain(reuse);
    let h = Harness::start(&[("cells.yaml", &yaml)]).await;
    let boots_before = h.boots();
    let left = text(
        &h.run_text("cells", "input", "leave RAW-SECRET-1")
            .await
            .unwrap(),
    )
    .to_string();
    assert!(left.starts_with("leave [gone] SEEN:"), "{left}");
    assert_could_not_leave(&seen(&left));
    assert_sees_nothing(&look(&h, 2).await, &seen(&left));
    let boots = h.boots() - boots_before;
    match reuse {
        // A pool of one: both trigger points ran in the same sandbox.
        "Recycle" => assert_eq!(
            boots,
            0,
            "the sandbox was not reused: {:?}",
            h.retirements()
        ),
        _ => assert!(boots >= 1, "reuse None booted no fresh sandbox"),
    }
    // Nothing can outlive its hook: there is no process to start.
    let daemon = text(&h.run_text("cells", "input", "daemon").await.unwrap()).to_string();
    assert_could_not_leave(&seen(&daemon));
    assert_sees_nothing(&look(&h, 3).await, &seen(&daemon));
    h.stop_and_check_leaks().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recycled_sandbox_next_trigger_point_sees_nothing_of_the_last() {
    next_trigger_point_sees_nothing("Recycle").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fresh_sandbox_next_trigger_point_sees_nothing_of_the_last() {
    next_trigger_point_sees_nothing("None").await;
}

const UPPER: &str = "def execute(context, settings):\n    return {'action': 'modify', 'outgoing': context['outgoing'].upper()}\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bursts_of_runs_and_streams_are_all_served() {
    let yaml = chain_yaml(
        "burst",
        "burst",
        "output",
        "pool: {warm: 2, max: 8, reuse: Recycle}\nstreaming: {flushChars: 8, lookbackChars: 4}",
        &[("upper", "modify", UPPER)],
    );
    let h = std::sync::Arc::new(Harness::start(&[("burst.yaml", &yaml)]).await);
    let runs = (0..32).map(|i| {
        let h = h.clone();
        async move {
            let r = h.run_text("burst", "output", &format!("run {i}")).await;
            (i, r.map(|r| text(&r).to_string()))
        }
    });
    for (i, r) in futures::future::join_all(runs).await {
        assert_eq!(r.expect("no run fails"), format!("RUN {i}"));
    }
    let streams = (0..32).map(|i| {
        let h = h.clone();
        async move {
            let chunks = vec![format!("stream {i} "), "goes on and on".to_string()];
            (i, h.stream("burst", "output", &chunks).await)
        }
    });
    for (i, s) in futures::future::join_all(streams).await {
        assert!(s.status.is_none(), "stream {i}: {:?}", s.status);
        let want = format!("STREAM {i} GOES ON AND ON");
        assert_eq!(s.committed(), want);
        assert_eq!(text(s.final_.as_ref().expect("a final")), want);
    }
    let h = std::sync::Arc::into_inner(h).expect("one owner");
    h.stop_and_check_leaks().await;
}

/// Reports what every clock reads, in findings.
const CLOCK: &str = "import time\ndef execute(context, settings):\n    return {'action': 'detect', 'findings': {'t': [time.time_ns(), time.monotonic_ns()]}}\n";

/// Inside gVisor as well, hooks of one run read one moment, whichever sandbox serves them: the
/// baseline's hook and the tenant's, each in a sandbox of its own (the baseline's claimed for its
/// walk only), read the run's start, to the whole second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_baseline_and_the_tenant_of_a_run_read_its_moment() {
    let baseline = chain_yaml(
        "clock-baseline",
        "\"*\"",
        "input",
        "enforced: true",
        &[("base", "detect", CLOCK)],
    )
    .replace("namespace: default", "namespace: sluice-system");
    let tenant = chain_yaml("clock", "clock", "input", "", &[("own", "detect", CLOCK)]);
    let h = Harness::start(&[("baseline.yaml", &baseline), ("tenant.yaml", &tenant)]).await;
    for _ in 0..2 {
        let began = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap();
        h.run_text("clock", "input", "hi").await.unwrap();
        let event = h.audit().pop().expect("the run's audit event");
        let hooks = event["hooks"].as_array().expect("hooks");
        let names: Vec<&str> = hooks.iter().filter_map(|h| h["name"].as_str()).collect();
        assert_eq!(names, ["baseline/base", "own"], "{event}");
        let (base, own) = (&hooks[0]["findings"]["t"], &hooks[1]["findings"]["t"]);
        assert_eq!(base, own, "{event}");
        let ns = base[0].as_u64().expect("a reading");
        assert_eq!(base[1].as_u64(), Some(ns), "{event}");
        assert_eq!(ns % 1_000_000_000, 0, "whole seconds: {event}");
        let second = began.as_secs() * 1_000_000_000;
        assert!(
            ns == second || ns == second + 1_000_000_000,
            "the run's start: {ns} read, the run began at {began:?}"
        );
    }
    h.stop_and_check_leaks().await;
}
