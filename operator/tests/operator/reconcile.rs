//! The reconciler against a mock API server: every request it makes is asserted (method, path, key
//! query parameters, body fields), and a request the test does not expect fails the test.

use crate::common;

use common::{ApiServer, mock_client, spawn, status_error};
use k8s_openapi::api::core::v1::Pod;
use kube::core::DeserializeGuard;
use kube::core::error_boundary::InvalidObject;
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

const NS: &str = "team-a";
const POLICY: &str =
    "/apis/networking.k8s.io/v1/namespaces/team-a/networkpolicies/sluice-redactor-deny-all";
const PODS: &str = "/api/v1/namespaces/team-a/pods";
const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/team-a/events";
const STATUS: &str = "/apis/sluice.dev/v1alpha1/namespaces/team-a/hookchains/redactor/status";

const GOOD: &str =
    "def execute(context, settings):\n    return {'action': 'modify', 'outgoing': 'x'}\n";

struct Harness {
    ctx: Arc<Context>,
    api: ApiServer,
    pods: Writer<Pod>,
    caps: Writer<DeserializeGuard<Capability>>,
    created: usize,
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

fn harness() -> Harness {
    let (client, api) = mock_client();
    let (pods, pod_writer) = ready_store();
    let (caps, cap_writer) = ready_store();
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "sluice-operator".into(),
            instance: Some("sluice-operator-0".into()),
        },
    );
    let ctx = Context::new(
        client,
        Settings::default(),
        Duration::from_secs(300),
        pods,
        caps,
        Expectations::default(),
        recorder,
        Metrics::new(),
    );
    Harness {
        ctx: Arc::new(ctx),
        api,
        pods: pod_writer,
        caps: cap_writer,
        created: 0,
    }
}

fn chain(warm: u32, max: u32, code: &str) -> HookChain {
    let mut c = HookChain::new(
        "redactor",
        serde_json::from_value(json!({
            "target": "support-bot", "triggerPoint": "input",
            "pool": {"warm": warm, "max": max},
            "hooks": [
                {"name": "redact-card", "action": "modify", "code": GOOD},
                {"name": "redact-phone", "action": "modify", "code": code}
            ]
        }))
        .unwrap(),
    );
    c.metadata.namespace = Some(NS.into());
    c.metadata.uid = Some("chain-uid".into());
    c.metadata.generation = Some(4);
    // Past the first reconcile, which only adds the finalizer.
    c.metadata.finalizers = Some(vec![build::FINALIZER.into()]);
    c
}

fn template(c: &HookChain) -> String {
    build::template_hash(c, &Settings::default())
}

/// A pod of the chain as the cache would show it, created a few seconds ago.
fn pod(name: &str, template: &str, pool: &str, ready: bool) -> Pod {
    let created =
        k8s_openapi::jiff::Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(5);
    serde_json::from_value(json!({
        "metadata": {
            "name": name, "namespace": NS, "resourceVersion": format!("rv-{name}"),
            "creationTimestamp": created.to_string(),
            "labels": {"sluice.dev/chain": "redactor", "sluice.dev/template": template, "sluice.dev/pool": pool,
                       "app.kubernetes.io/managed-by": "sluice-operator"}
        },
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"}}]}
    }))
    .unwrap()
}

impl Harness {
    fn add(&mut self, pod: Pod) {
        self.pods.apply_watcher_event(&Event::Apply(pod));
    }

    fn run(
        &self,
        chain: HookChain,
    ) -> tokio::task::JoinHandle<
        Result<kube::runtime::controller::Action, sluice_operator::reconcile::Error>,
    > {
        spawn(reconcile(
            Arc::new(DeserializeGuard(Ok(chain))),
            self.ctx.clone(),
        ))
    }

    async fn expect_policy(&mut self) {
        let call = self.api.next().await;
        call.is("PATCH", POLICY);
        assert_eq!(call.query("fieldManager"), Some("sluice-operator"));
        assert_eq!(call.query("force"), Some("true"));
        assert_eq!(call.content_type, "application/apply-patch+yaml");
        assert_eq!(call.body["kind"], "NetworkPolicy");
        assert_eq!(
            call.body["spec"]["policyTypes"],
            json!(["Ingress", "Egress"])
        );
        assert_eq!(
            call.body["spec"]["podSelector"]["matchLabels"],
            json!({"sluice.dev/chain": "redactor"})
        );
        assert_eq!(
            call.body["metadata"]["ownerReferences"][0]["uid"],
            "chain-uid"
        );
        call.echo();
    }

