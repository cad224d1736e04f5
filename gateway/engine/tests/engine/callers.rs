//! The caller the transport authenticated, in the engine: it is admitted only to its namespaces, it
//! is named in the audit and in every capability's `caller`, and a `caller` key in the request's
//! context never passes for it.

use crate::common;

use common::{Harness, NS, TARGET, tenant};
use serde_json::json;
use sluice_engine::{CallerAuth, EngineError, Identity, RunInput, StreamInput, StreamOpen};

async fn harness() -> Harness {
    Harness::process(vec![tenant(
        "input",
        vec![json!({"name": "ask", "action": "modify", "capabilities": ["echo"], "code":
            "def execute(context, settings):\n    context.host_call('echo', {})\n    return {'action': 'modify', 'outgoing': 'asked by ' + str(context['caller'].get('caller'))}\n"})],
        json!({}),
    )])
    .await
}

fn verified(name: &str, namespaces: &[&str]) -> CallerAuth {
    CallerAuth::Verified(Identity {
        name: name.into(),
        namespaces: namespaces.iter().map(|n| n.to_string()).collect(),
    })
}

fn input(auth: CallerAuth) -> RunInput {
    RunInput {
        namespace: NS.into(),
        target: TARGET.into(),
        trigger_point: "input".into(),
        payload: Some(json!("hi")),
        // An application trying to name itself through the context.
        context: [("caller".to_string(), "forged".to_string())].into(),
        session_id: "s-1".into(),
        auth,
        via: None,
    }
}

#[tokio::test]
async fn a_verified_caller_is_named_in_the_audit_and_in_the_capabilitys_caller() {
    let h = harness().await;
    let r = h
        .engine
        .run(input(verified("support-app", &[NS])))
        .await
        .expect("the caller may use its namespace");
    assert_eq!(
        r.walk.payload,
        json!("asked by support-app"),
        "the hook sees the verified caller too"
    );
    let seen = h.capabilities.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].caller.0["caller"], "support-app");
    let events = h.audit.events();
    assert_eq!(events.last().unwrap()["caller"], "support-app");
}

#[tokio::test]
async fn without_a_caller_policy_a_context_key_never_passes_for_the_caller() {
    let h = harness().await;
    let r = h.engine.run(input(CallerAuth::Unchecked)).await.unwrap();
    assert_eq!(r.walk.payload, json!("asked by None"));
    let seen = h.capabilities.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    assert!(
        !seen[0].caller.0.contains_key("caller"),
        "{:?}",
        seen[0].caller
    );
    assert!(h.audit.events().last().unwrap().get("caller").is_none());
}

#[tokio::test]
async fn a_namespace_the_caller_may_not_use_is_permission_denied_and_audited() {
    let h = harness().await;
    let err = h
        .engine
        .run(input(verified("other-app", &["billing"])))
        .await
        .expect_err("refused");
    assert!(
        matches!(&err, EngineError::PermissionDenied(m) if m.contains("other-app") && m.contains(NS)),
        "{err:?}"
    );
    assert!(h.capabilities.seen.lock().unwrap().is_empty());
    let event = h.audit.events().pop().unwrap();
    assert_eq!(event["caller"], "other-app");
    assert_eq!(event["namespace"], NS);
    assert!(event["error"].as_str().unwrap().contains("may not use"));
    let rejected = &h.engine.metrics().rejected;
    assert_eq!(rejected.with_label_values(&["permission_denied"]).get(), 1);
    // "*" opens every namespace.
    h.engine
        .run(input(verified("platform", &["*"])))
        .await
        .expect("* allows every namespace");
}

#[tokio::test]
async fn an_unauthenticated_request_is_refused_and_audited() {
    let h = harness().await;
    let err = h
        .engine
        .run(input(CallerAuth::Unauthenticated("no identity".into())))
        .await
        .expect_err("refused");
    assert!(matches!(err, EngineError::Unauthenticated(_)), "{err:?}");
    assert!(h.capabilities.seen.lock().unwrap().is_empty());
    assert_eq!(h.audit.events().pop().unwrap()["error"], "no identity");
    let rejected = &h.engine.metrics().rejected;
    assert_eq!(rejected.with_label_values(&["unauthenticated"]).get(), 1);
}

#[tokio::test]
async fn a_stream_is_held_to_its_callers_namespaces() {
    let h = harness().await;
    let open = |auth| {
        StreamInput::Open(StreamOpen {
            namespace: NS.into(),
            target: TARGET.into(),
            trigger_point: "output".into(),
            auth,
            ..Default::default()
        })
    };
    let s = h
        .stream_inputs(vec![
            open(verified("other-app", &["billing"])),
            StreamInput::Finish,
        ])
        .await;
    let error = s.error.expect("refused at open").to_string();
    assert!(error.contains("may not use"), "{error}");
    let event = h.audit.events().pop().unwrap();
    assert_eq!(
        (event["mode"].as_str(), event["caller"].as_str()),
        (Some("stream"), Some("other-app"))
    );
}
