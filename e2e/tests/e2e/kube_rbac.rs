//! The RBAC each component needs, derived from the requests it really makes: the real operator (in
//! the dedicated sandbox namespace layout, leader election included) and the real gateway run a
//! chain's whole life against the fake API server (pool filled, a trigger point claimed and run
//! over exec, the chain deleted and its pods cleaned up by the finalizer, both stopped), each with a
//! client the server logs under its name. Every request becomes (where, API group, resource, verb);
//! the set must equal `deploy/tests/rbac_required.yaml`, which the manifest suite
//! (`deploy/tests/test_manifests.py`) holds the rendered chart's Roles and ClusterRoles to, in both
//! install shapes. A verb the code starts using fails here; a verb the chart grants and no code uses
//! fails there. `SLUICE_UPDATE_RBAC=1` rewrites the file from what this run saw.

use sluice_e2e::{Harness, action, chain_yaml, manifest_json, operator};
use sluice_fake_apiserver::{FakeApiServer, Fault, Logged, Resource};
use sluice_operator::reconcile::build::Settings;
use sluice_proto::Action;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

const TENANT: &str = "default";
const SANDBOXES: &str = "sluice-sandboxes";
const RELEASE: &str = "sluice-system";
const REQUIRED: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../deploy/tests/rbac_required.yaml"
);

/// Where a rule must hold: cluster-wide for a cluster-scoped resource (nodes), in every namespace
/// with HookChains (a ClusterRole, or Roles in the watched and platform namespaces), in the sandbox
/// namespace, or in the release namespace.
fn scope(namespace: Option<&str>, resource: &str) -> &'static str {
    if CLUSTER_SCOPED.contains(&resource) {
        return "cluster";
    }
    match namespace {
        None | Some(TENANT) => "chains",
        Some(SANDBOXES) => "sandboxes",
        Some(RELEASE) => "release",
        Some(other) => panic!("a request in an unexpected namespace {other}"),
    }
}

/// The cluster-scoped resources the components read.
const CLUSTER_SCOPED: [&str; 1] = ["nodes"];

type Rules = BTreeMap<String, BTreeMap<&'static str, BTreeMap<(String, String), BTreeSet<String>>>>;

/// The (API group, resource, verbs) a request needs, as the API server's RBAC authorizer sees it.
fn needs(l: &Logged) -> (Option<String>, String, String, Vec<&'static str>) {
    let parts: Vec<&str> = l.path.trim_matches('/').split('/').collect();
    let (group, rest) = match parts.as_slice() {
        ["api", "v1", rest @ ..] => (String::new(), rest),
        ["apis", group, _version, rest @ ..] => (group.to_string(), rest),
        _ => panic!("not an API path: {}", l.path),
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] => (Some(ns.to_string()), rest),
        rest => (None, rest),
    };
    let (resource, named) = match rest {
        [plural] => (plural.to_string(), false),
        [plural, _name] => (plural.to_string(), true),
        [plural, _name, sub] => (format!("{plural}/{sub}"), true),
        _ => panic!("not a resource path: {}", l.path),
    };
    let watch = l
        .query
        .split('&')
        .any(|kv| kv == "watch=true" || kv == "watch=1");
    let verbs = match (l.method.as_str(), named) {
        // The exec websocket is a GET upgrade: authorized as `get`, and by API servers with
        // AuthorizePodWebsocketUpgradeCreatePermission (on by default since 1.35) as `create` too.
        ("GET", true) if resource == "pods/exec" => vec!["create", "get"],
        ("GET", true) => vec!["get"],
        ("GET", false) if watch => vec!["watch"],
        ("GET", false) => vec!["list"],
        // kube's event Recorder creates an Event and merge-patches it when the same one recurs.
        ("POST", false) if resource == "events" => vec!["create", "patch"],
        ("POST", false) => vec!["create"],
        ("PUT", true) => vec!["update"],
        // A server-side apply (the operator's are all forced) creates a missing object, which the
        // API server authorizes as `create` as well; a subresource is never created that way.
        ("PATCH", true) if l.query.contains("force=true") && !resource.contains('/') => {
            vec!["create", "patch"]
        }
        ("PATCH", true) => vec!["patch"],
        ("DELETE", true) => vec!["delete"],
        ("DELETE", false) => vec!["deletecollection"],
        (m, _) => panic!("unexpected request {m} {}", l.path),
    };
    (namespace, group, resource, verbs)
}

