//! Signed hook code in local mode (`--trusted-signers`): the chain directory serves a chain in a
//! namespace that requires signatures only when every hook verifies against the signers trusted
//! now. An unsigned chain is not served; a signed one is, with its signer; a signed file changed
//! afterwards keeps serving its last signed version; a signature replayed into another chain is
//! refused; and when the trusted signers change, what the removed key signed is no longer served
//! until it is signed again by a trusted key.

use sluice_crds::signing::{PolicyFile, Required};
use sluice_crds::{Action, HookSpec, TriggerPoint};
use sluice_gateway::LocalSource;
use ssh_key::PrivateKey;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

const PLATFORM: &str = sluice_crds::DEFAULT_PLATFORM_NAMESPACE;
const CODE: &str = "def execute(context, settings):\n    return {\"action\": \"modify\", \"outgoing\": settings[\"tag\"]}\n";

fn key() -> PrivateKey {
    PrivateKey::random(&mut ssh_key::rand_core::OsRng, ssh_key::Algorithm::Ed25519).unwrap()
}

/// The hook `tag` as the chain file below writes it.
fn hook(tag: &str, code: &str) -> HookSpec {
    let mut h = HookSpec::with_code("tag", Action::Modify, code);
    h.settings = Some(serde_json::json!({"tag": tag}));
    h
}

/// A chain file `name` (target = name) whose hook returns `tag`, signed by `key` for the chain
/// `signed_for` (its own name unless replayed).
fn chain(name: &str, ns: &str, tag: &str, code: &str, key: Option<(&PrivateKey, &str)>) -> String {
    let signature = key
        .map(|(k, signed_for)| {
            let sig = sluice_crds::signing::sign(
                k,
                ns,
                signed_for,
                TriggerPoint::Input,
                &hook(tag, code),
            )
            .unwrap();
            let body: String = sig.lines().map(|l| format!("        {l}\n")).collect();
            format!("      signature: |\n{body}")
        })
        .unwrap_or_default();
    let code: String = code.lines().map(|l| format!("        {l}\n")).collect();
    format!(
        "apiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  target: {name}\n  triggerPoint: input\n  hooks:\n    - name: tag\n{signature}      action: modify\n      settings: {{tag: {tag}}}\n      code: |\n{code}"
    )
}

fn trust(path: &Path, keys: &[(&str, &PrivateKey)]) {
    let text: String = keys
        .iter()
        .map(|(who, k)| format!("{who} {}\n", k.public_key().to_openssh().unwrap()))
        .collect();
    std::fs::write(path, text).unwrap();
}

/// Served chains as `target=tag (signer)`, and problems.
fn reload(source: &mut LocalSource) -> (Vec<String>, Vec<String>) {
    let registry = source.reload(Duration::from_secs(30)).unwrap();
    let mut chains: Vec<String> = registry
        .all_chains()
        .map(|c| {
            format!(
                "{}={} ({})",
                c.spec.target,
                c.settings[0]["tag"].as_str().unwrap_or("?"),
                c.signer(0)
                    .map_or("unsigned".to_string(), |s| s.principal.clone())
            )
        })
        .collect();
    chains.sort();
    let problems = registry.errors().iter().map(|p| p.to_string()).collect();
    (chains, problems)
}

fn has(problems: &[String], words: &[&str]) -> bool {
    problems.iter().any(|p| words.iter().all(|w| p.contains(w)))
}

