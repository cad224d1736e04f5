//! Sandbox pods in a dedicated namespace, against a mock API server: a chain first gets the
//! operator's finalizer; its pods and NetworkPolicy are made in the sandbox namespace, labelled with
//! the chain's namespace and without owner references (they cannot cross namespaces); pods of a
//! same-named chain of another namespace are not its pool; and when the chain is deleted, the
//! finalizer deletes exactly its pods and policy there before letting the chain go.

use crate::common;

use common::{ApiServer, mock_client, spawn, status_error};
use k8s_openapi::api::core::v1::Pod;
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, store::Writer};
use kube::runtime::watcher::Event;
use serde_json::{Value, json};
use sluice_crds::{Capability, HookChain};
use sluice_operator::expectations::Expectations;
use sluice_operator::metrics::Metrics;
use sluice_operator::reconcile::build::{self, Settings};
use sluice_operator::reconcile::{Context, reconcile};
use std::sync::Arc;
use std::time::Duration;

const SANDBOXES: &str = "sluice-sandboxes";
const CHAIN: &str = "/apis/sluice.dev/v1alpha1/namespaces/team-a/hookchains/redactor";
const PODS: &str = "/api/v1/namespaces/sluice-sandboxes/pods";
const POLICY: &str = "/apis/networking.k8s.io/v1/namespaces/sluice-sandboxes/networkpolicies/sluice-team-a.redactor-deny-all";
const SELECTOR: &str = "app.kubernetes.io/managed-by=sluice-operator,sluice.dev/chain=redactor,sluice.dev/chain-namespace=team-a";

fn settings() -> Settings {
    Settings {
        sandbox_namespace: Some(SANDBOXES.into()),
        ..Settings::default()
    }
}

fn ready_store<K: kube::Resource + Clone>() -> (reflector::Store<K>, Writer<K>)
where
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    let (store, mut writer) = reflector::store::<K>();
    writer.apply_watcher_event(&Event::Init);
    writer.apply_watcher_event(&Event::InitDone);
    (store, writer)
}

fn context() -> (Arc<Context>, ApiServer, Writer<Pod>) {
    let (client, api) = mock_client();
    let (pods, pod_writer) = ready_store();
    let (caps, _) = ready_store::<DeserializeGuard<Capability>>();
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "sluice-operator".into(),
            instance: Some("sluice-operator-0".into()),
        },
    );
    let ctx = Context::new(
        client,
        settings(),
        Duration::from_secs(300),
        pods,
        caps,
        Expectations::default(),
        recorder,
        Metrics::new(),
    );
    (Arc::new(ctx), api, pod_writer)
}

fn chain(finalizers: &[&str], deleting: bool) -> HookChain {
    let mut c = HookChain::new(
        "redactor",
        serde_json::from_value(json!({
            "target": "support-bot", "triggerPoint": "input",
            "pool": {"warm": 2, "max": 4},
            "hooks": [{"name": "h", "action": "modify",
                       "code": "def execute(context, settings):\n    return {'action': 'pass'}\n"}]
        }))
        .unwrap(),
    );
    c.metadata.namespace = Some("team-a".into());
    c.metadata.uid = Some("uid-a".into());
    c.metadata.generation = Some(1);
    c.metadata.resource_version = Some("5".into());
    c.metadata.finalizers = Some(finalizers.iter().map(|f| f.to_string()).collect());
    if deleting {
        c.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::now(),
        ));
    }
    c
}

/// A Ready warm pod of chain `namespace/redactor` in the sandbox namespace.
fn sandbox_pod(name: &str, chain_namespace: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": name, "namespace": SANDBOXES, "resourceVersion": format!("rv-{name}"),
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": {"sluice.dev/chain": "redactor", "sluice.dev/chain-namespace": chain_namespace,
                       "sluice.dev/template": build::template_hash(&chain(&[], false), &settings()),
                       "sluice.dev/pool": "warm", "app.kubernetes.io/managed-by": "sluice-operator"}
        },
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    })
}

fn run(
    ctx: &Arc<Context>,
    c: HookChain,
) -> tokio::task::JoinHandle<Result<Action, sluice_operator::reconcile::Error>> {
    spawn(reconcile(Arc::new(DeserializeGuard(Ok(c))), ctx.clone()))
}

#[tokio::test]
async fn a_new_chain_gets_the_finalizer_before_anything_else() {
    let (ctx, mut api, _) = context();
    let task = run(&ctx, chain(&[], false));
    let call = api.next().await;
    call.is("PATCH", CHAIN);
    assert_eq!(call.content_type, "application/json-patch+json");
    let ops = call.body.as_array().expect("a JSON patch").clone();
    assert!(
        ops.iter().any(|op| op["op"] == "add"
            && (op["value"] == json!(["sluice.dev/sandboxes"])
                || op["value"] == "sluice.dev/sandboxes")),
        "{ops:?}"
    );
    let mut stored = serde_json::to_value(chain(&[build::FINALIZER], false)).unwrap();
    stored["metadata"]["resourceVersion"] = "6".into();
    call.reply(200, stored);
    // The patch is a change the watch brings back: nothing else happens in this pass.
    assert_eq!(api.finish(task).await.unwrap(), Action::await_change());
}