fn derive(log: &[Logged]) -> Rules {
    let mut rules = Rules::new();
    for l in log {
        let Some(who) = &l.client else { continue };
        let (namespace, group, resource, verbs) = needs(l);
        let scoped = rules
            .entry(who.clone())
            .or_default()
            .entry(scope(namespace.as_deref(), &resource))
            .or_default()
            .entry((group, resource))
            .or_default();
        scoped.extend(verbs.into_iter().map(str::to_string));
    }
    rules
}

fn to_yaml(rules: &Rules) -> String {
    let mut out = String::from(
        "# The RBAC rules each component needs, by where they must hold. Derived by\n\
         # e2e/tests/e2e/kube_rbac.rs from the requests the real operator and gateway make over a chain's\n\
         # life; the manifest suite checks the chart's Roles and ClusterRoles grant exactly these.\n\
         # Regenerate: SLUICE_UPDATE_RBAC=1 cargo test -p sluice-e2e --test e2e kube_rbac::\n\
         #   chains:    every namespace with HookChains (ClusterRole, or Roles in watchNamespace and\n\
         #              platformNamespace)\n\
         #   sandboxes: the sandbox namespace (with sandboxNamespace empty: the chains' namespaces)\n\
         #   release:   the release namespace\n\
         #   cluster:   cluster-scoped resources (a ClusterRole in every install shape)\n",
    );
    for (who, scopes) in rules {
        out.push_str(&format!("{who}:\n"));
        for (scope, resources) in scopes {
            out.push_str(&format!("  {scope}:\n"));
            for ((group, resource), verbs) in resources {
                let verbs: Vec<&str> = verbs.iter().map(String::as_str).collect();
                out.push_str(&format!(
                    "    - {{apiGroup: \"{group}\", resource: {resource}, verbs: [{}]}}\n",
                    verbs.join(", ")
                ));
            }
        }
    }
    out
}

const REDACT: &str = r##"import re
def execute(context, settings):
    out = re.sub(r"\d", "#", context["outgoing"])
    return {"action": "modify", "outgoing": out} if out != context["outgoing"] else {"action": "pass"}"##;

fn sandbox_pods(api: &FakeApiServer) -> Vec<serde_json::Value> {
    api.list(Resource::Pods, SANDBOXES)
        .into_iter()
        .filter(|p| p["metadata"]["labels"]["sluice.dev/chain"] == "rbac")
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .collect()
}