    /// Answers one pod create, naming the pod as the API server would; returns the body sent.
    async fn expect_create(&mut self, template: &str) -> Value {
        let call = self.api.next().await;
        call.is("POST", PODS);
        assert_eq!(call.query("fieldManager"), Some("sluice-operator"));
        let body = call.body.clone();
        assert_eq!(body["metadata"]["generateName"], "redactor-");
        assert_eq!(body["metadata"]["labels"]["sluice.dev/pool"], "warm");
        assert_eq!(body["metadata"]["labels"]["sluice.dev/template"], template);
        assert_eq!(body["metadata"]["ownerReferences"][0]["controller"], true);
        assert_eq!(body["spec"]["runtimeClassName"], "gvisor");
        self.created += 1;
        let mut stored = body.clone();
        stored["metadata"]["name"] = format!("redactor-{:05}", self.created).into();
        call.reply(201, stored);
        body
    }

    async fn expect_event(&mut self, type_: &str, reason: &str) -> String {
        let call = self.api.next().await;
        call.is("POST", EVENTS);
        assert_eq!(
            (call.body["type"].as_str(), call.body["reason"].as_str()),
            (Some(type_), Some(reason)),
            "{call:?}"
        );
        assert_eq!(call.body["regarding"]["kind"], "HookChain");
        assert_eq!(call.body["regarding"]["name"], "redactor");
        assert_eq!(call.body["reportingController"], "sluice-operator");
        let note = call.body["note"].as_str().unwrap_or_default().to_string();
        call.echo();
        note
    }

    /// Answers the status write; returns the status sent.
    async fn expect_status(&mut self) -> Value {
        let call = self.api.next().await;
        call.is("PATCH", STATUS);
        assert_eq!(call.query("fieldManager"), Some("sluice-operator"));
        assert_eq!(call.query("force"), Some("true"));
        assert_eq!(call.content_type, "application/apply-patch+yaml");
        assert_eq!(call.body["apiVersion"], "sluice.dev/v1alpha1");
        assert_eq!(call.body["kind"], "HookChain");
        assert!(call.body.get("spec").is_none(), "status only: {call:?}");
        let status = call.body["status"].clone();
        // The API server answers with the whole object.
        let mut stored = serde_json::to_value(chain(1, 1, GOOD)).unwrap();
        stored["status"] = status.clone();
        call.reply(200, stored);
        status
    }

    async fn expect_delete(&mut self, name: &str) -> Value {
        let call = self.api.next().await;
        call.is("DELETE", &format!("{PODS}/{name}"));
        let body = call.body.clone();
        let mut gone = pod(name, "x", "warm", false);
        gone.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                "2026-01-01T00:00:00Z".parse().unwrap(),
            ));
        call.reply(200, serde_json::to_value(gone).unwrap());
        body
    }
}

fn condition<'a>(status: &'a Value, type_: &str) -> &'a Value {
    status["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_))
        .unwrap_or_else(|| panic!("no {type_} condition in {status}"))
}

fn with_status(mut c: HookChain, status: &Value) -> HookChain {
    c.status = Some(serde_json::from_value(status.clone()).unwrap());
    c
}

#[tokio::test]
async fn fills_an_empty_pool_in_slow_start_batches_and_reports_status() {
    let mut h = harness();
    let c = chain(3, 10, GOOD);
    let task = h.run(c.clone());
    h.expect_policy().await;
    for _ in 0..3 {
        let body = h.expect_create(&template(&c)).await;
        assert_eq!(body["spec"]["automountServiceAccountToken"], false);
        assert_eq!(
            body["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"],
            true
        );
    }
    let note = h.expect_event("Normal", "CreatedSandboxes").await;
    assert!(note.contains("created 3"), "{note}");
    let status = h.expect_status().await;
    h.api.finish(task).await.unwrap();

    assert_eq!(status["observedGeneration"], 4);
    assert_eq!(status["warm"], 0);
    assert_eq!(status["claimed"], 0);
    assert_eq!(status["codeHash"], c.spec.code_hash());
    assert_eq!(condition(&status, "CodeValid")["status"], "True");
    let pool = condition(&status, "PoolReady");
    assert_eq!(
        (pool["status"].as_str(), pool["reason"].as_str()),
        (Some("False"), Some("Starting"))
    );
    assert!(
        pool["message"].as_str().unwrap().contains("3 starting"),
        "{pool}"
    );
    assert_eq!(condition(&status, "Ready")["status"], "False");
}

