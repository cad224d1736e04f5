//! Signed hook code at the registry, the check every gateway makes before it serves a version
//! (docs/signing.md): where the policy requires signatures, a chain is served only when each hook
//! verifies against the signers trusted now, and the audit names who signed the code that answered.

use crate::common;

use common::scripted::{Chunk, ScriptedBackend, honest};
use common::{Harness, PLATFORM, hook, tenant};
use serde_json::json;
use sluice_crds::definition::{Definition, Spec};
use sluice_crds::signing::{Policy, Required, TrustedSigners};
use sluice_engine::{EngineError, Registry};
use std::sync::Arc;

fn key() -> ssh_key::PrivateKey {
    ssh_key::PrivateKey::random(&mut ssh_key::rand_core::OsRng, ssh_key::Algorithm::Ed25519)
        .unwrap()
}

/// `d` with every hook signed by `key` for the chain `d` names.
fn signed(mut d: Definition, key: &ssh_key::PrivateKey) -> Definition {
    if let Spec::HookChain(spec) = &mut d.spec {
        let tp = spec.trigger_point;
        for hook in &mut spec.hooks {
            hook.signature =
                Some(sluice_crds::signing::sign(key, &d.namespace, &d.name, tp, hook).unwrap());
        }
    }
    d
}

fn policy(who: &str, key: &ssh_key::PrivateKey) -> Policy {
    let (signers, problems) =
        TrustedSigners::parse(&format!("{who} {}", key.public_key().to_openssh().unwrap()));
    assert!(problems.is_empty());
    Policy {
        signers,
        required: Required::parse(common::NS),
    }
}

#[tokio::test]
async fn only_signed_chains_serve_and_the_audit_names_their_signer() {
    let h = Harness::with_backend(
        Arc::new(ScriptedBackend::new(Arc::new(|c: &Chunk| {
            honest(c, |t| t.to_uppercase())
        }))),
        vec![],
        common::limits(),
    )
    .await;
    let (alice, mallory) = (key(), key());
    let chain = tenant("input", vec![hook("upper", "modify", "x")], json!({}));
    let policy = policy("alice@example", &alice);

    // Unsigned, and signed by a key not trusted: neither is served; the registry says why.
    for (d, why) in [
        (chain.clone(), "hook \"upper\" is not signed".to_string()),
        (
            signed(chain.clone(), &mallory),
            mallory
                .public_key()
                .fingerprint(ssh_key::HashAlg::Sha256)
                .to_string(),
        ),
    ] {
        let registry = Registry::build_for(PLATFORM, vec![d], vec![], &policy);
        assert!(
            registry
                .errors()
                .iter()
                .any(|e| e.message.contains(&why) && e.message.contains("not served")),
            "{:?}",
            registry.errors()
        );
        h.engine.set_registry(registry).await;
        let refused = h.run("input", json!("hi")).await.expect_err("not served");
        assert!(matches!(refused, EngineError::NotFound(_)), "{refused}");
    }

    // Signed by alice: served, and every audit event of it names her.
    let registry = Registry::build_for(
        PLATFORM,
        vec![signed(chain.clone(), &alice)],
        vec![],
        &policy,
    );
    assert!(registry.errors().is_empty(), "{:?}", registry.errors());
    h.engine.set_registry(registry).await;
    let r = h.run("input", json!("hi")).await.expect("served");
    assert_eq!(r.walk.payload, json!("HI"));
    let events = h.audit.events();
    let last = events.last().expect("an audit event");
    let by = last["hooks"][0]["signed_by"].as_str().unwrap_or_default();
    assert!(by.starts_with("alice@example (SHA256:"), "{last}");

    // Where the policy requires nothing, nothing is verified and no signer is named.
    let registry = Registry::build_for(PLATFORM, vec![chain], vec![], &Policy::default());
    h.engine.set_registry(registry).await;
    h.run("input", json!("hi")).await.expect("served");
    let events = h.audit.events();
    assert!(
        events.last().unwrap()["hooks"][0]
            .get("signed_by")
            .is_none()
    );
}