#[test]
fn only_hooks_signed_by_a_trusted_key_for_their_own_chain_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let chains = dir.path().join("chains");
    std::fs::create_dir(&chains).unwrap();
    let signers = dir.path().join("allowed_signers");
    let (alice, bob, mallory) = (key(), key(), key());
    trust(&signers, &[("alice@example", &alice)]);
    let (policy, problems) = PolicyFile::load(&signers, Required::parse("team-a")).unwrap();
    assert!(problems.is_empty());
    let policy = Arc::new(policy);
    let mut source =
        LocalSource::new(&chains, PLATFORM, "/usr/bin/python3").with_signing(policy.clone());

    // Unsigned, and signed by a key nobody trusts: not served, each saying why and which key.
    std::fs::write(
        chains.join("a.yaml"),
        chain("a", "team-a", "v1", CODE, None),
    )
    .unwrap();
    std::fs::write(
        chains.join("m.yaml"),
        chain("m", "team-a", "v1", CODE, Some((&mallory, "m"))),
    )
    .unwrap();
    // Where signatures are not required, an unsigned chain serves.
    std::fs::write(
        chains.join("free.yaml"),
        chain("free", "team-b", "v1", CODE, None),
    )
    .unwrap();
    let (served, problems) = reload(&mut source);
    assert_eq!(served, vec!["free=v1 (unsigned)"], "{problems:?}");
    assert!(
        has(&problems, &["a.yaml", "hook \"tag\" is not signed"]),
        "{problems:?}"
    );
    let fingerprint = mallory
        .public_key()
        .fingerprint(ssh_key::HashAlg::Sha256)
        .to_string();
    assert!(
        has(
            &problems,
            &["m.yaml", &fingerprint, "trusted signers do not list"]
        ),
        "{problems:?}"
    );

    // Signed by alice: served, with its signer.
    std::fs::write(
        chains.join("a.yaml"),
        chain("a", "team-a", "v1", CODE, Some((&alice, "a"))),
    )
    .unwrap();
    std::fs::remove_file(chains.join("m.yaml")).unwrap();
    let (served, problems) = reload(&mut source);
    assert_eq!(
        served,
        vec!["a=v1 (alice@example)", "free=v1 (unsigned)"],
        "{problems:?}"
    );

    // Changed after signing (settings and code): the last signed version keeps serving.
    let tampered = chain("a", "team-a", "v1", CODE, Some((&alice, "a")))
        .replace("{tag: v1}", "{tag: v2}")
        .replace("settings[\"tag\"]", "settings[\"tag\"] + \"!\"");
    std::fs::write(chains.join("a.yaml"), tampered).unwrap();
    let (served, problems) = reload(&mut source);
    assert_eq!(
        served,
        vec!["a=v1 (alice@example)", "free=v1 (unsigned)"],
        "{problems:?}"
    );
    assert!(
        has(&problems, &["a.yaml", "does not match", "keeps serving"]),
        "{problems:?}"
    );

    // Alice's signature for chain `a` replayed into chain `b`: refused.
    std::fs::write(
        chains.join("a.yaml"),
        chain("a", "team-a", "v1", CODE, Some((&alice, "a"))),
    )
    .unwrap();
    std::fs::write(
        chains.join("b.yaml"),
        chain("b", "team-a", "v1", CODE, Some((&alice, "a"))),
    )
    .unwrap();
    let (served, problems) = reload(&mut source);
    assert_eq!(
        served,
        vec!["a=v1 (alice@example)", "free=v1 (unsigned)"],
        "{problems:?}"
    );
    assert!(
        has(
            &problems,
            &["b.yaml", "alice@example", "signed for another chain"]
        ),
        "{problems:?}"
    );

    // Rotation: bob replaces alice. Read again without a restart, what alice signed stops serving
    // until bob signs it.
    std::fs::remove_file(chains.join("b.yaml")).unwrap();
    trust(&signers, &[("bob@example", &bob)]);
    assert!(matches!(
        policy.reread(),
        sluice_crds::signing::Reread::Changed(_)
    ));
    let (served, problems) = reload(&mut source);
    assert_eq!(served, vec!["free=v1 (unsigned)"], "{problems:?}");
    assert!(
        has(&problems, &["a.yaml", "trusted signers do not list"]),
        "{problems:?}"
    );
    std::fs::write(
        chains.join("a.yaml"),
        chain("a", "team-a", "v3", CODE, Some((&bob, "a"))),
    )
    .unwrap();
    let (served, problems) = reload(&mut source);
    assert_eq!(
        served,
        vec!["a=v3 (bob@example)", "free=v1 (unsigned)"],
        "{problems:?}"
    );

    // A broken signers file keeps the signers it had.
    std::fs::write(&signers, "bob@example ssh-ed25519 not-a-key\n").unwrap();
    assert!(matches!(
        policy.reread(),
        sluice_crds::signing::Reread::Kept(_)
    ));
    let (served, _) = reload(&mut source);
    assert_eq!(served, vec!["a=v3 (bob@example)", "free=v1 (unsigned)"]);
}