#[tokio::test]
async fn a_lagging_cache_never_causes_a_second_create() {
    let mut h = harness();
    let c = chain(2, 10, GOOD);
    let task = h.run(c.clone());
    h.expect_policy().await;
    h.expect_create(&template(&c)).await;
    h.expect_create(&template(&c)).await;
    h.expect_event("Normal", "CreatedSandboxes").await;
    let status = h.expect_status().await;
    h.api.finish(task).await.unwrap();

    // The watch has not delivered the two pods yet: nothing is created, nothing is re-applied,
    // and since nothing changed, the status is not written again.
    let c = with_status(c, &status);
    let task = h.run(c.clone());
    h.api.finish(task).await.unwrap();

    // One pod arrives, ready; the other is still in flight: still no create.
    h.add(pod("redactor-00001", &template(&c), "warm", true));
    let task = h.run(c.clone());
    let status = h.expect_status().await;
    h.api.finish(task).await.unwrap();
    assert_eq!(status["warm"], 1);
    let pool = condition(&status, "PoolReady");
    assert_eq!(pool["reason"], "Starting");

    // Both in the cache and ready: the pool is full and Ready flips to True.
    h.add(pod("redactor-00002", &template(&c), "warm", true));
    let c = with_status(c, &status);
    let task = h.run(c.clone());
    let status = h.expect_status().await;
    h.api.finish(task).await.unwrap();
    assert_eq!(status["warm"], 2);
    assert_eq!(condition(&status, "Ready")["status"], "True");
    assert_eq!(
        condition(&status, "PoolReady")["message"],
        "2 of 2 warm sandboxes ready, 0 claimed"
    );
}

#[tokio::test]
async fn claimed_and_starting_pods_count_toward_max() {
    let mut h = harness();
    let c = chain(3, 4, GOOD);
    let t = template(&c);
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    for name in ["redactor-c1", "redactor-c2"] {
        let mut p = pod(name, &t, "claimed", true);
        p.metadata.annotations = Some([("sluice.dev/claimed-at".to_string(), now.clone())].into());
        h.add(p);
    }
    h.add(pod("redactor-s1", &t, "warm", false));
    let task = h.run(c.clone());
    h.expect_policy().await;
    h.expect_create(&t).await;
    h.expect_event("Normal", "CreatedSandboxes").await;
    let note = h.expect_event("Warning", "PoolAtMax").await;
    assert!(note.contains("2 claimed"), "{note}");
    let status = h.expect_status().await;
    h.api.finish(task).await.unwrap();
    assert_eq!(status["claimed"], 2);
    let pool = condition(&status, "PoolReady");
    assert_eq!(pool["reason"], "AtMax");
    assert!(
        pool["message"]
            .as_str()
            .unwrap()
            .contains("spec.pool.max=4"),
        "{pool}"
    );
}