async fn until(api: &FakeApiServer, what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..2400 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let requests: Vec<String> = api
        .requests()
        .iter()
        .map(|l| format!("{:?} {} {}?{}", l.client, l.method, l.path, l.query))
        .collect();
    panic!(
        "never happened: {what}\nrequests: {requests:#?}\nsandbox pods: {:#?}",
        api.list(Resource::Pods, SANDBOXES)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_rules_each_component_needs_are_the_ones_the_chart_is_held_to() {
    let api = FakeApiServer::builder()
        .start()
        .await
        .expect("fake API server");
    let chain = chain_yaml(
        "rbac",
        "bot",
        "input",
        "pool: {warm: 2, max: 4}",
        &[("digits", "modify", REDACT)],
    );
    api.apply(Resource::HookChains, manifest_json(&chain));
    api.apply(
        Resource::Capabilities,
        serde_json::json!({
            "apiVersion": "sluice.dev/v1alpha1", "kind": "Capability",
            "metadata": {"name": "echo", "namespace": TENANT},
            "spec": {"endpoint": {"builtin": "echo"}}
        }),
    );

    // The operator as `sluice-operator run --sandbox-namespace sluice-sandboxes` runs it.
    let mut config = operator::config(
        "operator-rbac",
        Settings {
            sandbox_namespace: Some(SANDBOXES.into()),
            ..Settings::default()
        },
    );
    config.platform_namespace = RELEASE.into();
    let running = operator::start(api.client_as("operator"), config);
    until(&api, "two Ready warm pods in the sandbox namespace", || {
        sandbox_pods(&api)
            .iter()
            .filter(|p| {
                p["status"]["conditions"].as_array().is_some_and(|cs| {
                    cs.iter()
                        .any(|c| c["type"] == "Ready" && c["status"] == "True")
                })
            })
            .count()
            >= 2
    })
    .await;
    assert!(
        api.list(Resource::Pods, TENANT).is_empty(),
        "no pod beside the chain"
    );
    until(&api, "the Capability's status says Ready", || {
        api.get(Resource::Capabilities, TENANT, "echo")
            .is_some_and(|c| {
                c["status"]["conditions"].as_array().is_some_and(|cs| {
                    cs.iter()
                        .any(|c| c["type"] == "Ready" && c["status"] == "True")
                })
            })
    })
    .await;

    // The gateway claims one, runs a trigger point over exec, and deletes it (reuse: Recycle is
    // the default; shutdown hands back what it holds).
    let gateway_client = api.client_as("gateway");
    let h = Harness::start_kube_with(&api, "gw-rbac", Duration::from_secs(90), |opts| {
        opts.client = gateway_client;
        opts.kube.sandbox_namespace = Some(SANDBOXES.into());
        opts.kube.shadow_status_every = Duration::from_millis(300);
    })
    .await;
    // The first claim is stored but answered 504 (an API server that timed out after the write
    // committed): the gateway reads the pod back to learn whether the claim is its own, a read its
    // Role must allow (it once did not: every read-back was refused, and a claim whose answer was
    // lost left the pod claimed and idle until the operator's claim deadline).
    api.inject(
        Fault::answer("PATCH", "/pods/", 504)
            .after_commit()
            .times(1),
    );
    let r = h.run_text("bot", "input", "call 555").await.expect("run");
    assert_eq!(action(&r), Action::Modify, "{r:?}");
    assert!(
        api.requests()
            .iter()
            .any(|l| l.client.as_deref() == Some("gateway")
                && l.method == "GET"
                && l.path
                    .starts_with(&format!("/api/v1/namespaces/{SANDBOXES}/pods/"))
                && !l.path.ends_with("/exec")),
        "the gateway never read back the pod whose claim was answered 504"
    );

    // A shadow candidate that blocks everything: the gateway writes its comparison into the
    // chain's status (its own entry).
    let mut hc = api
        .get(Resource::HookChains, TENANT, "rbac")
        .expect("the chain");
    hc["spec"]["hooks"][0]["action"] = serde_json::json!("block");
    hc["spec"]["hooks"][0]["code"] = serde_json::json!(
        "def execute(context, settings):\n    return {'action': 'block', 'message': 'no'}\n"
    );
    hc["spec"]["rollout"] = serde_json::json!({"strategy": "Shadow"});
    api.apply(Resource::HookChains, hc);
    let compared = || {
        api.get(Resource::HookChains, TENANT, "rbac")
            .is_some_and(|hc| {
                hc["status"]["rollout"]["shadow"]
                    .as_array()
                    .is_some_and(|entries| {
                        entries.iter().any(|e| {
                            e["gateway"] == "gw-rbac" && e["actionDiffers"].as_u64() >= Some(1)
                        })
                    })
            })
    };
    for _ in 0..600 {
        if compared() {
            break;
        }
        let r = h.run_text("bot", "input", "call 555").await.expect("run");
        assert_eq!(
            action(&r),
            Action::Modify,
            "a shadow candidate answered: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(compared(), "the gateway never wrote its shadow comparison");

    // A canary that fails: the operator keeps both revisions, the gateway reads the live one's
    // hooks from its ControllerRevision and rolls the canary back for the cluster (the chain's
    // sluice.dev/rollback annotation), which the operator follows.
    let mut hc = api
        .get(Resource::HookChains, TENANT, "rbac")
        .expect("the chain");
    hc["spec"]["failurePolicy"] = serde_json::json!("Open");
    hc["spec"]["hooks"][0]["code"] =
        serde_json::json!("def execute(context, settings):\n    raise ValueError('broken')\n");
    hc["spec"]["rollout"] = serde_json::json!({"strategy": "Canary", "steps": [100], "minRuns": 1, "stepDuration": "1h"});
    api.apply(Resource::HookChains, hc);
    let rolled_back = || {
        api.get(Resource::HookChains, TENANT, "rbac")
            .is_some_and(|hc| hc["status"]["rollout"]["phase"] == "RolledBack")
    };
    for _ in 0..600 {
        if rolled_back() {
            break;
        }
        h.run_text("bot", "input", "call 555").await.expect("run");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(rolled_back(), "the failing canary was never rolled back");
    // New hooks at once, keeping one revision: the operator prunes the others.
    let mut hc = api
        .get(Resource::HookChains, TENANT, "rbac")
        .expect("the chain");
    hc["spec"]["hooks"][0]["code"] = serde_json::json!(REDACT);
    hc["spec"]["hooks"][0]["name"] = serde_json::json!("digits2");
    hc["spec"]["revisionHistoryLimit"] = serde_json::json!(1);
    hc["spec"].as_object_mut().map(|s| s.remove("rollout"));
    api.apply(Resource::HookChains, hc);
    until(&api, "one revision kept", || {
        api.list(Resource::ControllerRevisions, TENANT).len() == 1
    })
    .await;

    // A drain: the node is cordoned while the gateway holds the pod it recycles. The operator marks
    // that pod draining, and the gateway gives it back (deletes it).
    let r = h.run_text("bot", "input", "call 555").await.expect("run");
    assert_eq!(action(&r), Action::Modify, "{r:?}");
    let held: Vec<String> = sandbox_pods(&api)
        .iter()
        .filter(|p| p["metadata"]["labels"]["sluice.dev/pool"] == "claimed")
        .filter_map(|p| p["metadata"]["name"].as_str().map(str::to_string))
        .collect();
    assert!(!held.is_empty(), "the gateway holds no pod after a run");
    let node = |unschedulable: bool| {
        serde_json::json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": sluice_fake_apiserver::NODE},
            "spec": {"unschedulable": unschedulable},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        })
    };
    api.apply(Resource::Nodes, node(true));
    let by = |client: &str, method: &str, pod: &str| {
        api.requests().iter().any(|l| {
            l.client.as_deref() == Some(client)
                && l.method == method
                && l.path == format!("/api/v1/namespaces/{SANDBOXES}/pods/{pod}")
        })
    };
    until(&api, "the operator marks the held pod draining", || {
        held.iter().all(|p| by("operator", "PATCH", p))
    })
    .await;
    until(&api, "the gateway gives the marked pod back", || {
        held.iter().all(|p| by("gateway", "DELETE", p))
    })
    .await;
    api.apply(Resource::Nodes, node(false));
    h.stop_kube_and_check(&api).await;

    // Deleting the chain: the finalizer deletes its pods and policy in the sandbox namespace.
    assert!(api.delete(Resource::HookChains, TENANT, "rbac").await);
    until(&api, "the chain gone with its pods and policy", || {
        api.get(Resource::HookChains, TENANT, "rbac").is_none()
            && sandbox_pods(&api).is_empty()
            && api.list(Resource::NetworkPolicies, SANDBOXES).is_empty()
    })
    .await;

    operator::stop(running).await;

    let derived = to_yaml(&derive(&api.requests()));
    api.stop().await;
    if std::env::var_os("SLUICE_UPDATE_RBAC").is_some() {
        std::fs::write(REQUIRED, &derived).expect("write the RBAC requirements");
    }
    let recorded = std::fs::read_to_string(REQUIRED).unwrap_or_default();
    assert_eq!(
        recorded, derived,
        "the requests made need other rules than {REQUIRED} says (a verb added or no longer used): \
         rerun with SLUICE_UPDATE_RBAC=1, then make the chart's rbac.yaml grant exactly that"
    );
}
