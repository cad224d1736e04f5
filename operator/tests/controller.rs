//! The whole controller (watches, caches, triggers, applier) against a mock API server: a malformed
//! HookChain in the list does not stop the watch or the valid chain beside it, nothing is created
//! before the pod cache has listed, and a stop lets the controller return.

mod common;

use common::{Call, mock_client, spawn};
use serde_json::{Value, json};
use sluice_operator::build::Settings;
use sluice_operator::controller::{self, RunConfig};
use sluice_operator::metrics::Metrics;
use std::time::Duration;

fn list(kind: &str, items: Vec<Value>) -> Value {
    json!({"apiVersion": "v1", "kind": kind, "metadata": {"resourceVersion": "100"}, "items": items})
}

fn good_chain() -> Value {
    json!({
        "apiVersion": "sluice.dev/v1alpha1", "kind": "HookChain",
        "metadata": {"name": "good", "namespace": "team-a", "uid": "uid-good", "generation": 1, "resourceVersion": "7"},
        "spec": {"target": "bot", "triggerPoint": "input", "pool": {"warm": 2, "max": 5},
                 "hooks": [{"name": "h", "action": "block",
                            "code": "def execute(context, settings):\n    return {'action': 'pass'}\n"}]}
    })
}

fn malformed_chain() -> Value {
    json!({
        "apiVersion": "sluice.dev/v1alpha1", "kind": "HookChain",
        "metadata": {"name": "broken", "namespace": "team-b", "uid": "uid-broken", "generation": 1, "resourceVersion": "8"},
        "spec": {"target": "bot", "triggerPoint": "sideways", "hooks": []}
    })
}

#[tokio::test]
async fn one_malformed_chain_does_not_stop_the_others() {
    let (client, mut api) = mock_client();
    let config = RunConfig {
        settings: Settings::default(),
        claim_deadline: Duration::from_secs(300),
        namespace: None,
        identity: "operator-test".into(),
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = spawn(async move {
        controller::run(client, &config, Metrics::new(), async move {
            let _ = stop_rx.await;
        })
        .await
    });

    let mut watches: Vec<Call> = Vec::new();
    let mut seen: Vec<String> = Vec::new();
    let mut created = 0;
    let mut pods_listed = false;
    let mut statuses = 0;
    while statuses < 2 {
        let call = api.next().await;
        let line = format!("{} {}", call.method, call.path);
        if call.query("watch") == Some("true") {
            // Watches stay open and silent.
            watches.push(call);
            continue;
        }
        seen.push(line.clone());
        match (call.method.as_str(), call.path.as_str()) {
            ("GET", "/apis/sluice.dev/v1alpha1/hookchains") => call.reply(
                200,
                list("HookChainList", vec![malformed_chain(), good_chain()]),
            ),
            ("GET", "/api/v1/pods") => {
                assert_eq!(
                    call.query("labelSelector"),
                    Some("app.kubernetes.io/managed-by=sluice-operator")
                );
                pods_listed = true;
                call.reply(200, list("PodList", vec![]))
            }
            ("GET", "/apis/sluice.dev/v1alpha1/capabilities") => {
                call.reply(200, list("CapabilityList", vec![]))
            }
            (
                "PATCH",
                "/apis/networking.k8s.io/v1/namespaces/team-a/networkpolicies/sluice-good-deny-all",
            ) => call.echo(),
            ("POST", "/api/v1/namespaces/team-a/pods") => {
                assert!(
                    pods_listed,
                    "created a pod before the pod cache listed: {seen:?}"
                );
                created += 1;
                let mut pod = call.body.clone();
                pod["metadata"]["name"] = format!("good-{created:05}").into();
                call.reply(201, pod)
            }
            ("POST", "/apis/events.k8s.io/v1/namespaces/team-a/events")
            | ("POST", "/apis/events.k8s.io/v1/namespaces/team-b/events") => call.echo(),
            ("PATCH", "/apis/sluice.dev/v1alpha1/namespaces/team-a/hookchains/good/status") => {
                statuses += 1;
                let mut chain = good_chain();
                chain["status"] = call.body["status"].clone();
                call.reply(200, chain)
            }
            ("PATCH", "/apis/sluice.dev/v1alpha1/namespaces/team-b/hookchains/broken/status") => {
                statuses += 1;
                assert_eq!(
                    call.body["status"]["conditions"][0]["reason"],
                    "InvalidObject"
                );
                // The API server would refuse it too; the operator carries on.
                call.reply(422, common::status_error(422, "Invalid"))
            }
            _ => panic!("unexpected request {call:?} after {seen:?}"),
        }
    }
    assert_eq!(created, 2, "{seen:?}");
    assert!(
        seen.iter()
            .any(|s| s == "POST /apis/events.k8s.io/v1/namespaces/team-b/events"),
        "the malformed chain gets an Event: {seen:?}"
    );

    // Stop: the controller returns without further requests.
    stop_tx.send(()).unwrap();
    api.finish(run).await;
    drop(watches);
}