#[tokio::test]
async fn a_template_change_rolls_warm_pods_and_never_touches_claimed_ones() {
    let mut h = harness();
    let c = chain(2, 10, GOOD);
    let new = template(&c);
    h.add(pod("redactor-old1", "oldtemplate", "warm", true));
    h.add(pod("redactor-old2", "oldtemplate", "warm", true));
    let mut claimed = pod("redactor-busy", "oldtemplate", "claimed", true);
    claimed.metadata.annotations = Some(
        [(
            "sluice.dev/claimed-at".to_string(),
            k8s_openapi::jiff::Timestamp::now().to_string(),
        )]
        .into(),
    );
    h.add(claimed);

    // New pods first; the old ones keep serving until they are ready.
    let task = h.run(c.clone());
    h.expect_policy().await;
    h.expect_create(&new).await;
    h.expect_create(&new).await;
    h.expect_event("Normal", "CreatedSandboxes").await;
    let status = h.expect_status().await;
    h.api.finish(task).await.unwrap();
    assert_eq!(status["warm"], 2, "old ready pods still count as warm");

    // The new pods are ready: the old warm ones go, each on condition nobody claimed it meanwhile.
    h.add(pod("redactor-00001", &new, "warm", true));
    h.add(pod("redactor-00002", &new, "warm", true));
    let task = h.run(with_status(c, &status));
    for name in ["redactor-old1", "redactor-old2"] {
        let body = h.expect_delete(name).await;
        assert_eq!(
            body["preconditions"]["resourceVersion"],
            format!("rv-{name}")
        );
    }
    let note = h.expect_event("Normal", "RollingTemplate").await;
    assert!(note.contains("deleted 2"), "{note}");
    // Two warm (now new) and one claimed, as before: the status is unchanged and not rewritten.
    h.api.finish(task).await.unwrap();
    assert_eq!(
        (status["warm"].as_u64(), status["claimed"].as_u64()),
        (Some(2), Some(1))
    );
}

#[tokio::test]
async fn a_pod_claimed_in_the_meantime_survives_its_delete() {
    let mut h = harness();
    let c = chain(1, 10, GOOD);
    let t = template(&c);
    h.add(pod("redactor-a", &t, "warm", true));
    h.add(pod("redactor-b", &t, "warm", true));
    let task = h.run(c);
    h.expect_policy().await;
    let call = h.api.next().await;
    call.is("DELETE", &format!("{PODS}/redactor-b"));
    call.reply(409, status_error(409, "Conflict"));
    let status = h.expect_status().await;
    h.api.finish(task).await.unwrap();
    assert_eq!(status["warm"], 1);
}

#[tokio::test]
async fn claims_past_the_deadline_and_exited_pods_are_deleted() {
    let mut h = harness();
    let c = chain(0, 10, GOOD);
    let t = template(&c);
    let mut stale = pod("redactor-stale", &t, "claimed", true);
    stale.metadata.annotations = Some(
        [
            (
                "sluice.dev/claimed-at".to_string(),
                "2026-01-01T00:00:00Z".to_string(),
            ),
            (
                "sluice.dev/claimed-by".to_string(),
                "sluice-gateway-7f9c".to_string(),
            ),
        ]
        .into(),
    );
    h.add(stale);
    let mut exited = pod("redactor-exited", &t, "warm", false);
    exited.status.as_mut().unwrap().phase = Some("Failed".into());
    h.add(exited);
    let task = h.run(c);
    h.expect_policy().await;
    let body = h.expect_delete("redactor-exited").await;
    assert!(body.get("preconditions").is_none(), "{body}");
    let note = h.expect_event("Warning", "SandboxExited").await;
    assert!(note.contains("redactor-exited"), "{note}");
    h.expect_delete("redactor-stale").await;
    let note = h.expect_event("Warning", "ClaimExpired").await;
    assert!(
        note.contains("redactor-stale") && note.contains("sluice-gateway-7f9c"),
        "{note}"
    );
    let status = h.expect_status().await;
    h.api.finish(task).await.unwrap();
    assert_eq!(status["claimed"], 0);
}

#[tokio::test]
async fn invalid_code_is_reported_with_hook_and_line_and_grows_nothing() {
    let mut h = harness();
    let c = chain(
        2,
        10,
        "def execute(context, settings):\n    x = 1\n    return {'action': 'modify'\n",
    );
    h.add(pod("redactor-kept", &template(&c), "warm", true));
    let task = h.run(c);
    h.expect_policy().await;
    let note = h.expect_event("Warning", "InvalidCode").await;
    assert!(
        note.starts_with("hook redact-phone line 3: SyntaxError"),
        "{note}"
    );
    let status = h.expect_status().await;
    h.api.finish(task).await.unwrap();
    let code = condition(&status, "CodeValid");
    assert_eq!(
        (code["status"].as_str(), code["reason"].as_str()),
        (Some("False"), Some("InvalidCode"))
    );
    assert!(
        code["message"]
            .as_str()
            .unwrap()
            .contains("hook redact-phone line 3"),
        "{code}"
    );
    assert_eq!(condition(&status, "Ready")["reason"], "InvalidCode");
    assert_eq!(condition(&status, "PoolReady")["reason"], "Paused");
    assert_eq!(status["warm"], 1, "the existing warm pod is kept");
}

