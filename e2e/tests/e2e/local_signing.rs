//! Signed hook code in local mode end to end (`--trusted-signers`; docs/signing.md): a real gateway
//! and runsc sandboxes serve a signed chain and audit its signer; an unsigned rollout candidate never
//! starts while the signed live version serves on; signed, it does; and when the trusted signers
//! file changes, what the removed key signed stops being served without a restart.

use sluice_cli::sign::{Key, sign_text};
use sluice_crds::signing::{PolicyFile, Required};
use sluice_e2e::{Harness, chain_yaml, text};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn tagging(tag: &str) -> String {
    format!(
        "def execute(context, settings):\n    return {{'action': 'modify', 'outgoing': context['outgoing'] + ' {tag}'}}\n"
    )
}

fn chain(rollout: &str, tag: &str) -> String {
    chain_yaml(
        "bot-input",
        "bot",
        "input",
        &format!("pool: {{warm: 1, max: 4}}\n{rollout}"),
        &[("tag", "modify", &tagging(tag))],
    )
}

fn key() -> ssh_key::PrivateKey {
    ssh_key::PrivateKey::random(&mut ssh_key::rand_core::OsRng, ssh_key::Algorithm::Ed25519)
        .unwrap()
}

fn signed(yaml: &str, key: &ssh_key::PrivateKey) -> String {
    let key = Key::Plain(Box::new(key.clone()));
    sign_text(Path::new("bot.yaml"), yaml, &key, None)
        .expect("signs")
        .0
}

fn trust(path: &Path, who: &str, key: &ssh_key::PrivateKey) {
    let line = format!("{who} {}\n", key.public_key().to_openssh().unwrap());
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, line).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn free_port() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    l.local_addr().expect("its address")
}

fn rollout(addr: SocketAddr) -> serde_json::Value {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("the metrics listener answers");
    write!(s, "GET /rollouts HTTP/1.0\r\nHost: x\r\n\r\n").expect("request sent");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("response read");
    let body: serde_json::Value =
        serde_json::from_str(out.split_once("\r\n\r\n").unwrap().1).expect("/rollouts is JSON");
    body["rollouts"]
        .as_array()
        .and_then(|a| {
            a.iter()
                .find(|r| r["chain"] == "default/bot-input")
                .cloned()
        })
        .unwrap_or_default()
}

async fn until<T>(what: &str, mut f: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "never {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signed_versions_serve_an_unsigned_candidate_never_starts_and_a_removed_key_withdraws() {
    let (alice, bob) = (key(), key());
    let trust_dir = tempfile::tempdir().unwrap();
    let signers = trust_dir.path().join("allowed_signers");
    trust(&signers, "alice@example", &alice);
    let (policy, _) = PolicyFile::load(&signers, Required::Everywhere).unwrap();
    let metrics = free_port();
    let v1 = signed(&chain("", "v1"), &alice);
    let h = Harness::start_with(&[("bot.yaml", &v1)], |o| {
        o.metrics = Some(metrics);
        o.signing = Some(Arc::new(policy));
    })
    .await;
    let r = h
        .run_in_session("bot", "input", "hi", "s")
        .await
        .expect("served");
    assert_eq!(text(&r), "hi v1");
    let audit = h.audit();
    let hook = &audit.last().expect("an audit event")["hooks"][0];
    assert!(
        hook["signed_by"]
            .as_str()
            .unwrap_or_default()
            .starts_with("alice@example (SHA256:"),
        "{hook}"
    );

    // An unsigned canary: no candidate, the signed live version answers every session.
    let canary = chain(
        "rollout: {strategy: Canary, steps: [50], stepDuration: 1h}",
        "v2",
    );
    h.write_file("bot.yaml", &canary);
    tokio::time::sleep(Duration::from_secs(2)).await;
    for i in 0..10 {
        let r = h
            .run_in_session("bot", "input", "hi", &format!("c-{i}"))
            .await
            .expect("served");
        assert_eq!(
            text(&r),
            "hi v1",
            "session c-{i}: the unsigned candidate ran"
        );
    }
    let r = rollout(metrics);
    assert!(r["candidate_revision"].is_null(), "{r:#}");
    // Signed, the same canary starts.
    h.write_file("bot.yaml", &signed(&canary, &alice));
    until("a signed canary", async || {
        (rollout(metrics)["phase"] == "Progressing").then_some(())
    })
    .await;

    // Bob replaces alice: what alice signed is withdrawn, without a restart.
    trust(&signers, "bob@example", &bob);
    until("alice's chain withdrawn", async || {
        match h.run_in_session("bot", "input", "hi", "w").await {
            Err(s) if s.code() == tonic::Code::NotFound => Some(()),
            _ => None,
        }
    })
    .await;
    h.write_file("bot.yaml", &signed(&chain("", "v3"), &bob));
    let r = until("bob's chain served", async || {
        h.run_in_session("bot", "input", "hi", "b")
            .await
            .ok()
            .filter(|r| text(r) == "hi v3")
    })
    .await;
    assert_eq!(text(&r), "hi v3");
}
