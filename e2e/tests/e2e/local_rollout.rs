//! Rolling out hook code in local mode, end to end: the chain file changes while the gateway serves
//! (real gRPC, real runsc sandboxes), and what `/rollouts` and `/metrics` report.

use sluice_e2e::{Harness, chain_yaml, text};
use sluice_proto as proto;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

fn tagging(tag: &str) -> String {
    format!(
        "def execute(context, settings):\n    return {{'action': 'modify', 'outgoing': context['outgoing'] + ' {tag}'}}\n"
    )
}

const GUARD_PASS: &str = "def execute(context, settings):\n    return {'action': 'pass'}\n";
const GUARD_SECRET: &str = "def execute(context, settings):\n    if 'secret' in context['outgoing']:\n        return {'action': 'block', 'message': 'no secrets'}\n    return {'action': 'pass'}\n";

fn chain(rollout: &str, hooks: &[(&str, &str, &str)]) -> String {
    let extra = format!("pool: {{warm: 2, max: 4}}\n{rollout}");
    chain_yaml("bot-input", "bot", "input", &extra, hooks)
}

fn annotated(yaml: &str, key: &str, value: &str) -> String {
    yaml.replacen(
        "metadata:\n",
        &format!("metadata:\n  annotations:\n    {key}: \"{value}\"\n"),
        1,
    )
}

fn free_port() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    l.local_addr().expect("its address")
}

fn get(addr: SocketAddr, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).expect("the metrics listener answers");
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").expect("request sent");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("response read");
    out.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default()
}

fn rollout(addr: SocketAddr) -> serde_json::Value {
    let body: serde_json::Value =
        serde_json::from_str(&get(addr, "/rollouts")).expect("/rollouts is JSON");
    body["rollouts"]
        .as_array()
        .and_then(|a| {
            a.iter()
                .find(|r| r["chain"] == "default/bot-input")
                .cloned()
        })
        .expect("the chain has a rollout status")
}

async fn wait_for(
    addr: SocketAddr,
    what: &str,
    f: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let r = rollout(addr);
        if f(&r) {
            return r;
        }
        assert!(Instant::now() < until, "never {what}: {r:#}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn run(h: &Harness, input: &str, session: &str) -> String {
    let r = h
        .run_in_session("bot", "input", input, session)
        .await
        .expect("the run succeeds");
    if r.action == proto::Action::Block as i32 {
        format!("blocked: {}", r.message)
    } else {
        text(&r).to_string()
    }
}

fn metric(addr: SocketAddr, name: &str, label: &str) -> u64 {
    get(addr, "/metrics")
        .lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_then_canary_then_rollback_and_promotion_through_the_chain_file() {
    let metrics = free_port();
    let v1 = chain(
        "",
        &[
            ("guard", "block", GUARD_PASS),
            ("tag", "modify", &tagging("v1")),
        ],
    );
    let h = Harness::start_with(&[("bot.yaml", &v1)], |o| o.metrics = Some(metrics)).await;
    let live = wait_for(metrics, "served", |r| r["phase"] == "RolledOut").await;
    let v1_revision = live["live_revision"]
        .as_str()
        .expect("a live revision")
        .to_string();

    // Shadow: the new guard blocks secrets; no live answer changes, the disagreement is reported.
    let shadow = chain(
        "rollout: {strategy: Shadow}",
        &[
            ("guard", "block", GUARD_SECRET),
            ("tag", "modify", &tagging("v1")),
        ],
    );
    h.write_file("bot.yaml", &shadow);
    wait_for(metrics, "shadowing", |r| r["phase"] == "Shadowing").await;
    for i in 0..8 {
        let input = if i % 2 == 0 { "my secret" } else { "hello" };
        assert_eq!(
            run(&h, input, &format!("s-{i}")).await,
            format!("{input} v1")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let r = wait_for(metrics, "compared", |r| {
        let s = &r["shadow"];
        s["runs"].as_u64().unwrap_or(0) + s["dropped"].as_u64().unwrap_or(0) >= 8
    })
    .await;
    let s = &r["shadow"];
    assert!(s["action_differs"].as_u64().unwrap() >= 1, "{r:#}");
    assert!(s["agreed"].as_u64().unwrap() >= 1, "{r:#}");
    assert!(s["disagreement_percent"].as_f64().unwrap() > 0.0, "{r:#}");
    assert_eq!(
        metric(
            metrics,
            "sluice_gateway_shadow_runs_total",
            "verdict=\"action_differs\""
        ),
        s["action_differs"].as_u64().unwrap()
    );
    let audit = h.audit();
    assert!(
        audit
            .iter()
            .any(|e| e["mode"] == "shadow" && e["shadow_verdict"] == "action_differs")
    );

    // Canary at 50% of sessions, bounded: each session sees one version.
    let canary = chain(
        "rollout: {strategy: Canary, steps: [50], stepDuration: 1h}",
        &[
            ("guard", "block", GUARD_PASS),
            ("tag", "modify", &tagging("v2")),
        ],
    );
    h.write_file("bot.yaml", &canary);
    let r = wait_for(metrics, "a canary", |r| r["phase"] == "Progressing").await;
    let v2_revision = r["candidate_revision"].as_str().unwrap().to_string();
    let mut seen = std::collections::HashMap::new();
    for i in 0..20 {
        let session = format!("c-{i}");
        let first = run(&h, "hi", &session).await;
        assert_eq!(
            run(&h, "hi", &session).await,
            first,
            "{session} changed version"
        );
        seen.insert(session, first);
    }
    let on_canary = seen.values().filter(|a| *a == "hi v2").count();
    assert!(
        (2..=18).contains(&on_canary),
        "{on_canary} of 20 sessions on a 50% canary"
    );
    assert!(seen.values().all(|a| a == "hi v1" || a == "hi v2"));

    // Rolled back by annotation: everyone is on v1 again, with v1's code hash.
    h.write_file(
        "bot.yaml",
        &annotated(&canary, "sluice.dev/rollback", &v2_revision[..8]),
    );
    let r = wait_for(metrics, "rolled back", |r| r["phase"] == "RolledBack").await;
    assert_eq!(r["live_revision"], v1_revision.as_str());
    for i in 0..6 {
        assert_eq!(run(&h, "hi", &format!("c-{i}")).await, "hi v1");
    }
    let last = h.audit().pop().expect("an audit line");
    assert_eq!(last["code_hash"], format!("sha256:{v1_revision}"));

    // Promoted by removing spec.rollout: v2 for everyone.
    let promoted = chain(
        "",
        &[
            ("guard", "block", GUARD_PASS),
            ("tag", "modify", &tagging("v2")),
        ],
    );
    h.write_file("bot.yaml", &promoted);
    let r = wait_for(metrics, "promoted", |r| {
        r["phase"] == "RolledOut" && r["live_revision"] == v2_revision.as_str()
    })
    .await;
    assert!(r["revisions"].as_array().unwrap().len() >= 3, "{r:#}");
    for i in 0..6 {
        assert_eq!(run(&h, "hi", &format!("c-{i}")).await, "hi v2");
    }
    h.stop_and_check_leaks().await;
}