#[tokio::test]
async fn an_unknown_capability_makes_the_code_invalid() {
    let mut h = harness();
    let mut c = chain(1, 10, GOOD);
    c.spec.hooks[1].capabilities = vec!["llm.run".into()];
    // A capability of that name in another namespace does not count.
    let mut other: Capability = serde_json::from_value(json!({
        "apiVersion": "sluice.dev/v1alpha1", "kind": "Capability",
        "metadata": {"name": "llm.run", "namespace": "elsewhere"},
        "spec": {"endpoint": {"builtin": "echo"}}
    }))
    .unwrap();
    h.caps
        .apply_watcher_event(&Event::Apply(DeserializeGuard(Ok(other.clone()))));
    let task = h.run(c.clone());
    h.expect_policy().await;
    let note = h.expect_event("Warning", "UnknownCapability").await;
    assert!(
        note.contains(
            "hook redact-phone: capability \"llm.run\" is not defined in namespace team-a"
        ),
        "{note}"
    );
    let status = h.expect_status().await;
    h.api.finish(task).await.unwrap();

    // Defined in the chain's namespace: valid, and a Normal event says the problem is gone.
    other.metadata.namespace = Some(NS.into());
    h.caps
        .apply_watcher_event(&Event::Apply(DeserializeGuard(Ok(other))));
    let task = h.run(with_status(c.clone(), &status));
    h.expect_event("Normal", "CodeValid").await;
    h.expect_create(&template(&c)).await;
    h.expect_event("Normal", "CreatedSandboxes").await;
    let status = h.expect_status().await;
    h.api.finish(task).await.unwrap();
    assert_eq!(condition(&status, "CodeValid")["status"], "True");
}

#[tokio::test]
async fn unschedulable_pods_are_held_with_a_warning() {
    let mut h = harness();
    let c = chain(3, 10, GOOD);
    let mut stuck = pod("redactor-stuck", &template(&c), "warm", false);
    stuck.status = serde_json::from_value(json!({"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/3 nodes are available: 3 node(s) had untolerated taint {sandbox: gvisor}."}
    ]}))
    .unwrap();
    h.add(stuck);
    let task = h.run(c);
    h.expect_policy().await;
    let note = h.expect_event("Warning", "Unschedulable").await;
    assert!(
        note.contains("redactor-stuck") && note.contains("untolerated taint"),
        "{note}"
    );
    let status = h.expect_status().await;
    h.api.finish(task).await.unwrap();
    assert_eq!(condition(&status, "PoolReady")["reason"], "Unschedulable");
}

#[tokio::test]
async fn a_malformed_chain_gets_an_event_and_a_condition() {
    let mut h = harness();
    let meta = kube::api::ObjectMeta {
        name: Some("redactor".into()),
        namespace: Some(NS.into()),
        uid: Some("chain-uid".into()),
        generation: Some(2),
        finalizers: Some(vec![build::FINALIZER.into()]),
        ..Default::default()
    };
    let broken = DeserializeGuard::<HookChain>(Err(InvalidObject {
        error: "spec.triggerPoint: unknown variant `sideways`".into(),
        metadata: meta,
    }));
    let task = spawn(reconcile(Arc::new(broken), h.ctx.clone()));
    let note = h.expect_event("Warning", "InvalidObject").await;
    assert!(note.contains("sideways"), "{note}");
    let status = h.expect_status().await;
    let action = h.api.finish(task).await.unwrap();
    assert_eq!(action, kube::runtime::controller::Action::await_change());
    let ready = condition(&status, "Ready");
    assert_eq!(
        (ready["status"].as_str(), ready["reason"].as_str()),
        (Some("False"), Some("InvalidObject"))
    );
}