#[tokio::test]
async fn pods_and_policy_go_to_the_sandbox_namespace_and_another_namespaces_chain_is_not_the_pool()
{
    let (ctx, mut api, mut pods) = context();
    // A chain of the same name in team-b already has two Ready warm pods: they are not team-a's.
    for name in ["team-b-redactor-1", "team-b-redactor-2"] {
        pods.apply_watcher_event(&Event::Apply(
            serde_json::from_value(sandbox_pod(name, "team-b")).unwrap(),
        ));
    }
    let task = run(&ctx, chain(&[build::FINALIZER], false));

    let call = api.next().await;
    call.is("PATCH", POLICY);
    assert_eq!(call.body["metadata"]["namespace"], SANDBOXES);
    assert!(
        call.body["metadata"].get("ownerReferences").is_none(),
        "{call:?}"
    );
    assert_eq!(
        call.body["spec"]["podSelector"]["matchLabels"],
        json!({"sluice.dev/chain": "redactor", "sluice.dev/chain-namespace": "team-a"})
    );
    call.echo();

    let mut created = 0;
    loop {
        let call = api.next().await;
        match (call.method.as_str(), call.path.as_str()) {
            ("POST", PODS) => {
                let meta = &call.body["metadata"];
                assert_eq!(meta["namespace"], SANDBOXES);
                assert_eq!(meta["generateName"], "team-a-redactor-");
                assert!(meta.get("ownerReferences").is_none(), "{call:?}");
                assert_eq!(meta["labels"]["sluice.dev/chain-namespace"], "team-a");
                assert_eq!(meta["labels"]["sluice.dev/chain"], "redactor");
                assert_eq!(meta["labels"]["sluice.dev/chain-uid"], "uid-a");
                created += 1;
                let mut stored = call.body.clone();
                stored["metadata"]["name"] = format!("team-a-redactor-{created}").into();
                call.reply(201, stored);
            }
            // Events and status stay with the chain, in its own namespace.
            ("POST", "/apis/events.k8s.io/v1/namespaces/team-a/events") => call.echo(),
            ("PATCH", p) if p == format!("{CHAIN}/status") => {
                let mut stored = serde_json::to_value(chain(&[build::FINALIZER], false)).unwrap();
                stored["status"] = call.body["status"].clone();
                call.reply(200, stored);
                break;
            }
            _ => panic!("unexpected request {call:?}"),
        }
    }
    assert_eq!(created, 2, "team-b's warm pods do not fill team-a's pool");
    api.finish(task).await.unwrap();
}

#[tokio::test]
async fn deleting_a_chain_deletes_its_pods_in_the_sandbox_namespace_then_lets_it_go() {
    let (ctx, mut api, _) = context();
    let task = run(&ctx, chain(&[build::FINALIZER, "example.com/other"], true));

    // Listed from the API, not the cache, by the chain's labels: only team-a's pods.
    let call = api.next().await;
    call.is("GET", PODS);
    assert_eq!(call.query("labelSelector"), Some(SELECTOR));
    call.reply(
        200,
        json!({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "50"},
               "items": [sandbox_pod("team-a-redactor-1", "team-a"), sandbox_pod("team-a-redactor-2", "team-a")]}),
    );
    let mut deleted = Vec::new();
    for _ in 0..2 {
        let call = api.next().await;
        assert_eq!(call.method, "DELETE", "{call:?}");
        let name: String = call
            .path
            .strip_prefix(&format!("{PODS}/"))
            .expect("a pod of the sandbox namespace")
            .to_string();
        deleted.push(name.clone());
        // One is gone already: a retried cleanup must not fail on it.
        if name.ends_with('2') {
            call.reply(404, status_error(404, "NotFound"));
        } else {
            call.reply(200, sandbox_pod(&name, "team-a"));
        }
    }
    deleted.sort();
    assert_eq!(deleted, ["team-a-redactor-1", "team-a-redactor-2"]);

    let call = api.next().await;
    call.is("DELETE", POLICY);
    call.reply(
        200,
        json!({"kind": "Status", "apiVersion": "v1", "status": "Success"}),
    );

    // Only now the finalizer goes (the other one stays).
    let call = api.next().await;
    call.is("PATCH", CHAIN);
    assert_eq!(call.content_type, "application/json-patch+json");
    let ops = call.body.as_array().expect("a JSON patch").clone();
    assert!(
        ops.iter()
            .any(|op| op["op"] == "remove" && op["path"] == "/metadata/finalizers/0"),
        "{ops:?}"
    );
    let stored = serde_json::to_value(chain(&["example.com/other"], true)).unwrap();
    call.reply(200, stored);
    assert_eq!(api.finish(task).await.unwrap(), Action::await_change());
}

#[tokio::test]
async fn a_failed_cleanup_keeps_the_finalizer() {
    let (ctx, mut api, _) = context();
    let task = run(&ctx, chain(&[build::FINALIZER], true));
    let call = api.next().await;
    call.is("GET", PODS);
    call.reply(403, status_error(403, "Forbidden"));
    let err = api.finish(task).await.unwrap_err().to_string();
    assert!(
        err.contains("team-a/redactor") && err.contains("pods"),
        "the error names the chain and what failed: {err}"
    );
}