#[tokio::test]
async fn a_failing_create_stops_the_batch_and_says_why() {
    let mut h = harness();
    let c = chain(4, 10, GOOD);
    let task = h.run(c);
    h.expect_policy().await;
    let call = h.api.next().await;
    call.is("POST", PODS);
    call.reply(403, status_error(403, "Forbidden"));
    let note = h.expect_event("Warning", "CreateFailed").await;
    assert!(note.contains("Forbidden"), "{note}");
    let err = h.api.finish(task).await.unwrap_err();
    assert!(err.to_string().contains("team-a/redactor"), "{err}");
}

#[tokio::test]
async fn a_hook_code_change_needs_no_new_pods() {
    let mut h = harness();
    let c = chain(2, 10, GOOD);
    h.add(pod("redactor-a", &template(&c), "warm", true));
    h.add(pod("redactor-b", &template(&c), "warm", true));
    let task = h.run(c.clone());
    h.expect_policy().await;
    let before = h.expect_status().await;
    h.api.finish(task).await.unwrap();

    let mut changed = with_status(c, &before);
    changed.spec.hooks[1].code =
        "def execute(context, settings):\n    return {'action': 'pass'}\n".into();
    changed.metadata.generation = Some(5);
    let task = h.run(changed.clone());
    // No pod is created or deleted: the new revision goes live at once (no spec.rollout), said in
    // an Event, and the status moves to the new code hash and generation.
    let note = h.expect_event("Normal", "Promoted").await;
    assert!(note.contains("no spec.rollout"), "{note}");
    let after = h.expect_status().await;
    h.api.finish(task).await.unwrap();
    assert_eq!(
        after["rollout"]["liveRevision"],
        sluice_crds::rollout::revision_of(&changed.spec)
    );
    assert_eq!(condition(&after, "RolledOut")["status"], "True");
    assert_eq!(after["codeHash"], changed.spec.code_hash());
    assert_ne!(after["codeHash"], before["codeHash"]);
    assert_eq!(after["observedGeneration"], 5);
    let (b, a) = (condition(&before, "Ready"), condition(&after, "Ready"));
    assert_eq!(a["status"], "True");
    assert_eq!(
        a["lastTransitionTime"], b["lastTransitionTime"],
        "no flip, same transition time"
    );
}

#[tokio::test]
async fn a_claim_time_at_the_end_of_time_does_not_crash_the_operator() {
    let mut h = harness();
    let c = chain(0, 10, GOOD);
    let mut p = pod("redactor-c", &template(&c), "claimed", true);
    // Anyone who can patch pods can write this; adding the claim deadline to it overflows.
    p.metadata.annotations = Some(
        [(
            "sluice.dev/claimed-at".to_string(),
            "9999-12-30T21:59:59Z".to_string(),
        )]
        .into(),
    );
    h.add(p);
    let task = h.run(c);
    h.expect_policy().await;
    let status = h.expect_status().await;
    let action = h.api.finish(task).await.unwrap();
    assert_eq!(
        status["claimed"], 1,
        "a claim from the future counts from now"
    );
    // The claim expires in 300 s (counted from now): the usual resync comes first.
    assert_eq!(
        action,
        kube::runtime::controller::Action::requeue(Duration::from_secs(300))
    );
}

#[tokio::test]
async fn a_pod_that_never_becomes_ready_is_replaced_one_at_a_time_and_says_why() {
    let mut h = harness();
    let c = chain(3, 10, GOOD);
    let t = template(&c);
    let mut stuck = pod("redactor-stuck", &t, "warm", false);
    stuck.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        k8s_openapi::jiff::Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(121),
    ));
    stuck.status = serde_json::from_value(json!({"phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "False"}],
        "containerStatuses": [{"name": "supervisor", "ready": false, "restartCount": 0,
            "image": "ghcr.io/sluice/nope:1", "imageID": "",
            "state": {"waiting": {"reason": "ImagePullBackOff",
                                   "message": "Back-off pulling image \"ghcr.io/sluice/nope:1\""}}}]}))
    .unwrap();
    h.add(stuck);
    let task = h.run(c.clone());
    h.expect_policy().await;
    let body = h.expect_delete("redactor-stuck").await;
    assert_eq!(
        body["preconditions"]["resourceVersion"],
        "rv-redactor-stuck"
    );
    let note = h.expect_event("Warning", "StartFailed").await;
    assert!(
        note.starts_with("pod redactor-stuck: ImagePullBackOff: Back-off pulling image"),
        "{note}"
    );
    // Only one replacement while none of this template has started, not the whole pool.
    h.expect_create(&t).await;
    h.expect_event("Normal", "CreatedSandboxes").await;
    let status = h.expect_status().await;
    h.api.finish(task).await.unwrap();
    let pool = condition(&status, "PoolReady");
    assert_eq!(pool["reason"], "StartFailing", "{pool}");
    assert!(
        pool["message"]
            .as_str()
            .unwrap()
            .contains("pod redactor-stuck: ImagePullBackOff"),
        "{pool}"
    );

    // The replacement shows up, still starting: the failure is remembered and nothing more is
    // created beside it.
    h.pods
        .apply_watcher_event(&Event::Delete(pod("redactor-stuck", &t, "warm", false)));
    h.add(pod("redactor-00001", &t, "warm", false));
    let c = with_status(c, &status);
    let task = h.run(c.clone());
    h.api.finish(task).await.unwrap();

    // It becomes ready: the template can start, and the pool fills at full speed.
    h.add(pod("redactor-00001", &t, "warm", true));
    let task = h.run(c);
    h.expect_create(&t).await;
    h.expect_create(&t).await;
    // The recorder updates the series of the earlier CreatedSandboxes event.
    let call = h.api.next().await;
    assert!(call.path.starts_with(EVENTS), "{call:?}");
    call.echo();
    let status = h.expect_status().await;
    h.api.finish(task).await.unwrap();
    assert_eq!(condition(&status, "PoolReady")["reason"], "Starting");
}

#[tokio::test]
async fn a_chain_name_that_is_no_label_value_gets_a_verdict_and_no_pods() {
    let mut h = harness();
    let long = "r".repeat(64);
    let mut c = chain(2, 10, GOOD);
    c.metadata.name = Some(long.clone());
    let task = h.run(c);
    // No NetworkPolicy (its selector would carry the same label) and no pod.
    let call = h.api.next().await;
    call.is("POST", EVENTS);
    assert_eq!(
        (call.body["type"].as_str(), call.body["reason"].as_str()),
        (Some("Warning"), Some("InvalidName"))
    );
    let note = call.body["note"].as_str().unwrap().to_string();
    assert!(
        note.contains("HookChain names used as label values must be at most 63 characters"),
        "{note}"
    );
    call.echo();
    let call = h.api.next().await;
    call.is(
        "PATCH",
        &format!("/apis/sluice.dev/v1alpha1/namespaces/team-a/hookchains/{long}/status"),
    );
    let status = call.body["status"].clone();
    let mut stored = serde_json::to_value(chain(1, 1, GOOD)).unwrap();
    stored["status"] = status.clone();
    call.reply(200, stored);
    h.api.finish(task).await.unwrap();
    let code = condition(&status, "CodeValid");
    assert_eq!(
        (code["status"].as_str(), code["reason"].as_str()),
        (Some("False"), Some("InvalidName"))
    );
    assert_eq!(condition(&status, "Ready")["reason"], "InvalidName");
}

#[tokio::test]
async fn revisions_that_cannot_be_kept_hold_the_rollout_not_the_pool_or_its_status() {
    let mut h = harness();
    h.api.fail_revisions = true;
    let c = chain(2, 10, GOOD);
    h.add(pod("redactor-a", &template(&c), "warm", true));
    h.add(pod("redactor-b", &template(&c), "warm", true));
    let task = h.run(c.clone());
    h.expect_policy().await;
    let status = h.expect_status().await;
    let action = h
        .api
        .finish(task)
        .await
        .expect("the reconcile does not fail");
    assert_eq!(condition(&status, "Ready")["status"], "True");
    assert!(
        status.get("rollout").is_none(),
        "no rollout state without its revisions: {status}"
    );
    // Tried again soon, not at the next resync.
    assert!(
        action == kube::runtime::controller::Action::requeue(std::time::Duration::from_secs(10)),
        "{action:?}"
    );
}
