//! Cluster end to end: Sluice installed in a real cluster with gVisor (kind + runsc; see
//! e2e/cluster/README.md), driven the way a platform team and an application would: HookChains applied
//! through the API server, calls through the gateway's gRPC API.
//!
//! Opt-in: the suite runs only when `KUBECONFIG` is set (never against whatever `~/.kube/config`
//! happens to point at) and the API server answers; otherwise each test prints
//! `SKIPPED: no cluster: ...` and passes. With `SLUICE_CLUSTER_REQUIRED=1` (`make test-cluster`
//! sets it) every such skip is a failure instead. The gateway is reached at `SLUICE_GATEWAY`
//! (default `http://127.0.0.1:50051`, a `kubectl port-forward`), or with
//! `SLUICE_GATEWAY_SERVICE=<namespace>/<service>` directly at a ready pod behind that Service (the
//! test cluster of `make cluster-up` has no kube-proxy), over TLS trusting `SLUICE_CA` and with the
//! bearer token `SLUICE_TOKEN` when they are set. Each test works in a namespace of its own,
//! labelled `sluice.dev/e2e=true`, deleted when the test ends (even when it fails). Sandbox pods are
//! looked for in `SLUICE_SANDBOX_NAMESPACE` (the chart's `sandboxNamespace.name`, default
//! `sluice-sandboxes`; empty for a single-namespace install, where they live beside their chain).

mod production;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use sluice_crds::{HookChain, sandbox_pod};
use sluice_proto::client::{Client as GatewayClient, ClientAuth};
use sluice_proto::{self as proto, Action};
use std::collections::BTreeSet;
use std::future::Future;
use std::time::{Duration, Instant};

/// A sandbox pod can take a while the first time a node pulls the supervisor image.
const POOL_READY: Duration = Duration::from_secs(300);
const RUNTIME_CLASS: &str = "gvisor";

const UPPER: &str = "def execute(context, settings):\n    return {'action': 'modify', 'outgoing': context['outgoing'].upper()}\n";
const LOWER: &str = "def execute(context, settings):\n    return {'action': 'modify', 'outgoing': context['outgoing'].lower()}\n";
const SLOW: &str = "import time\ndef execute(context, settings):\n    time.sleep(20)\n    return {'action': 'pass'}\n";
const DIGITS: &str = "import re\ndef execute(context, settings):\n    return {'action': 'modify', 'outgoing': re.sub(r'[0-9]', '#', context['outgoing'])}\n";

/// One test's view of the cluster: a client, a fresh namespace, and the gateway.
struct Cluster {
    client: Client,
    ns: String,
    /// Where the operator puts this test's sandbox pods: the sandbox namespace, or `ns`.
    sandboxes: Option<String>,
    gateway: GatewayClient,
}

/// The chart's `sandboxNamespace.name` (`SLUICE_SANDBOX_NAMESPACE`; empty: pods beside chains).
fn sandbox_namespace() -> Option<String> {
    match std::env::var("SLUICE_SANDBOX_NAMESPACE") {
        Ok(ns) if ns.is_empty() => None,
        Ok(ns) => Some(ns),
        Err(_) => Some("sluice-sandboxes".into()),
    }
}

/// Says why a test does not run: a skip that passes, or with `SLUICE_CLUSTER_REQUIRED=1` (a run
/// that promised a cluster) a failure.
fn skip(why: &str) {
    if std::env::var("SLUICE_CLUSTER_REQUIRED").is_ok_and(|v| v == "1") {
        panic!("SLUICE_CLUSTER_REQUIRED=1 but the test cannot run: {why}");
    }
    println!("SKIPPED: {why}");
}

/// Connects, or says why the suite is skipped. `None` means: print nothing more, pass.
async fn cluster(test: &str) -> Option<Cluster> {
    if std::env::var_os("KUBECONFIG").is_none() {
        skip(&format!("no cluster: KUBECONFIG not set ({test})"));
        return None;
    }
    let client = match Client::try_default().await {
        Ok(c) => c,
        Err(e) => {
            skip(&format!("no cluster: API server unreachable: {e} ({test})"));
            return None;
        }
    };
    match tokio::time::timeout(Duration::from_secs(10), client.apiserver_version()).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            skip(&format!("no cluster: API server unreachable: {e} ({test})"));
            return None;
        }
        Err(_) => {
            skip(&format!(
                "no cluster: API server unreachable: no answer in 10 s ({test})"
            ));
            return None;
        }
    }
    // From here on a cluster is there: anything missing is a failure, not a skip.
    Api::<HookChain>::all(client.clone())
        .list(&ListParams::default().limit(1))
        .await
        .expect("the HookChain CRD is installed (helm install sluice charts/sluice, see e2e/cluster/README.md)");
    let gateway = connect_gateway(&client)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let ns = format!("sluice-e2e-{test}-{:05x}", rand_suffix());
    let namespace: Namespace = serde_json::from_value(json!({
        "metadata": {"name": ns, "labels": {"sluice.dev/e2e": "true"}}
    }))
    .expect("namespace object");
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .unwrap_or_else(|e| panic!("create namespace {ns}: {e}"));
    println!("cluster test {test} in namespace {ns}");
    let c = Cluster {
        client,
        ns,
        sandboxes: sandbox_namespace(),
        gateway,
    };
    c.wait_admission().await;
    Some(c)
}

/// A client of the gateway: at a ready pod behind `SLUICE_GATEWAY_SERVICE` (looked up again at each
/// call, so a client can follow a rolling update) or at `SLUICE_GATEWAY`.
async fn connect_gateway(client: &Client) -> Result<GatewayClient, String> {
    // A gateway installed with the chart's defaults speaks TLS and wants a caller: SLUICE_CA (its CA
    // bundle) and SLUICE_TOKEN (a token its caller policy admits to every namespace).
    let mut auth = ClientAuth {
        ca: std::env::var_os("SLUICE_CA").map(Into::into),
        token: std::env::var("SLUICE_TOKEN").ok(),
        ..Default::default()
    };
    let addr = match std::env::var("SLUICE_GATEWAY_SERVICE") {
        Ok(service) => {
            let (addr, server_name) = gateway_behind(client, &service).await;
            auth.server_name = Some(server_name);
            addr
        }
        Err(_) => {
            std::env::var("SLUICE_GATEWAY").unwrap_or_else(|_| "http://127.0.0.1:50051".into())
        }
    };
    auth.connect(&addr)
        .await
        .map_err(|e| format!("gateway at {addr} (SLUICE_GATEWAY) is reachable: {e}"))
}

/// The address of a ready gateway pod behind `<namespace>/<service>` (its EndpointSlices) and the
/// name its certificate carries (`<service>.<namespace>.svc`).
async fn gateway_behind(client: &Client, service: &str) -> (String, String) {
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    let (ns, name) = service.split_once('/').unwrap_or_else(|| {
        panic!("SLUICE_GATEWAY_SERVICE={service:?}: expected <namespace>/<service>")
    });
    let slices = Api::<EndpointSlice>::namespaced(client.clone(), ns);
    let addr = poll(
        Duration::from_secs(60),
        &format!("a ready endpoint of Service {service}"),
        || {
            let slices = slices.clone();
            async move {
                let list = slices
                    .list(
                        &ListParams::default()
                            .labels(&format!("kubernetes.io/service-name={name}")),
                    )
                    .await
                    .ok()?;
                list.items.iter().find_map(|slice| {
                    let port = slice
                        .ports
                        .as_ref()?
                        .iter()
                        .find(|p| p.name.as_deref() == Some("grpc"))?
                        .port?;
                    let ready = slice
                        .endpoints
                        .iter()
                        .find(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))?;
                    Some(format!("https://{}:{port}", ready.addresses.first()?))
                })
            }
        },
    )
    .await;
    (addr, format!("{name}.{ns}.svc"))
}

fn rand_suffix() -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    (nanos ^ std::process::id().rotate_left(11)) & 0xfffff
}

impl Drop for Cluster {
    /// The namespace (and with it every chain, pod and policy of the test) goes, pass or fail. Drop
    /// cannot await, so a thread with its own runtime and client does it.
    fn drop(&mut self) {
        let ns = self.ns.clone();
        let done = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                if let Ok(client) = Client::try_default().await {
                    let _ = Api::<Namespace>::all(client)
                        .delete(&ns, &DeleteParams::background())
                        .await;
                }
            })
        });
        let _ = done.join();
    }
}

impl Cluster {
    fn chains(&self) -> Api<HookChain> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// The namespace this test's sandbox pods live in.
    fn pod_ns(&self) -> &str {
        self.sandboxes.as_deref().unwrap_or(&self.ns)
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), self.pod_ns())
    }

    /// How the names of a chain's pods start (the operator's generateName).
    fn pod_prefix(&self, chain: &str) -> String {
        match &self.sandboxes {
            Some(_) => format!("{}-{chain}-", self.ns),
            None => format!("{chain}-"),
        }
    }

    /// The name of a chain's deny-all NetworkPolicy (it carries the chain's namespace in the
    /// sandbox namespace, which every tenant shares).
    fn policy_name(&self, chain: &str) -> String {
        match &self.sandboxes {
            Some(_) => format!("sluice-{}.{chain}-deny-all", self.ns),
            None => format!("sluice-{chain}-deny-all"),
        }
    }

    /// Waits until the release answers admission: a server-side dry run of a chain passes the
    /// webhook. A test before this one may have restarted the kubelet or the operator, and the
    /// webhook Service's endpoints follow a pod a while after it is ready again; a test starts on a
    /// cluster that serves, and fails here (naming why) if it never does.
    async fn wait_admission(&self) {
        let probe = json!({
            "apiVersion": "sluice.dev/v1alpha1",
            "kind": "HookChain",
            "metadata": {"name": "admission-probe", "namespace": self.ns},
            "spec": {
                "target": format!("{}-admission-probe", self.ns),
                "triggerPoint": "input",
                "hooks": [{"name": "upper", "action": "modify", "code": UPPER}],
            },
        });
        let mut last = String::new();
        let answered = tokio::time::timeout(Duration::from_secs(180), async {
            loop {
                match self
                    .chains()
                    .patch(
                        "admission-probe",
                        &PatchParams::apply("sluice-e2e").force().dry_run(),
                        &Patch::Apply(&probe),
                    )
                    .await
                {
                    Ok(_) => return,
                    Err(e) => last = e.to_string(),
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
        .await;
        assert!(
            answered.is_ok(),
            "the admission webhook answers a dry run within 180 s: {last}"
        );
    }

    /// Server-side applies a chain of `(name, action, code)` hooks.
    async fn apply_chain(
        &self,
        name: &str,
        target: &str,
        trigger_point: &str,
        extra_spec: Value,
        hooks: &[(&str, &str, &str)],
    ) -> HookChain {
        let mut spec = json!({
            "target": target,
            "triggerPoint": trigger_point,
            "pool": {"warm": 2, "max": 6},
            "hooks": hooks.iter().map(|(n, a, c)| json!({"name": n, "action": a, "code": c})).collect::<Vec<_>>(),
        });
        if let (Some(spec), Value::Object(extra)) = (spec.as_object_mut(), extra_spec) {
            spec.extend(extra);
        }
        let chain = json!({
            "apiVersion": "sluice.dev/v1alpha1",
            "kind": "HookChain",
            "metadata": {"name": name, "namespace": self.ns},
            "spec": spec,
        });
        self.chains()
            .patch(
                name,
                &PatchParams::apply("sluice-e2e").force(),
                &Patch::Apply(&chain),
            )
            .await
            .unwrap_or_else(|e| panic!("apply HookChain {name}: {e}"))
    }

    /// Waits until the chain's status reports PoolReady=True for its current generation and at least
    /// `spec.pool.warm` warm sandboxes.
    async fn wait_pool_ready(&self, name: &str) -> HookChain {
        let api = self.chains();
        let chain = poll(POOL_READY, &format!("HookChain {name} PoolReady"), || {
            let api = api.clone();
            async move {
                let hc = api.get(name).await.ok()?;
                let status = hc.status.as_ref()?;
                let ready = status
                    .conditions
                    .iter()
                    .any(|c| c.type_ == "PoolReady" && c.status == "True");
                let current = status.observed_generation == hc.metadata.generation;
                (ready && current && status.warm >= hc.spec.pool.warm).then_some(hc)
            }
        })
        .await;
        println!(
            "HookChain {name}: PoolReady, status {}",
            serde_json::to_string(&chain.status).unwrap_or_default()
        );
        chain
    }

    /// Applies a one-hook upper-casing chain, waits for its pool and until the gateway serves it.
    async fn serve_upper(&self, name: &str, target: &str) {
        self.apply_chain(
            name,
            target,
            "input",
            json!({}),
            &[("upper", "modify", UPPER)],
        )
        .await;
        self.wait_pool_ready(name).await;
        poll(
            Duration::from_secs(30),
            &format!("the gateway serves {name}"),
            || async { self.run(target, "warm").await.ok().map(|_| ()) },
        )
        .await;
    }

    /// The chain's pods whose `sluice.dev/pool` label is `pool`.
    async fn pool_pods(&self, chain: &str, pool: &str) -> Vec<Pod> {
        self.live_pods(chain, &format!(",sluice.dev/pool={pool}"))
            .await
    }

    /// The chain's pods not being deleted, narrowed by `more` (`,label=value...`, or empty).
    async fn live_pods(&self, chain: &str, more: &str) -> Vec<Pod> {
        self.pods()
            .list(&ListParams::default().labels(&format!(
                "sluice.dev/chain-namespace={},sluice.dev/chain={chain}{more}",
                self.ns
            )))
            .await
            .expect("list pods")
            .items
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .collect()
    }

    async fn run(&self, target: &str, text: &str) -> Result<proto::RunResponse, tonic::Status> {
        run_input(self.gateway.clone(), &self.ns, target, text).await
    }

    /// Streams `chunks` and returns (commits, final response).
    async fn stream(&self, target: &str, chunks: &[&str]) -> (Vec<String>, proto::RunResponse) {
        let mut msgs = vec![proto::StreamRequest {
            msg: Some(proto::stream_request::Msg::Open(proto::StreamOpen {
                namespace: self.ns.clone(),
                target: target.into(),
                trigger_point: "output".into(),
                context: Default::default(),
                session_id: "e2e".into(),
                chunk_by_chunk: false,
            })),
        }];
        msgs.extend(chunks.iter().map(|c| proto::StreamRequest {
            msg: Some(proto::stream_request::Msg::Chunk(c.to_string())),
        }));
        msgs.push(proto::StreamRequest {
            msg: Some(proto::stream_request::Msg::Finish(proto::StreamFinish {})),
        });
        let mut responses = self
            .gateway
            .clone()
            .stream(futures::stream::iter(msgs))
            .await
            .expect("stream opens")
            .into_inner();
        let (mut commits, mut last) = (Vec::new(), None);
        while let Some(msg) = responses.next().await {
            match msg.expect("stream message").msg {
                Some(proto::stream_response::Msg::Commit(c)) => commits.push(c),
                Some(proto::stream_response::Msg::Final(f)) => last = Some(f),
                Some(proto::stream_response::Msg::Blocked(b)) => panic!("unexpected block: {b:?}"),
                None => {}
            }
        }
        (commits, last.expect("a final response"))
    }
}

/// One `Gateway.Run` of `text` at the input trigger point of `target`.
async fn run_input(
    gateway: GatewayClient,
    ns: &str,
    target: &str,
    text: &str,
) -> Result<proto::RunResponse, tonic::Status> {
    run_in_session(gateway, ns, target, text, "e2e").await
}

/// One `Gateway.Run` of `text` at the input trigger point of `target`, in session `session`.
async fn run_in_session(
    mut gateway: GatewayClient,
    ns: &str,
    target: &str,
    text: &str,
    session: &str,
) -> Result<proto::RunResponse, tonic::Status> {
    let req = proto::RunRequest {
        namespace: ns.into(),
        target: target.into(),
        trigger_point: "input".into(),
        payload: Some(proto::run_request::Payload::Text(text.into())),
        context: Default::default(),
        session_id: session.into(),
    };
    gateway.run(req).await.map(|r| r.into_inner())
}

/// Calls `check` every half second until it gives a value; panics naming `what` past `limit`.
async fn poll<T, F, Fut>(limit: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not reached within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn action(r: &proto::RunResponse) -> Action {
    Action::try_from(r.action).expect("known action")
}

fn text(r: &proto::RunResponse) -> &str {
    match &r.payload {
        Some(proto::run_response::Payload::Text(t)) => t,
        other => panic!("expected a text payload, got {other:?}"),
    }
}

fn names(pods: &[Pod]) -> BTreeSet<String> {
    pods.iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn applied_chain_gets_a_warm_gvisor_pool_and_serves_run() {
    let Some(c) = cluster("run").await else {
        return;
    };
    // reuse: None, so that the pod that served the run is the one deleted after it.
    c.apply_chain(
        "shout",
        "support-bot",
        "input",
        json!({"pool": {"warm": 2, "max": 6, "reuse": "None"}}),
        &[("upper", "modify", UPPER)],
    )
    .await;
    let chain = c.wait_pool_ready("shout").await;

    // The pool is what the contract says: hardened gVisor pods of the chain (owned by it beside it,
    // labelled with its namespace and uid in the sandbox namespace), and a deny-all policy.
    // The gateway may claim a warm pod to hold (--kube-hold) right after PoolReady; the operator
    // then creates another, so the pool is back to two warm pods a moment later.
    let warm = poll(POOL_READY, "two warm pods", || async {
        let warm = c.pool_pods("shout", "warm").await;
        (warm.len() >= 2).then_some(warm)
    })
    .await;
    for pod in &warm {
        let labels = pod.metadata.labels.clone().unwrap_or_default();
        assert_eq!(
            labels.get("app.kubernetes.io/name").map(String::as_str),
            Some("sluice-sandbox")
        );
        assert!(labels.contains_key("sluice.dev/template"));
        assert_eq!(
            labels.get("sluice.dev/chain-uid").map(String::as_str),
            chain.metadata.uid.as_deref()
        );
        if c.sandboxes.is_some() {
            assert!(
                pod.metadata.owner_references.is_none(),
                "no owner reference across namespaces"
            );
        } else {
            let owner = &pod.metadata.owner_references.as_ref().expect("owner")[0];
            assert_eq!(
                (owner.kind.as_str(), owner.controller),
                ("HookChain", Some(true))
            );
            assert_eq!(Some(owner.uid.as_str()), chain.metadata.uid.as_deref());
        }
        assert_eq!(
            pod.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get("cluster-autoscaler.kubernetes.io/safe-to-evict"))
                .map(String::as_str),
            Some("true"),
            "a warm pod may go with its node"
        );
        let spec = pod.spec.as_ref().expect("pod spec");
        assert_eq!(spec.runtime_class_name.as_deref(), Some(RUNTIME_CLASS));
        assert_eq!(spec.automount_service_account_token, Some(false));
        assert_eq!(spec.containers[0].name, "supervisor");
    }
    let policy = Api::<NetworkPolicy>::namespaced(c.client.clone(), c.pod_ns())
        .get(&c.policy_name("shout"))
        .await
        .expect("the chain's deny-all NetworkPolicy");
    let policy = policy.spec.expect("policy spec");
    assert!(
        policy.ingress.unwrap_or_default().is_empty()
            && policy.egress.unwrap_or_default().is_empty()
    );

    // Every pod of the chain before the run: the gateway may hold some claimed already (--kube-hold).
    let before: BTreeSet<String> = names(&c.pool_pods("shout", "warm").await)
        .union(&names(&c.pool_pods("shout", "claimed").await))
        .cloned()
        .collect();
    // PoolReady is the operator's word; the gateway serves the chain once its own watch has it
    // (and its hook code checked): under load that can come a moment later.
    let r = poll(
        Duration::from_secs(30),
        "the gateway serves the chain",
        || async {
            match c.run("support-bot", "hello cluster").await {
                Err(s) if s.code() == tonic::Code::NotFound => None,
                r => Some(r),
            }
        },
    )
    .await
    .expect("Run");
    // Claimed pods are not the autoscaler's to evict.
    for pod in c.pool_pods("shout", "claimed").await {
        assert_eq!(
            pod.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get("cluster-autoscaler.kubernetes.io/safe-to-evict"))
                .map(String::as_str),
            Some("false"),
            "claimed pod {:?}",
            pod.metadata.name
        );
    }
    assert_eq!(action(&r), Action::Modify);
    assert_eq!(text(&r), "HELLO CLUSTER");
    assert_eq!(r.hooks.len(), 1);
    assert_eq!(r.hooks[0].name, "upper");

    // With reuse: None a sandbox serves one trigger point: the pod that served the run is deleted
    // after it, and the pool refills.
    poll(
        Duration::from_secs(60),
        "the used sandbox pod is deleted",
        || async {
            let now: BTreeSet<String> = names(&c.pool_pods("shout", "warm").await)
                .union(&names(&c.pool_pods("shout", "claimed").await))
                .cloned()
                .collect();
            (!before.is_subset(&now)).then_some(())
        },
    )
    .await;
    c.wait_pool_ready("shout").await;
    let unknown = c.run("no-such-target", "x").await.expect_err("no chain");
    assert_eq!(unknown.code(), tonic::Code::NotFound);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_commits_only_redacted_text() {
    let Some(c) = cluster("stream").await else {
        return;
    };
    c.apply_chain(
        "digits",
        "writer",
        "output",
        json!({"streaming": {"flushChars": 8, "lookbackChars": 4}}),
        &[("digits", "modify", DIGITS)],
    )
    .await;
    c.wait_pool_ready("digits").await;
    let (commits, last) = c
        .stream(
            "writer",
            &["my pin", " is 12", "34 and 5", "678, ok", "ay?"],
        )
        .await;
    assert_eq!(action(&last), Action::Modify);
    assert_eq!(text(&last), "my pin is #### and ####, okay?");
    let shown = commits.concat();
    assert!(
        !shown.chars().any(|ch| ch.is_ascii_digit()),
        "a digit was committed: {shown:?}"
    );
    assert_eq!(
        shown,
        text(&last),
        "deterministic redaction: the commits add up to the final text"
    );
}

/// A sandbox pod deleted while its hook runs: Closed blocks with the hook's error; Open carries on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_killed_mid_run_follows_the_failure_policy() {
    let Some(c) = cluster("kill").await else {
        return;
    };
    c.apply_chain(
        "strict",
        "strict-bot",
        "input",
        json!({"failurePolicy": "Closed", "timeoutMs": 60000}),
        &[("slow", "detect", SLOW)],
    )
    .await;
    c.apply_chain(
        "lenient",
        "lenient-bot",
        "input",
        json!({"failurePolicy": "Open", "timeoutMs": 60000}),
        &[("slow", "detect", SLOW), ("upper", "modify", UPPER)],
    )
    .await;
    c.wait_pool_ready("strict").await;
    c.wait_pool_ready("lenient").await;

    for (chain, target) in [("strict", "strict-bot"), ("lenient", "lenient-bot")] {
        let run = tokio::spawn({
            let (gateway, ns) = (c.gateway.clone(), c.ns.clone());
            async move { run_input(gateway, &ns, target, "still here").await }
        });
        poll(
            Duration::from_secs(60),
            &format!("a claimed pod of {chain}"),
            || async { c.pool_pods(chain, "claimed").await.into_iter().next() },
        )
        .await;
        // The hook sleeps 20 s: a few seconds after the claim it is running (or still loading; either
        // way the sandbox dies under it). Every claimed pod of the chain goes, the running one among
        // them (gateways may also hold pods claimed ahead, which are simply replaced).
        tokio::time::sleep(Duration::from_secs(3)).await;
        for claimed in c.pool_pods(chain, "claimed").await {
            let pod = claimed.metadata.name.expect("pod name");
            println!("{chain}: deleting claimed pod {pod} mid-run");
            c.pods()
                .delete(
                    &pod,
                    &DeleteParams {
                        grace_period_seconds: Some(0),
                        ..Default::default()
                    },
                )
                .await
                .expect("delete the claimed pod");
        }
        let r = run
            .await
            .expect("run task")
            .expect("Run answers (the failure policy decides, not a transport error)");
        println!("{chain}: {r:?}");
        if chain == "strict" {
            assert_eq!(action(&r), Action::Block);
            assert_eq!(r.terminal_index, Some(0));
            assert!(
                !r.hooks[0].error.is_empty(),
                "the killed hook's error is reported"
            );
        } else {
            assert_eq!(
                action(&r),
                Action::Modify,
                "Open passes the payload on to the next hook"
            );
            assert_eq!(text(&r), "STILL HERE");
        }
    }
}

/// New hook code reaches the next Run without replacing the warm pods: code is sent at init, so the
/// pod template (and its hash) does not change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_code_rolls_out_without_new_pods() {
    let Some(c) = cluster("rollout").await else {
        return;
    };
    c.apply_chain(
        "case",
        "case-bot",
        "input",
        json!({"pool": {"warm": 3, "max": 8}}),
        &[("case", "modify", UPPER)],
    )
    .await;
    let before = c.wait_pool_ready("case").await;
    let r = c.run("case-bot", "Mixed Case").await.expect("Run v1");
    assert_eq!(text(&r), "MIXED CASE");
    let v1 = c.wait_pool_ready("case").await;
    let warm_v1 = c.pool_pods("case", "warm").await;
    let templates: BTreeSet<String> = warm_v1
        .iter()
        .filter_map(|p| {
            p.metadata
                .labels
                .as_ref()?
                .get("sluice.dev/template")
                .cloned()
        })
        .collect();
    assert_eq!(templates.len(), 1, "one pod template: {templates:?}");

    c.apply_chain(
        "case",
        "case-bot",
        "input",
        json!({"pool": {"warm": 3, "max": 8}}),
        &[("case", "modify", LOWER)],
    )
    .await;
    let v2 = c.wait_pool_ready("case").await;
    assert!(v2.metadata.generation > v1.metadata.generation);
    assert_ne!(
        v2.status.as_ref().and_then(|s| s.code_hash.clone()),
        before.status.as_ref().and_then(|s| s.code_hash.clone())
    );
    // No pod was replaced for the new code.
    let now = names(&c.pool_pods("case", "warm").await);
    assert!(
        names(&warm_v1).is_subset(&now),
        "warm pods before {:?}, after {now:?}",
        names(&warm_v1)
    );

    // The gateway's cache follows the watch; once it has the new generation every Run is lower-case.
    let r = poll(Duration::from_secs(30), "Run with the new code", || async {
        let r = c.run("case-bot", "Mixed Case").await.ok()?;
        (text(&r) == "mixed case").then_some(r)
    })
    .await;
    assert_eq!(action(&r), Action::Modify);
    for _ in 0..3 {
        let r = c.run("case-bot", "Mixed Case").await.expect("Run v2");
        assert_eq!(
            text(&r),
            "mixed case",
            "an old-code answer after the new one was seen"
        );
    }
    let after: BTreeSet<String> = c
        .pool_pods("case", "warm")
        .await
        .iter()
        .filter_map(|p| {
            p.metadata
                .labels
                .as_ref()?
                .get("sluice.dev/template")
                .cloned()
        })
        .collect();
    assert_eq!(after, templates, "the new code needed no new pod template");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recycled_pods_serve_many_trigger_points_and_retire_at_max_uses() {
    let Some(c) = cluster("recycle").await else {
        return;
    };
    c.apply_chain(
        "recycle",
        "recycle-bot",
        "input",
        json!({"pool": {"warm": 2, "max": 4, "reuse": "Recycle", "maxUses": 5}}),
        &[("upper", "modify", UPPER)],
    )
    .await;
    c.wait_pool_ready("recycle").await;
    let mut seen = BTreeSet::new();
    for i in 0..12 {
        // Paced by the pool, not the clock: back to back, two pods' five uses are spent in about a
        // second, and a replacement takes 3 to 4 s from creation to Ready on this node; a run that
        // finds every pod used up waits only its start deadline and is refused (the pool is
        // exhausted, which is not what this test is about). So each run waits for a warm pod the
        // gateway can claim when the one it holds retires.
        poll(Duration::from_secs(60), "a Ready warm pod", || async {
            any_ready(&c.pool_pods("recycle", "warm").await).then_some(())
        })
        .await;
        let r = c
            .run("recycle-bot", &format!("trigger point {i}"))
            .await
            .expect("Run");
        assert_eq!(text(&r), format!("TRIGGER POINT {i}"));
        seen.extend(names(&c.pool_pods("recycle", "claimed").await));
    }
    // 12 trigger points at 5 uses a pod: a few pods served them, not 12; the retired ones were
    // deleted and the pool kept serving without a failed run (each run above succeeded).
    assert!(
        !seen.is_empty() && seen.len() < 12,
        "pods that served: {seen:?}"
    );
    // An attached pod is not probed: none of the chain's pods reports a failing probe.
    let events = Api::<k8s_openapi::api::core::v1::Event>::namespaced(c.client.clone(), c.pod_ns())
        .list(&Default::default())
        .await
        .expect("events");
    let unhealthy: Vec<_> = events
        .items
        .iter()
        .filter(|e| e.reason.as_deref() == Some("Unhealthy"))
        .filter(|e| {
            e.involved_object
                .name
                .as_deref()
                .is_some_and(|n| n.starts_with(&c.pod_prefix("recycle")))
        })
        .collect();
    assert!(unhealthy.is_empty(), "probe failures: {unhealthy:?}");
}

#[tokio::test]
async fn the_admission_webhook_refuses_broken_chains_at_apply() {
    let Some(c) = cluster("webhook").await else {
        return;
    };
    // Installed with `--set webhook.enabled=true` (e2e/cluster/README.md, step 3b), or not at all.
    use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
    let configs = Api::<ValidatingWebhookConfiguration>::all(c.client.clone())
        .list(&ListParams::default().labels("app.kubernetes.io/part-of=sluice"))
        .await
        .expect("list ValidatingWebhookConfigurations");
    if configs.items.is_empty() {
        skip("the chart was installed without webhook.enabled=true (webhook)");
        return;
    }
    let chain = |code: &str| {
        json!({
            "apiVersion": "sluice.dev/v1alpha1",
            "kind": "HookChain",
            "metadata": {"name": "guarded", "namespace": c.ns},
            "spec": {"target": "guarded-bot", "triggerPoint": "input",
                     "hooks": [{"name": "upper", "action": "modify", "code": code}]},
        })
    };
    let apply = |object: Value| {
        let chains = c.chains();
        async move {
            chains
                .patch(
                    "guarded",
                    &PatchParams::apply("sluice-e2e").force(),
                    &Patch::Apply(&object),
                )
                .await
        }
    };
    let broken =
        "def execute(context, settings):\n    return {'action': 'block', 'message': 'no'\n";
    let err = apply(chain(broken))
        .await
        .expect_err("a chain with a syntax error is refused");
    let said = err.to_string();
    assert!(
        said.contains("denied the request")
            && said
                .contains("HookChain \"guarded\", hook \"upper\", line 2 of its code: SyntaxError"),
        "{said}"
    );
    assert!(
        c.chains().get_opt("guarded").await.expect("get").is_none(),
        "nothing was stored"
    );
    apply(chain(UPPER))
        .await
        .expect("a valid chain is admitted");

    // Ready hooks: one named by `uses` is admitted; code and uses together are refused by the API
    // server's own rule (the CRD's CEL), an unknown name by the webhook, with the library's names.
    let ready = |hook: Value| {
        json!({
            "apiVersion": "sluice.dev/v1alpha1",
            "kind": "HookChain",
            "metadata": {"name": "guarded", "namespace": c.ns},
            "spec": {"target": "guarded-bot", "triggerPoint": "input", "hooks": [hook]},
        })
    };
    let both = apply(ready(
        json!({"name": "iban", "action": "modify", "uses": "pii/iban", "code": UPPER}),
    ))
    .await
    .expect_err("code and uses together are refused");
    assert!(
        both.to_string()
            .contains("a hook has code of its own or uses a ready hook, one of the two"),
        "{both}"
    );
    let unknown = apply(ready(
        json!({"name": "iban", "action": "modify", "uses": "pii/ibna"}),
    ))
    .await
    .expect_err("an unknown ready hook is refused");
    assert!(
        unknown
            .to_string()
            .contains("\"pii/ibna\" is no ready hook: did you mean pii/iban?"),
        "{unknown}"
    );
    let admitted = apply(ready(json!({"name": "iban", "action": "modify", "uses": "pii/iban", "settings": {"mask": "[IBAN]"}})))
        .await
        .expect("a chain of a ready hook is admitted");
    assert_eq!(admitted.spec.hooks[0].uses.as_deref(), Some("pii/iban"));
    assert!(
        admitted.spec.hooks[0]
            .code
            .contains("DECLARED_ACTION = \"modify\"")
    );
}

/// Deleting a chain deletes its pods and its NetworkPolicy wherever they live (the operator's
/// finalizer: owner references do not reach the sandbox namespace), and then the chain goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_chain_deletes_its_pods_and_policy() {
    let Some(c) = cluster("finalizer").await else {
        return;
    };
    c.apply_chain(
        "gone",
        "support-bot",
        "input",
        json!({"pool": {"warm": 2, "max": 4}}),
        &[("upper", "modify", UPPER)],
    )
    .await;
    let chain = c.wait_pool_ready("gone").await;
    assert!(
        chain
            .metadata
            .finalizers
            .as_ref()
            .is_some_and(|f| f.iter().any(|f| f == "sluice.dev/sandboxes")),
        "the operator's finalizer: {:?}",
        chain.metadata.finalizers
    );
    c.chains()
        .delete("gone", &DeleteParams::default())
        .await
        .expect("delete the chain");
    poll(
        Duration::from_secs(60),
        "the chain, its pods and its policy are gone",
        || async {
            let chain_gone = c.chains().get_opt("gone").await.expect("get").is_none();
            let pods = c.pool_pods("gone", "warm").await.len()
                + c.pool_pods("gone", "claimed").await.len();
            let policy = Api::<NetworkPolicy>::namespaced(c.client.clone(), c.pod_ns())
                .get_opt(&c.policy_name("gone"))
                .await
                .expect("get policy");
            (chain_gone && pods == 0 && policy.is_none()).then_some(())
        },
    )
    .await;
}

// === what only a real cluster shows ===

/// The namespace the chart was installed in (`SLUICE_RELEASE_NAMESPACE`, default `sluice-system`).
fn release_namespace() -> String {
    std::env::var("SLUICE_RELEASE_NAMESPACE").unwrap_or_else(|_| "sluice-system".into())
}

/// Runs `$SLUICE_CLUSTER_CTL <args>` (`e2e/cluster/cluster.sh`: `restart kubelet`, ...), the
/// cluster's own control script. `None` when the cluster offers none (a skip, or with
/// `SLUICE_CLUSTER_REQUIRED=1` a failure).
fn cluster_ctl(args: &[&str]) -> Option<()> {
    let Some(ctl) = std::env::var_os("SLUICE_CLUSTER_CTL") else {
        skip(&format!(
            "SLUICE_CLUSTER_CTL is not set: this cluster cannot be told to {}",
            args.join(" ")
        ));
        return None;
    };
    let out = std::process::Command::new(&ctl)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {ctl:?} {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{ctl:?} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(())
}

/// True if any of `pods` is Ready (what the gateway needs to claim it).
fn any_ready(pods: &[Pod]) -> bool {
    pods.iter().any(|p| {
        p.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
    })
}

/// `Unhealthy` events (failed probes) of a chain's pods.
async fn probe_failures(c: &Cluster, chain: &str) -> Vec<String> {
    let events = Api::<k8s_openapi::api::core::v1::Event>::namespaced(c.client.clone(), c.pod_ns())
        .list(&Default::default())
        .await
        .expect("events");
    events
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("Unhealthy"))
        .filter(|e| {
            e.involved_object
                .name
                .as_deref()
                .is_some_and(|n| n.starts_with(&c.pod_prefix(chain)))
        })
        .map(|e| {
            format!(
                "{}: {}",
                e.involved_object.name.unwrap_or_default(),
                e.message.unwrap_or_default()
            )
        })
        .collect()
}

/// Waits until the chain settles: no more claimed pods than one gateway holds plus none in flight,
/// and no more pods than `max` (nothing leaked by a restart).
async fn wait_no_leak(c: &Cluster, chain: &str, max: usize) {
    let limit = Duration::from_secs(120);
    let deadline = Instant::now() + limit;
    // Each gateway holds one pod of the chain (the chart's holdPerChain), no more.
    let gateways = Api::<Pod>::namespaced(c.client.clone(), &release_namespace())
        .list(&ListParams::default().labels("app.kubernetes.io/component=gateway"))
        .await
        .expect("list the gateways")
        .items
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .count()
        .max(1);
    loop {
        let pods = c.live_pods(chain, "").await;
        let claimed = pods
            .iter()
            .filter(|p| pool_of(p) == sandbox_pod::POOL_CLAIMED)
            .count();
        if claimed <= gateways && pods.len() <= max {
            return;
        }
        // What was left, so that a failure says which pod outlived what.
        let seen: Vec<String> = pods.iter().map(describe_pod).collect();
        assert!(
            Instant::now() < deadline,
            "{chain}: not at most one held pod per gateway ({gateways}) and {max} pods in all within {limit:?}: {seen:#?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A pod's `sluice.dev/pool` label.
fn pool_of(pod: &Pod) -> &str {
    pod.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(sandbox_pod::LABEL_POOL))
        .map_or("", String::as_str)
}

/// One line on a pod for a failure message: name, pool, phase, its container's state, who holds it.
fn describe_pod(pod: &Pod) -> String {
    let status = pod.status.as_ref();
    let container = status
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.first())
        .and_then(|c| c.state.as_ref())
        .map_or("no container status".to_string(), |s| {
            if s.running.is_some() {
                "running".into()
            } else if let Some(t) = &s.terminated {
                format!("terminated ({})", t.reason.as_deref().unwrap_or("?"))
            } else {
                "waiting".into()
            }
        });
    let annotation = |k: &str| {
        pod.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(k))
            .map_or("-", String::as_str)
    };
    format!(
        "{} pool={} phase={} container={} claimed-by={} claimed-at={} created={}",
        pod.metadata.name.as_deref().unwrap_or("?"),
        pool_of(pod),
        status.and_then(|s| s.phase.as_deref()).unwrap_or("?"),
        container,
        annotation(sandbox_pod::ANNOTATION_CLAIMED_BY),
        annotation(sandbox_pod::ANNOTATION_CLAIMED_AT),
        pod.metadata
            .creation_timestamp
            .as_ref()
            .map_or("?".to_string(), |t| t.0.to_string()),
    )
}

/// The certificates the operator makes (the chart's default TLS, issue 29), under a real API server
/// and RBAC authorizer: a serving certificate in the last third of its life is made again, a deleted
/// one comes back, and a webhook caBundle someone replaced is put back. Through all of it the API
/// server keeps calling the webhook over TLS it trusts (a broken chain is refused by the webhook,
/// not by a failed call), and the gateway keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_made_by_the_operator_are_renewed_and_put_back() {
    use k8s_openapi::ByteString;
    use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
    use k8s_openapi::api::core::v1::{ConfigMap, Secret};
    use sluice_operator::certs::authority::{self, KeyedCert};
    let Some(c) = cluster("certs").await else {
        return;
    };
    let release = release_namespace();
    let secrets = Api::<Secret>::namespaced(c.client.clone(), &release);
    let pair = |s: &Secret| {
        let data = s.data.as_ref().expect("a Secret with data");
        let text = |k: &str| String::from_utf8(data[k].0.clone()).expect("PEM text");
        KeyedCert {
            cert: text("tls.crt"),
            key: text("tls.key"),
        }
    };
    let ca = pair(
        &secrets
            .get("sluice-ca")
            .await
            .expect("the operator's CA Secret"),
    );
    let bundle = || async {
        let cm = Api::<ConfigMap>::namespaced(c.client.clone(), &release)
            .get("sluice-ca")
            .await
            .expect("the CA bundle's ConfigMap");
        cm.data.expect("data")["ca.crt"].clone()
    };
    assert!(
        bundle().await.contains(&ca.cert),
        "the published bundle holds the CA"
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64;
    let webhook_dns = vec![
        format!("sluice-operator-webhook.{release}.svc"),
        format!("sluice-operator-webhook.{release}.svc.cluster.local"),
    ];
    let refused_by_the_webhook = || async {
        let broken = json!({
            "apiVersion": "sluice.dev/v1alpha1", "kind": "HookChain",
            "metadata": {"name": "broken", "namespace": c.ns},
            "spec": {"target": "t", "triggerPoint": "input",
                     "hooks": [{"name": "h", "action": "modify", "code": "def execute(:\n"}]},
        });
        let err = c
            .chains()
            .patch(
                "broken",
                &PatchParams::apply("sluice-e2e"),
                &Patch::Apply(&broken),
            )
            .await
            .expect_err("a chain that does not compile is refused");
        err.to_string()
    };

    // 1. The webhook's certificate, replaced by one of the same CA with an hour of its four left.
    let nearly_over = authority::make_leaf(
        &ca,
        &webhook_dns,
        Duration::from_secs(4 * 3600),
        now - 3 * 3600,
    )
    .expect("make a certificate");
    let data = |p: &KeyedCert| {
        json!({"data": {
            "tls.crt": ByteString(p.cert.clone().into_bytes()),
            "tls.key": ByteString(p.key.clone().into_bytes()),
        }})
    };
    secrets
        .patch(
            "sluice-operator-webhook-tls",
            &PatchParams::default(),
            &Patch::Merge(data(&nearly_over)),
        )
        .await
        .expect("put an expiring certificate in place");
    let renewed = poll(
        Duration::from_secs(90),
        "the expiring webhook certificate is made again",
        || async {
            let now_pair = pair(&secrets.get("sluice-operator-webhook-tls").await.ok()?);
            (now_pair.cert != nearly_over.cert).then_some(now_pair)
        },
    )
    .await;
    assert_eq!(
        authority::leaf_renewal(Some(&renewed), &bundle().await, &webhook_dns, now),
        None,
        "the new certificate is sound: the CA's, for the webhook's names, with its life ahead"
    );
    let said = refused_by_the_webhook().await;
    assert!(
        said.contains("denied the request") && said.contains("SyntaxError"),
        "{said}"
    );

    // 2. The gateway's Secret deleted: made again, and the gateway still serves (a run needs no pool
    // of this test's; NOT_FOUND comes from the gateway after a TLS handshake the suite's CA trusts).
    secrets
        .delete("sluice-gateway-tls", &DeleteParams::default())
        .await
        .expect("delete the gateway's Secret");
    let gateway_dns = vec![
        "sluice-gateway".to_string(),
        format!("sluice-gateway.{release}"),
        format!("sluice-gateway.{release}.svc"),
        format!("sluice-gateway.{release}.svc.cluster.local"),
    ];
    let remade = poll(
        Duration::from_secs(90),
        "the gateway's Secret is made again",
        || async { Some(pair(&secrets.get_opt("sluice-gateway-tls").await.ok()??)) },
    )
    .await;
    assert_eq!(
        authority::leaf_renewal(Some(&remade), &bundle().await, &gateway_dns, now),
        None
    );
    let answer = run_input(c.gateway.clone(), &c.ns, "nobody", "hi").await;
    assert_eq!(
        answer.expect_err("no chain here").code(),
        tonic::Code::NotFound,
        "the gateway answers over TLS"
    );

    // 3. The webhook's caBundle replaced by another CA's: the API server cannot trust the webhook
    // until the operator puts its bundle back.
    let configs = Api::<ValidatingWebhookConfiguration>::all(c.client.clone());
    let name = format!("sluice-validate-{release}");
    let stranger =
        authority::make_ca("stranger", Duration::from_secs(86_400), now).expect("make a CA");
    let mut config = configs.get(&name).await.expect("the webhook configuration");
    for hook in config.webhooks.iter_mut().flatten() {
        hook.client_config.ca_bundle = Some(ByteString(stranger.cert.clone().into_bytes()));
    }
    configs
        .replace(&name, &PostParams::default(), &config)
        .await
        .expect("replace the caBundle");
    poll(
        Duration::from_secs(60),
        "the operator puts the caBundle back",
        || async {
            let config = configs.get(&name).await.ok()?;
            let hooks = config.webhooks?;
            let ours = ByteString(bundle().await.into_bytes());
            hooks
                .iter()
                .all(|h| h.client_config.ca_bundle.as_ref() == Some(&ours))
                .then_some(())
        },
    )
    .await;
    let said = refused_by_the_webhook().await;
    assert!(
        said.contains("denied the request") && said.contains("SyntaxError"),
        "{said}"
    );
}

/// The suite's release keeps every chain but another release's (install.sh: `chainSelector:
/// sluice.dev/release!=other`): a chain labelled for the other release gets no pods, no finalizer
/// and no status from this operator, this gateway does not serve it, and this webhook does not
/// judge it, while an unlabelled chain beside it is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_releases_chains_are_left_alone() {
    let Some(c) = cluster("selector").await else {
        return;
    };
    let labelled = |name: &str, code: &str| {
        json!({
            "apiVersion": "sluice.dev/v1alpha1", "kind": "HookChain",
            "metadata": {"name": name, "namespace": c.ns, "labels": {"sluice.dev/release": "other"}},
            "spec": {"target": format!("{name}-bot"), "triggerPoint": "input", "pool": {"warm": 1},
                     "hooks": [{"name": "upper", "action": "modify", "code": code}]},
        })
    };
    let chains = c.chains();
    let apply = |object: Value| {
        let chains = chains.clone();
        async move {
            let name = object["metadata"]["name"]
                .as_str()
                .expect("a name")
                .to_string();
            chains
                .patch(
                    &name,
                    &PatchParams::apply("sluice-e2e"),
                    &Patch::Apply(&object),
                )
                .await
        }
    };
    // Not this webhook's to judge: code that does not compile is admitted.
    apply(labelled("broken", "def execute(:\n"))
        .await
        .expect("another release's chain is not judged by this release's webhook");
    apply(labelled("theirs", UPPER)).await.expect("apply");
    c.serve_upper("ours", "ours-bot").await;
    let theirs = c.chains().get("theirs").await.expect("get");
    assert!(
        theirs
            .metadata
            .finalizers
            .as_deref()
            .unwrap_or_default()
            .is_empty()
            && theirs.status.is_none(),
        "this operator left another release's chain alone: {:?} {:?}",
        theirs.metadata.finalizers,
        theirs.status
    );
    assert!(c.live_pods("theirs", "").await.is_empty(), "no pods for it");
    let answer = c.run("theirs-bot", "hi").await;
    assert_eq!(
        answer.expect_err("not served here").code(),
        tonic::Code::NotFound
    );
}

/// A `kubectl apply` that changes only metadata never waits on the webhook: with the operator (and
/// its webhook) gone and `failurePolicy: Fail`, a spec change is refused but a label is not. Without
/// the chart's matchConditions the label (and the operator's own finalizer update) fails too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_only_updates_do_not_wait_for_the_webhook() {
    use k8s_openapi::api::apps::v1::Deployment;
    let Some(c) = cluster("matchconditions").await else {
        return;
    };
    c.apply_chain(
        "labelled",
        "label-bot",
        "input",
        json!({}),
        &[("upper", "modify", UPPER)],
    )
    .await;
    let deployments = Api::<Deployment>::namespaced(c.client.clone(), &release_namespace());
    let scale = |replicas: i32| {
        let deployments = deployments.clone();
        async move {
            deployments
                .patch(
                    "sluice-operator",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"replicas": replicas}})),
                )
                .await
                .expect("scale the operator")
        }
    };
    // The replicas it runs with (the production shape: two), put back at the end.
    let replicas = deployments
        .get("sluice-operator")
        .await
        .expect("the operator's Deployment")
        .spec
        .and_then(|s| s.replicas)
        .unwrap_or(1);
    scale(0).await;
    poll(
        Duration::from_secs(120),
        "the operator's pods are gone",
        || async {
            let pods = Api::<Pod>::namespaced(c.client.clone(), &release_namespace())
                .list(&ListParams::default().labels("app.kubernetes.io/component=operator"))
                .await
                .ok()?;
            pods.items.is_empty().then_some(())
        },
    )
    .await;
    let label = c
        .chains()
        .patch(
            "labelled",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"team": "e2e"}}})),
        )
        .await;
    let spec = c
        .chains()
        .patch(
            "labelled",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"timeoutMs": 3000}})),
        )
        .await;
    scale(replicas).await;
    poll(Duration::from_secs(180), "the operator is back", || async {
        let d = deployments.get("sluice-operator").await.ok()?;
        (d.status?.available_replicas? >= replicas).then_some(())
    })
    .await;
    // The cluster goes back as it was found: the API server reaches the webhook through the
    // Service's endpoints, which follow the new pod a while after the Deployment counts it, and
    // the next test's apply must not meet a webhook still coming back.
    poll(
        Duration::from_secs(120),
        "the webhook answers again",
        || async {
            let dry_run = PatchParams {
                dry_run: true,
                ..Default::default()
            };
            c.chains()
                .patch(
                    "labelled",
                    &dry_run,
                    &Patch::Merge(json!({"spec": {"timeoutMs": 3000}})),
                )
                .await
                .ok()
                .map(|_| ())
        },
    )
    .await;
    let refused = spec.expect_err("with no webhook answering, a spec change is refused");
    assert!(
        refused.to_string().contains("failed calling webhook"),
        "{refused}"
    );
    label.expect("a label change does not need the webhook");
}

/// Pod Security `restricted` is enforced on the sandbox namespace and admits the operator's
/// sandbox pods: a server-side dry run of a warm pod passes, the same pod made privileged fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_security_restricted_admits_sandbox_pods() {
    let Some(c) = cluster("psa").await else {
        return;
    };
    let ns = Api::<Namespace>::all(c.client.clone())
        .get(c.pod_ns())
        .await
        .expect("the sandbox namespace");
    assert_eq!(
        ns.metadata
            .labels
            .unwrap_or_default()
            .get("pod-security.kubernetes.io/enforce")
            .map(String::as_str),
        Some("restricted")
    );
    c.apply_chain(
        "psa",
        "psa-bot",
        "input",
        json!({}),
        &[("upper", "modify", UPPER)],
    )
    .await;
    c.wait_pool_ready("psa").await;
    let warm = c.pool_pods("psa", "warm").await;
    let pod = warm.first().expect("a warm pod").clone();
    let copy = |privileged: bool| {
        let mut p = pod.clone();
        p.metadata = kube::api::ObjectMeta {
            generate_name: Some("psa-check-".into()),
            namespace: pod.metadata.namespace.clone(),
            ..Default::default()
        };
        if let Some(spec) = p.spec.as_mut() {
            spec.node_name = None;
            if privileged {
                let sc = spec.containers[0].security_context.get_or_insert_default();
                sc.run_as_non_root = Some(false);
                sc.run_as_user = Some(0);
                sc.allow_privilege_escalation = Some(true);
            }
        }
        p.status = None;
        p
    };
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    c.pods()
        .create(&dry, &copy(false))
        .await
        .expect("PSA restricted admits a sandbox pod");
    let err = c
        .pods()
        .create(&dry, &copy(true))
        .await
        .expect_err("PSA restricted refuses a root, escalating pod");
    assert!(err.to_string().contains("violates PodSecurity"), "{err}");
}

/// Each component's ServiceAccount may do exactly what `deploy/tests/rbac_required.yaml` lists,
/// where it lists it, as the real authorizer decides (SubjectAccessReview, what `kubectl auth
/// can-i --as` asks): every listed verb is allowed, every other verb on those resources is denied,
/// and neither may read Secrets or exec outside the sandbox namespace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_accounts_can_do_what_they_need_and_nothing_more() {
    use k8s_openapi::api::authorization::v1::SubjectAccessReview;
    let Some(c) = cluster("rbac").await else {
        return;
    };
    let release = release_namespace();
    let required: Value = serde_saphyr::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../deploy/tests/rbac_required.yaml"
        ))
        .expect("read deploy/tests/rbac_required.yaml"),
    )
    .expect("parse rbac_required.yaml");
    let reviews = Api::<SubjectAccessReview>::all(c.client.clone());
    let can = |sa: String, ns: String, group: String, resource: String, verb: String| {
        let reviews = reviews.clone();
        let release = release.clone();
        async move {
            let (resource, subresource) = match resource.split_once('/') {
                Some((r, s)) => (r.to_string(), Some(s.to_string())),
                None => (resource, None),
            };
            let review: SubjectAccessReview = serde_json::from_value(json!({
                "spec": {
                    "user": format!("system:serviceaccount:{release}:{sa}"),
                    "groups": ["system:serviceaccounts", format!("system:serviceaccounts:{release}"), "system:authenticated"],
                    "resourceAttributes": {"namespace": ns, "group": group, "resource": resource,
                                           "subresource": subresource, "verb": verb},
                }
            }))
            .expect("review");
            reviews
                .create(&PostParams::default(), &review)
                .await
                .expect("create SubjectAccessReview")
                .status
                .is_some_and(|s| s.allowed)
        }
    };
    const VERBS: [&str; 8] = [
        "get",
        "list",
        "watch",
        "create",
        "update",
        "patch",
        "delete",
        "deletecollection",
    ];
    let mut wrong = Vec::new();
    for component in ["operator", "gateway"] {
        let sa = format!("sluice-{component}");
        let scopes = required[component].as_object().expect("component rules");
        for (scope, rules) in scopes {
            let ns = match scope.as_str() {
                "chains" => c.ns.clone(),
                "sandboxes" => c.pod_ns().to_string(),
                "release" => release.clone(),
                "cluster" => String::new(),
                other => panic!("unknown scope {other} in rbac_required.yaml"),
            };
            for rule in rules.as_array().expect("rules") {
                let group = rule["apiGroup"].as_str().expect("apiGroup").to_string();
                let resource = rule["resource"].as_str().expect("resource").to_string();
                let needed: Vec<&str> = rule["verbs"]
                    .as_array()
                    .expect("verbs")
                    .iter()
                    .filter_map(Value::as_str)
                    .collect();
                for verb in VERBS {
                    let allowed = can(
                        sa.clone(),
                        ns.clone(),
                        group.clone(),
                        resource.clone(),
                        verb.into(),
                    )
                    .await;
                    if allowed != needed.contains(&verb) {
                        wrong.push(format!(
                            "{sa} {verb} {group}/{resource} in {ns}: allowed={allowed}, needed={}",
                            needed.contains(&verb)
                        ));
                    }
                }
            }
        }
        // Never: Secrets anywhere, exec or pod creation outside the sandbox namespace.
        for (ns, group, resource, verb) in [
            (release.as_str(), "", "secrets", "get"),
            ("kube-system", "", "secrets", "list"),
            (c.ns.as_str(), "", "pods/exec", "create"),
            (c.ns.as_str(), "", "pods", "create"),
            ("kube-system", "", "pods/exec", "create"),
        ] {
            if can(
                sa.clone(),
                ns.into(),
                group.into(),
                resource.into(),
                verb.into(),
            )
            .await
            {
                wrong.push(format!("{sa} may {verb} {resource} in {ns}"));
            }
        }
    }
    // The certificates the operator makes: those Secrets by name, and no other; the gateway none.
    let can_named = |sa: &str, resource: &str, name: &str, verb: &str| {
        let review: SubjectAccessReview = serde_json::from_value(json!({
            "spec": {
                "user": format!("system:serviceaccount:{release}:{sa}"),
                "groups": ["system:serviceaccounts", "system:authenticated"],
                "resourceAttributes": {"namespace": release, "group": "", "resource": resource,
                                       "name": name, "verb": verb},
            }
        }))
        .expect("review");
        let reviews = reviews.clone();
        async move {
            reviews
                .create(&PostParams::default(), &review)
                .await
                .expect("create SubjectAccessReview")
                .status
                .is_some_and(|s| s.allowed)
        }
    };
    for (sa, resource, name, verb, want) in [
        ("sluice-operator", "secrets", "sluice-ca", "get", true),
        (
            "sluice-operator",
            "secrets",
            "sluice-gateway-tls",
            "update",
            true,
        ),
        (
            "sluice-operator",
            "secrets",
            "sluice-operator-webhook-tls",
            "update",
            true,
        ),
        ("sluice-operator", "configmaps", "sluice-ca", "update", true),
        ("sluice-operator", "secrets", "someone-elses", "get", false),
        (
            "sluice-operator",
            "configmaps",
            "sluice-gateway-callers",
            "update",
            false,
        ),
        ("sluice-gateway", "secrets", "sluice-ca", "get", false),
    ] {
        if can_named(sa, resource, name, verb).await != want {
            wrong.push(format!("{sa} {verb} {resource} {name}: allowed != {want}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "RBAC differs from rbac_required.yaml:\n{}",
        wrong.join("\n")
    );
}

/// A kubelet restart while the gateway holds pods: no pod of the chain fails a probe (the kubelet
/// runs startup probes again when it restarts), runs go on, and nothing leaks. What a real kubelet
/// shows: it proxies every exec stream, so its restart ends every held session; those pods retire
/// (their supervisor exits with the session) and the gateway claims others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_restart_with_held_pods() {
    let Some(c) = cluster("kubelet").await else {
        return;
    };
    c.apply_chain(
        "held",
        "held-bot",
        "input",
        json!({"pool": {"warm": 2, "max": 4, "reuse": "Recycle"}}),
        &[("upper", "modify", UPPER)],
    )
    .await;
    c.wait_pool_ready("held").await;
    let r = c.run("held-bot", "before").await.expect("Run before");
    assert_eq!(text(&r), "BEFORE");
    poll(
        Duration::from_secs(60),
        "the gateway holds a pod",
        || async { c.pool_pods("held", "claimed").await.into_iter().next() },
    )
    .await;
    if cluster_ctl(&["restart", "kubelet"]).is_none() {
        return;
    }
    // Every pod the chain has once the kubelet is back is started again (its startup probe passed
    // anew), and Runs are answered.
    poll(
        Duration::from_secs(120),
        "every pod of the chain started after the kubelet restart",
        || async {
            let pods: Vec<Pod> = [
                c.pool_pods("held", "warm").await,
                c.pool_pods("held", "claimed").await,
            ]
            .concat();
            let started = pods.iter().all(|p| {
                p.status
                    .as_ref()
                    .and_then(|s| s.container_statuses.as_ref())
                    .is_some_and(|cs| cs.iter().all(|c| c.started == Some(true)))
            });
            (!pods.is_empty() && started).then_some(())
        },
    )
    .await;
    let r = poll(
        Duration::from_secs(60),
        "a Run after the kubelet restart",
        || async { c.run("held-bot", "after").await.ok() },
    )
    .await;
    assert_eq!(text(&r), "AFTER");
    for i in 0..3 {
        let r = c.run("held-bot", &format!("again {i}")).await.expect("Run");
        assert_eq!(text(&r), format!("AGAIN {i}"));
    }
    wait_no_leak(&c, "held", 4).await;
    let failures = probe_failures(&c, "held").await;
    assert!(failures.is_empty(), "probe failures: {failures:?}");
}

/// An API server restart while the gateway holds pods: Runs go on once it is back, and nothing
/// leaks (held exec streams run through the API server: the gateway must notice they broke).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apiserver_restart_with_held_pods() {
    let Some(c) = cluster("apiserver").await else {
        return;
    };
    c.apply_chain(
        "held",
        "held-bot",
        "input",
        json!({"pool": {"warm": 2, "max": 4, "reuse": "Recycle"}}),
        &[("upper", "modify", UPPER)],
    )
    .await;
    c.wait_pool_ready("held").await;
    let r = c.run("held-bot", "before").await.expect("Run before");
    assert_eq!(text(&r), "BEFORE");
    if cluster_ctl(&["restart", "kube-apiserver"]).is_none() {
        return;
    }
    // Once the API server answers, a Run issued then is answered: it was not in flight.
    poll(
        Duration::from_secs(60),
        "the API server answers",
        || async { c.client.apiserver_version().await.ok() },
    )
    .await;
    let r = poll(
        Duration::from_secs(120),
        "a Run after the API server restart",
        || async { c.run("held-bot", "after").await.ok() },
    )
    .await;
    assert_eq!(text(&r), "AFTER");
    for i in 0..3 {
        let r = c.run("held-bot", &format!("again {i}")).await.expect("Run");
        assert_eq!(text(&r), format!("AGAIN {i}"));
    }
    wait_no_leak(&c, "held", 4).await;
    let failures = probe_failures(&c, "held").await;
    assert!(failures.is_empty(), "probe failures: {failures:?}");
    // The gateway's watches came back in time: a chain applied now is served within a few seconds
    // of the operator making it Ready, and its first Run finds a warm pod. Their retries once
    // backed off to 30 s: a watch refused while the API server was down, then expired on its
    // return, left the gateway blind to new chains and pods for up to half a minute.
    c.apply_chain(
        "later",
        "later-bot",
        "input",
        json!({}),
        &[("upper", "modify", UPPER)],
    )
    .await;
    c.wait_pool_ready("later").await;
    let r = poll(
        Duration::from_secs(10),
        "the gateway serves a chain applied after the API server restart",
        || async {
            match c.run("later-bot", "later").await {
                Err(s) if s.code() == tonic::Code::NotFound => None,
                answered => Some(answered),
            }
        },
    )
    .await
    .expect("the first Run of a chain applied after the API server restart");
    assert_eq!(text(&r), "LATER");
}

/// What a hook in a pod's cell finds of the sandbox and of other hooks, and leaves for the next.
const PEEK: &str = r#"import builtins, os
def execute(context, settings):
    seen = getattr(builtins, 'LEFT_BY_A_HOOK', None) is not None
    builtins.LEFT_BY_A_HOOK = 'x'
    try:
        procs = sorted(os.listdir('/proc'))
    except OSError as e:
        procs = type(e).__name__
    return {'action': 'detect', 'findings': {'saw_leftover': seen, 'procs': procs}}
"#;

/// Tries to leave a process behind; in a WebAssembly cell there is none to start.
const LEAVE_A_PROCESS: &str = r#"import os
def execute(context, settings):
    try:
        os.fork()
        started = True
    except (OSError, AttributeError):
        started = False
    return {'action': 'pass', 'findings': {'forked': started}} if started else {'action': 'pass'}
"#;

/// Cells under the real runtime, in a pod: each hook runs in a WebAssembly instance of its own, with
/// no `/proc` (no filesystem at all) and nothing of the hook before it, nor of the previous trigger
/// point; a hook cannot start a process, and trying does not fail the run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cells_hold_in_a_pod() {
    let Some(c) = cluster("cells").await else {
        return;
    };
    c.apply_chain(
        "cells",
        "cells-bot",
        "input",
        json!({"pool": {"warm": 1, "max": 3, "reuse": "Recycle"}}),
        &[
            ("first", "detect", PEEK),
            ("leaver", "modify", LEAVE_A_PROCESS),
            ("second", "detect", PEEK),
        ],
    )
    .await;
    // More trigger points than pods serve them (Recycle): some pod served two or more, so "nothing
    // of the previous trigger point" was seen by a cell in the same sandbox, not just a fresh one.
    const RUNS: usize = 6;
    let mut served_by = BTreeSet::new();
    for i in 0..RUNS {
        c.wait_pool_ready("cells").await;
        let r = c
            .run("cells-bot", &format!("trigger point {i}"))
            .await
            .expect("Run");
        served_by.extend(names(&c.pool_pods("cells", "claimed").await));
        assert_eq!(r.hooks.len(), 3, "{r:?}");
        for (index, hook) in [(0, "first"), (2, "second")] {
            let outcome = &r.hooks[index];
            assert_eq!(outcome.name, hook);
            assert!(outcome.error.is_empty(), "{hook}: {}", outcome.error);
            let findings = sluice_e2e::from_proto(outcome.findings.as_ref().expect("findings"));
            assert_eq!(
                findings["saw_leftover"],
                json!(false),
                "{hook} saw what another hook or trigger point left (run {i})"
            );
            assert_eq!(
                findings["procs"],
                json!("FileNotFoundError"),
                "{hook} sees no process at all (run {i})"
            );
        }
        assert!(
            r.hooks[1].error.is_empty() && r.hooks[1].findings.is_none(),
            "the leaver started a process or failed: {:?}",
            r.hooks[1]
        );
    }
    assert!(
        !served_by.is_empty() && served_by.len() < RUNS,
        "pods that served: {served_by:?}"
    );
}

/// The operator's `--start-deadline`, read from its Deployment (the chart's default otherwise).
async fn operator_start_deadline(c: &Cluster) -> Duration {
    use k8s_openapi::api::apps::v1::Deployment;
    let d = Api::<Deployment>::namespaced(c.client.clone(), &release_namespace())
        .get("sluice-operator")
        .await
        .expect("the operator's Deployment");
    let args = d
        .spec
        .and_then(|s| s.template.spec)
        .map(|s| s.containers[0].args.clone().unwrap_or_default())
        .unwrap_or_default();
    let value = args
        .iter()
        .find_map(|a| a.strip_prefix("--start-deadline="))
        .unwrap_or("120s");
    let secs: u64 = value
        .strip_suffix('s')
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("--start-deadline={value}: expected whole seconds"));
    Duration::from_secs(secs)
}

/// A pod that waits for a node longer than the start deadline (here: the node is cordoned, as when
/// an autoscaler is still adding one) gets its full start deadline once it is scheduled: it starts
/// and serves, instead of being deleted as a start timeout the moment it lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_start_deadline_counts_from_scheduling() {
    use k8s_openapi::api::core::v1::Node;
    let Some(c) = cluster("schedule").await else {
        return;
    };
    let deadline = operator_start_deadline(&c).await;
    let nodes = Api::<Node>::all(c.client.clone());
    let node_names: Vec<String> = nodes
        .list(&ListParams::default())
        .await
        .expect("nodes")
        .items
        .into_iter()
        .filter_map(|n| n.metadata.name)
        .collect();
    let cordon = |on: bool| {
        let (nodes, node_names) = (nodes.clone(), node_names.clone());
        async move {
            for n in &node_names {
                nodes
                    .patch(
                        n,
                        &PatchParams::default(),
                        &Patch::Merge(json!({"spec": {"unschedulable": on}})),
                    )
                    .await
                    .expect("cordon or uncordon the node");
            }
        }
    };
    cordon(true).await;
    let _uncordon = Uncordon(node_names.clone());
    c.apply_chain(
        "late",
        "late-bot",
        "input",
        json!({"pool": {"warm": 1, "max": 2}}),
        &[("upper", "modify", UPPER)],
    )
    .await;
    let waiting = poll(
        Duration::from_secs(60),
        "an unschedulable warm pod",
        || async {
            c.pool_pods("late", "warm").await.into_iter().find(|p| {
                p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|cs| {
                        cs.iter().any(|c| {
                            c.type_ == "PodScheduled"
                                && c.reason.as_deref() == Some("Unschedulable")
                        })
                    })
            })
        },
    )
    .await;
    let name = waiting.metadata.name.clone().expect("pod name");
    println!("{name} waits for a node; waiting out the start deadline ({deadline:?}) first");
    // Until the deadline (and 5 s) has passed since the pod was made, which is when an operator
    // timing starts from creation would delete it; the seconds spent finding the pod count.
    let created = waiting
        .metadata
        .creation_timestamp
        .clone()
        .expect("the pod's creationTimestamp")
        .0;
    let waited = k8s_openapi::jiff::Timestamp::now().duration_since(created);
    let waited = Duration::try_from(waited).unwrap_or_default();
    tokio::time::sleep((deadline + Duration::from_secs(5)).saturating_sub(waited)).await;
    let still = names(&c.pool_pods("late", "warm").await);
    cordon(false).await;
    assert!(
        still.contains(&name),
        "an unschedulable pod is held, not replaced: {still:?}"
    );
    c.wait_pool_ready("late").await;
    assert!(
        names(&c.pool_pods("late", "warm").await).contains(&name)
            || names(&c.pool_pods("late", "claimed").await).contains(&name),
        "the pod that waited for a node started and is in the pool"
    );
    let r = c.run("late-bot", "landed").await.expect("Run");
    assert_eq!(text(&r), "LANDED");
}

/// Uncordons the nodes when dropped, so a failing test leaves the cluster schedulable.
struct Uncordon(Vec<String>);

impl Drop for Uncordon {
    fn drop(&mut self) {
        use k8s_openapi::api::core::v1::Node;
        let nodes = std::mem::take(&mut self.0);
        let done = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                if let Ok(client) = Client::try_default().await {
                    for n in nodes {
                        let _ = Api::<Node>::all(client.clone())
                            .patch(
                                &n,
                                &PatchParams::default(),
                                &Patch::Merge(json!({"spec": {"unschedulable": false}})),
                            )
                            .await;
                    }
                }
            })
        });
        let _ = done.join();
    }
}

/// `kubectl <args>` against the test cluster (the one `KUBECONFIG` names): its output, or a panic
/// with what it said.
fn kubectl(args: &[&str]) -> String {
    let out = std::process::Command::new("kubectl")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run kubectl {args:?}: {e}"));
    assert!(
        out.status.success(),
        "kubectl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Rolling out new hook code as docs/rollout.md shows it, with kubectl: a shadow candidate never
/// changes an answer; `kubectl annotate` rolls it back; `kubectl patch` removing spec.rollout
/// promotes it; `kubectl wait --for=condition=RolledOut` and `kubectl get hc` tell where it stands;
/// each revision is a ControllerRevision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_through_kubectl_shadow_rollback_and_promotion() {
    let Some(c) = cluster("rollout-kubectl").await else {
        return;
    };
    let ns = c.ns.clone();
    c.apply_chain(
        "rollout",
        "rollout-bot",
        "input",
        json!({}),
        &[("case", "modify", UPPER)],
    )
    .await;
    c.wait_pool_ready("rollout").await;
    kubectl(&[
        "wait",
        "--for=condition=RolledOut",
        "hc/rollout",
        "-n",
        &ns,
        "--timeout=60s",
    ]);
    assert_eq!(
        text(&c.run("rollout-bot", "Mixed Case").await.expect("Run v1")),
        "MIXED CASE"
    );

    c.apply_chain(
        "rollout",
        "rollout-bot",
        "input",
        json!({"rollout": {"strategy": "Shadow"}}),
        &[("case", "modify", LOWER)],
    )
    .await;
    let api = c.chains();
    let candidate = poll(Duration::from_secs(60), "the rollout Shadowing", || {
        let api = api.clone();
        async move {
            let r = api.get("rollout").await.ok()?.status?.rollout?;
            (r.phase == "Shadowing").then_some(r.candidate_revision?)
        }
    })
    .await;
    let table = kubectl(&["get", "hc", "rollout", "-n", &ns]);
    assert!(
        table.contains("ROLLOUT") && table.contains("Shadowing"),
        "{table}"
    );
    for _ in 0..4 {
        let r = c
            .run("rollout-bot", "Mixed Case")
            .await
            .expect("Run in shadow");
        assert_eq!(text(&r), "MIXED CASE", "a shadow candidate answered");
    }
    // The gateway writes its comparison into the status: lower case where the live hooks give
    // upper case is the same action with other text.
    let entry = poll(
        Duration::from_secs(90),
        "the gateway's shadow comparison in status",
        || {
            let api = api.clone();
            async move {
                let r = api.get("rollout").await.ok()?.status?.rollout?;
                r.shadow.into_iter().find(|e| e.output_differs >= 1)
            }
        },
    )
    .await;
    assert_eq!(entry.action_differs, 0, "{entry:?}");
    println!(
        "kubectl get hc rollout -o jsonpath='{{.status.rollout.shadow}}':\n{}",
        kubectl(&[
            "get",
            "hc",
            "rollout",
            "-n",
            &ns,
            "-o",
            "jsonpath={.status.rollout.shadow}"
        ])
    );

    kubectl(&[
        "annotate",
        "hc/rollout",
        "-n",
        &ns,
        &format!("sluice.dev/rollback={}", &candidate[..10]),
    ]);
    poll(Duration::from_secs(60), "the rollout RolledBack", || {
        let api = api.clone();
        async move {
            let r = api.get("rollout").await.ok()?.status?.rollout?;
            (r.phase == "RolledBack").then_some(())
        }
    })
    .await;

    kubectl(&[
        "patch",
        "hc/rollout",
        "-n",
        &ns,
        "--type=json",
        "-p",
        r#"[{"op": "remove", "path": "/spec/rollout"}]"#,
    ]);
    kubectl(&[
        "wait",
        "--for=condition=RolledOut",
        "hc/rollout",
        "-n",
        &ns,
        "--timeout=60s",
    ]);
    poll(
        Duration::from_secs(30),
        "Run with the promoted code",
        || async {
            let r = c.run("rollout-bot", "Mixed Case").await.ok()?;
            (text(&r) == "mixed case").then_some(())
        },
    )
    .await;
    let revisions = kubectl(&[
        "get",
        "controllerrevisions",
        "-n",
        &ns,
        "-l",
        "sluice.dev/hookchain=rollout",
        "-o",
        "name",
    ]);
    assert_eq!(revisions.lines().count(), 2, "{revisions}");
}

/// What the traffic of the upgrade test saw.
#[derive(Debug, Default)]
struct Traffic {
    served: u64,
    /// Runs sent again on a new connection because the gateway pod they went to was going away
    /// (UNAVAILABLE, the connection closed under them, or no answer in 10 s): what a client behind
    /// a Service sees as a reconnect.
    resent: u64,
    /// Anything else: a wrong answer, an error a chain's policy would not give.
    failed: Vec<String>,
    /// The run ids of the runs served, to find them in the audit.
    run_ids: Vec<String>,
}

/// One client calling `target` (an upper-casing chain) back to back, following the gateway's pods
/// as they are replaced, until `stop`.
async fn traffic(
    client: Client,
    ns: String,
    target: String,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Traffic {
    let mut seen = Traffic::default();
    let mut gateway = None;
    let mut n = 0u64;
    while !*stop.borrow() {
        n += 1;
        let said = format!("call {n}");
        loop {
            let g = match &gateway {
                Some(g) => g,
                None => match connect_gateway(&client).await {
                    Ok(g) => gateway.insert(g),
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        continue;
                    }
                },
            };
            let answer = tokio::time::timeout(
                Duration::from_secs(10),
                run_input(g.clone(), &ns, &target, &said),
            )
            .await;
            match answer {
                Ok(Ok(r)) if action(&r) == Action::Modify && text(&r) == said.to_uppercase() => {
                    seen.served += 1;
                    seen.run_ids.push(r.run_id.clone());
                }
                Ok(Ok(r)) => seen.failed.push(format!("{said}: {r:?}")),
                // UNAVAILABLE, or the connection closed under the request by a gateway going away
                // (CANCELLED with the transport's "connection closed"): sent again.
                Ok(Err(status))
                    if status.code() == tonic::Code::Unavailable
                        || (status.code() == tonic::Code::Cancelled
                            && format!("{status:?}").contains("connection closed")) =>
                {
                    seen.resent += 1;
                    gateway = None;
                    continue;
                }
                Err(_) => {
                    seen.resent += 1;
                    gateway = None;
                    continue;
                }
                Ok(Err(status)) => seen.failed.push(format!("{said}: {status}")),
            }
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    seen
}

/// The operator's and the gateway's requests are classified into the chart's own priority level
/// (API Priority and Fairness), not the cluster's `workload-low`: the real API server's own
/// counters say which FlowSchema and level dispatched the requests of their ServiceAccounts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_server_dispatches_sluices_requests_in_its_own_priority_level() {
    let Some(_c) = cluster("apf").await else {
        return;
    };
    // The release's name is the chart's default in the suite's installs.
    let name = format!("sluice-{}", release_namespace());
    let wanted = format!(r#"flow_schema="{name}",priority_level="{name}""#);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let metrics = kubectl(&["get", "--raw", "/metrics"]);
        let dispatched: f64 = metrics
            .lines()
            .filter(|l| l.starts_with("apiserver_flowcontrol_dispatched_requests_total{"))
            .filter(|l| l.contains(&wanted))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        if dispatched > 0.0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no request was dispatched by FlowSchema and priority level {name} in 60 s: {:?}",
            metrics
                .lines()
                .filter(|l| l.starts_with("apiserver_flowcontrol_dispatched_requests_total{"))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// The kubectl the suite and the scripts use is one kubectl's version skew policy supports against
/// this API server (within one minor version): a newer one (the .venv-tools kubectl, 1.37 against
/// 1.34) may send what this API server does not know. cluster.sh builds the API server's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_is_within_its_skew_policy_of_the_api_server() {
    let Some(_c) = cluster("kubectl-skew").await else {
        return;
    };
    let v: Value = serde_json::from_str(&kubectl(&["version", "-o", "json"]))
        .expect("kubectl version -o json");
    let minor = |side: &str| -> i64 {
        v[side]["minor"]
            .as_str()
            .and_then(|m| m.trim_end_matches('+').parse().ok())
            .unwrap_or_else(|| panic!("no {side} minor version in {v}"))
    };
    let (client, server) = (minor("clientVersion"), minor("serverVersion"));
    assert!(
        (client - server).abs() <= 1,
        "kubectl 1.{client} against an API server 1.{server}: outside kubectl's skew policy (one minor version)"
    );
}

/// An upgrade from the previous release (e2e/cluster/previous-release: its chart and its images) to
/// this one, with traffic running: `helm upgrade` with the values the previous release was installed
/// with, as users upgrade. For a while old sandbox pods are served by the new gateway, new pods by
/// the old gateway, and the new operator replaces the old pods. No run may fail; a run whose gateway
/// pod was going away is sent again on a new connection (counted). make test-cluster runs it first,
/// on a cluster where `install.sh previous` installed the previous release; elsewhere it skips.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_from_the_previous_release_with_traffic_running() {
    use k8s_openapi::api::apps::v1::Deployment;
    let Some(ctl) = std::env::var_os("SLUICE_UPGRADE_CTL").filter(|c| !c.is_empty()) else {
        // A failure under SLUICE_CLUSTER_REQUIRED=1 (make test-cluster), a skip elsewhere.
        skip("SLUICE_UPGRADE_CTL is not set: no previous release installed to upgrade from");
        return;
    };
    let Some(c) = cluster("upgrade").await else {
        return;
    };
    let image = |component: &str, tag: &str| format!("sluice.test/sluice-{component}:{tag}");
    let deployments = Api::<Deployment>::namespaced(c.client.clone(), &release_namespace());
    let running = |name: &'static str| {
        let deployments = deployments.clone();
        async move {
            let d = deployments
                .get(name)
                .await
                .expect("the release's Deployment");
            d.spec?.template.spec?.containers.first()?.image.clone()
        }
    };
    assert_eq!(
        running("sluice-gateway").await,
        Some(image("gateway", "previous"))
    );
    c.serve_upper("upgrade", "upgrade-bot").await;
    let supervisor_images = || async {
        c.live_pods("upgrade", "")
            .await
            .iter()
            .filter_map(|p| p.spec.as_ref()?.containers.first()?.image.clone())
            .collect::<BTreeSet<_>>()
    };
    assert_eq!(
        supervisor_images().await,
        BTreeSet::from([image("supervisor", "previous")])
    );

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let load = tokio::spawn(traffic(
        c.client.clone(),
        c.ns.clone(),
        "upgrade-bot".into(),
        stop_rx,
    ));
    tokio::time::sleep(Duration::from_secs(5)).await;
    let upgraded = tokio::task::spawn_blocking(move || {
        std::process::Command::new(&ctl)
            .arg("upgrade")
            .output()
            .expect("run install.sh upgrade")
    })
    .await
    .expect("the upgrade's thread");
    assert!(
        upgraded.status.success(),
        "helm upgrade failed: {}",
        String::from_utf8_lossy(&upgraded.stderr)
    );
    assert_eq!(
        running("sluice-gateway").await,
        Some(image("gateway", "e2e"))
    );
    assert_eq!(
        running("sluice-operator").await,
        Some(image("operator", "e2e"))
    );
    // The new operator replaces every old sandbox pod (its template names another image).
    poll(
        Duration::from_secs(300),
        "the chain's pods all run this release's supervisor",
        || async {
            (supervisor_images().await == BTreeSet::from([image("supervisor", "e2e")]))
                .then_some(())
        },
    )
    .await;
    c.wait_pool_ready("upgrade").await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    stop_tx.send_replace(true);
    let seen = load.await.expect("the traffic task");
    println!(
        "upgrade with traffic: {} runs served, {} sent again on a new connection, {} failed",
        seen.served,
        seen.resent,
        seen.failed.len()
    );
    assert!(
        seen.failed.is_empty(),
        "runs failed during the upgrade: {:#?}",
        seen.failed
    );
    assert!(
        seen.served >= 50,
        "traffic ran through the upgrade: {seen:?}"
    );
}

/// The chart's defaults as a platform team gets them: a chain's `cpu` is its pods' request, the
/// platform's sandbox CPU limit (one core) their limit, and the chain's status says a walk fits. A
/// smoke row for the trigger point's latency and throttling is printed (the figures are `make
/// bench-cluster`'s; this only shows a regression).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_resources_request_cpu_and_walks_fit_the_limit() {
    let Some(c) = cluster("cpu").await else {
        return;
    };
    c.apply_chain(
        "cpu",
        "cpu-bot",
        "input",
        json!({"pool": {"warm": 2, "max": 4, "reuse": "Recycle"}}),
        &[
            ("upper", "modify", UPPER),
            ("digits", "modify", DIGITS),
            ("lower", "modify", LOWER),
        ],
    )
    .await;
    let chain = c.wait_pool_ready("cpu").await;
    let fits = chain
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "CpuSufficient"))
        .unwrap_or_else(|| panic!("no CpuSufficient condition: {:?}", chain.status));
    assert_eq!(
        (fits.status.as_str(), fits.reason.as_str()),
        ("True", "WalkFits"),
        "{fits:?}"
    );
    let pods = c.pool_pods("cpu", "warm").await;
    let resources = pods[0].spec.as_ref().unwrap().containers[0]
        .resources
        .clone()
        .expect("resources");
    assert_eq!(resources.requests.as_ref().unwrap()["cpu"].0, "250m");
    assert_eq!(resources.limits.as_ref().unwrap()["cpu"].0, "1");
    c.run("cpu-bot", "warm").await.expect("Run");
    let held = c.pool_pods("cpu", "claimed").await;
    let before: Option<u64> = held
        .iter()
        .map(|p| Some(sluice_e2e::pod_cpu_throttling(p.metadata.uid.as_deref()?)?.periods))
        .sum();
    let mut took = Vec::new();
    for i in 0..30 {
        let began = Instant::now();
        let r = c
            .run("cpu-bot", &format!("Call 555-{i:04}"))
            .await
            .expect("Run");
        took.push(began.elapsed());
        assert_eq!(text(&r), "call ###-####", "the three hooks ran in order");
    }
    let after: Option<u64> = held
        .iter()
        .map(|p| Some(sluice_e2e::pod_cpu_throttling(p.metadata.uid.as_deref()?)?.periods))
        .sum();
    took.sort();
    let row = format!(
        "SMOKE cluster Run, 3 hooks, chart defaults, held pod: p50 {:?} · max {:?} (n={}); throttled CFS periods per trigger point: {}",
        took[took.len() / 2],
        took[took.len() - 1],
        took.len(),
        match (before, after) {
            (Some(b), Some(a)) => format!("{:.2}", a.saturating_sub(b) as f64 / took.len() as f64),
            _ => "not readable here".into(),
        }
    );
    println!("{row}");
    // test.sh prints the file after the suite: cargo test shows no passing test's output.
    if let Some(path) = std::env::var_os("SLUICE_SMOKE_FILE") {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .expect("the smoke file");
        writeln!(file, "{row}").expect("written");
    }
}

/// Signed hook code (docs/signing.md) on the real API server: `install.sh` requires signatures in
/// `SLUICE_SIGNED_NAMESPACE`, trusting the suite's key (`SLUICE_SIGNING_KEY`). `kubectl apply` of an
/// unsigned chain there is refused by the webhook, naming the hook; a signed one is admitted and
/// served; a chain changed after signing and written past the webhook (its objectSelector moved
/// aside for a moment, as an outage under `failurePolicy: Ignore` or etcd access would let it in) is
/// marked invalid by the operator and never run by the gateway, which keeps serving the signed
/// generation; a signature replayed into another chain is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_signed_hook_code_is_admitted_and_served_where_signatures_are_required() {
    let Some(c) = cluster("signing").await else {
        return;
    };
    let (Ok(ns), Ok(key)) = (
        std::env::var("SLUICE_SIGNED_NAMESPACE"),
        std::env::var("SLUICE_SIGNING_KEY"),
    ) else {
        skip("SLUICE_SIGNED_NAMESPACE/SLUICE_SIGNING_KEY are not set: install.sh sets them");
        return;
    };
    let key = ssh_key::PrivateKey::read_openssh_file(std::path::Path::new(&key))
        .expect("the suite's signing key");
    let namespace: Namespace = serde_json::from_value(json!({
        "metadata": {"name": ns, "labels": {"sluice.dev/e2e": "true"}}
    }))
    .expect("namespace object");
    let namespaces = Api::<Namespace>::all(c.client.clone());
    if namespaces
        .get_opt(&ns)
        .await
        .expect("get namespace")
        .is_none()
    {
        namespaces
            .create(&PostParams::default(), &namespace)
            .await
            .expect("create the signed namespace");
    }
    let chains: Api<HookChain> = Api::namespaced(c.client.clone(), &ns);
    // A chain `name` whose hook runs `code`, signed for the chain `signed_for` (or not at all).
    let chain = |name: &str, code: &str, signed_for: Option<&str>| {
        let mut hook = sluice_crds::HookSpec::with_code("upper", sluice_crds::Action::Modify, code);
        if let Some(for_chain) = signed_for {
            hook.signature = Some(
                sluice_crds::signing::sign(
                    &key,
                    &ns,
                    for_chain,
                    sluice_crds::TriggerPoint::Input,
                    &hook,
                )
                .expect("sign"),
            );
        }
        json!({
            "apiVersion": "sluice.dev/v1alpha1",
            "kind": "HookChain",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"target": format!("{name}-bot"), "triggerPoint": "input",
                     "pool": {"warm": 1, "max": 2}, "hooks": [hook]},
        })
    };
    let apply = |name: &str, object: Value| {
        let chains = chains.clone();
        let name = name.to_string();
        async move {
            chains
                .patch(
                    &name,
                    &PatchParams::apply("sluice-e2e").force(),
                    &Patch::Apply(&object),
                )
                .await
        }
    };

    // Unsigned: `kubectl apply` is refused, with the hook named; nothing stored.
    let file = tempfile::NamedTempFile::new().expect("a temp file");
    std::fs::write(file.path(), chain("signed", UPPER, None).to_string()).expect("write");
    let out = std::process::Command::new("kubectl")
        .args(["apply", "-f"])
        .arg(file.path())
        .output()
        .expect("run kubectl apply");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "an unsigned chain is refused: {said}"
    );
    assert!(
        said.contains("denied the request") && said.contains("hook \"upper\" is not signed"),
        "{said}"
    );
    assert!(chains.get_opt("signed").await.expect("get").is_none());
    // A signature made for another chain: refused too.
    let replayed = apply("signed", chain("signed", UPPER, Some("elsewhere")))
        .await
        .expect_err("a replayed signature is refused");
    assert!(
        replayed.to_string().contains("does not match"),
        "{replayed}"
    );

    // Signed: admitted and served.
    apply("signed", chain("signed", UPPER, Some("signed")))
        .await
        .expect("a signed chain is admitted");
    let r = poll(
        Duration::from_secs(120),
        "the gateway serves the signed chain",
        || async {
            match run_input(c.gateway.clone(), &ns, "signed-bot", "hello").await {
                Ok(r) => Some(r),
                Err(s)
                    if s.code() == tonic::Code::NotFound
                        || s.code() == tonic::Code::Unavailable =>
                {
                    None
                }
                Err(s) => panic!("Run: {s}"),
            }
        },
    )
    .await;
    assert_eq!(text(&r), "HELLO");

    // Changed after signing and written past the webhook: the gateway keeps the signed generation.
    use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
    let configs = Api::<ValidatingWebhookConfiguration>::all(c.client.clone());
    let config = configs
        .list(&ListParams::default().labels("app.kubernetes.io/part-of=sluice"))
        .await
        .expect("list ValidatingWebhookConfigurations")
        .items
        .into_iter()
        .next()
        .expect("the release's webhook configuration");
    let config_name = config.metadata.name.clone().expect("name");
    /// Puts the webhooks' objectSelectors back, whatever happens to the test.
    struct Restore(String, Vec<Value>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let ops: Vec<Value> = self
                .1
                .iter()
                .enumerate()
                .map(|(i, sel)| json!({"op": "replace", "path": format!("/webhooks/{i}/objectSelector"), "value": sel}))
                .collect();
            kubectl(&[
                "patch",
                "validatingwebhookconfiguration",
                &self.0,
                "--type=json",
                "-p",
                &Value::Array(ops).to_string(),
            ]);
        }
    }
    let original: Vec<Value> = config
        .webhooks
        .iter()
        .flatten()
        .map(|w| {
            serde_json::to_value(w.object_selector.clone().unwrap_or_default()).expect("selector")
        })
        .collect();
    let aside: Vec<Value> = (0..original.len())
        .map(|i| json!({"op": "replace", "path": format!("/webhooks/{i}/objectSelector"), "value": {"matchLabels": {"sluice.test/webhook": "never"}}}))
        .collect();
    let restore = Restore(config_name.clone(), original);
    kubectl(&[
        "patch",
        "validatingwebhookconfiguration",
        &config_name,
        "--type=json",
        "-p",
        &Value::Array(aside).to_string(),
    ]);
    // The API server applies a webhook configuration change a moment later: retried until stored.
    let mut tampered = chain("signed", UPPER, Some("signed"));
    tampered["spec"]["hooks"][0]["code"] = json!(LOWER);
    poll(
        Duration::from_secs(60),
        "the tampered chain is stored past the webhook",
        || async { apply("signed", tampered.clone()).await.ok() },
    )
    .await;
    drop(restore);
    let status = poll(
        Duration::from_secs(60),
        "the operator marks the tampered chain invalid",
        || async {
            let hc = chains.get("signed").await.ok()?;
            let status = hc.status?;
            status
                .conditions
                .iter()
                .find(|c| {
                    c.type_ == "CodeValid" && c.status == "False" && c.reason == "UnsignedCode"
                })
                .map(|c| c.message.clone())
        },
    )
    .await;
    assert!(status.contains("does not match"), "{status}");
    // The gateway never runs the tampered code: the signed generation keeps answering.
    for _ in 0..5 {
        let r = run_input(c.gateway.clone(), &ns, "signed-bot", "Hello")
            .await
            .expect("Run");
        assert_eq!(
            text(&r),
            "HELLO",
            "the tampered (lower-casing) code must never run"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    chains
        .delete("signed", &DeleteParams::default())
        .await
        .expect("delete the chain");
}

/// `sluice doctor` against the test cluster: every check holds, the last one being a pod made like
/// a sandbox pod that ran a hook under gVisor. On RuntimeClasses whose handler no node has (as on
/// a node without runsc configured) or whose handler is not gVisor (plain runc), that check fails
/// and says why in the cluster's words.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sluice_doctor_passes_here_and_says_why_without_a_gvisor_handler() {
    let Some(c) = cluster("doctor").await else {
        return;
    };
    use k8s_openapi::api::node::v1::RuntimeClass;
    use sluice_cli::doctor::{Options, run};
    let opts = |class: Option<&str>, secs: u64| Options {
        namespace: release_namespace(),
        runtime_class: class.map(str::to_string),
        timeout: Duration::from_secs(secs),
    };
    let report = |checks: &[sluice_cli::doctor::Check]| {
        checks
            .iter()
            .map(|c| c.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    };
    let checks = run(c.client.clone(), &opts(None, 120)).await;
    let said = report(&checks);
    println!("{said}");
    assert!(checks.iter().all(|c| c.ok), "{said}");
    assert!(said.contains("ran a hook in a cell under gVisor"), "{said}");
    // Installed from the cluster's registry: the operator's and the gateway's images, and the
    // supervisor's the doctor's pod ran, were pulled from it by the node's containerd.
    if let Ok(registry) = std::env::var("SLUICE_CLUSTER_REGISTRY") {
        let pods = Api::<Pod>::namespaced(c.client.clone(), &release_namespace())
            .list(&ListParams::default().labels("app.kubernetes.io/part-of=sluice"))
            .await
            .expect("list the release's pods");
        let ids: Vec<String> = pods
            .items
            .iter()
            .flat_map(|p| {
                p.status
                    .iter()
                    .flat_map(|s| s.container_statuses.iter().flatten())
            })
            .map(|c| format!("{} {}", c.image, c.image_id))
            .collect();
        assert!(!ids.is_empty());
        for id in &ids {
            assert!(
                id.starts_with(&format!("{registry}/")) && id.contains(&format!(" {registry}/")),
                "an image not pulled from {registry}: {id}"
            );
        }
        assert!(
            said.contains(&format!(", {registry}/sluice-supervisor:")),
            "{said}"
        );
    }

    let classes = Api::<RuntimeClass>::all(c.client.clone());
    for (name, handler) in [
        ("sluice-e2e-no-handler", "no-such-handler"),
        ("sluice-e2e-runc", "runc"),
    ] {
        let class: RuntimeClass =
            serde_json::from_value(json!({"metadata": {"name": name}, "handler": handler}))
                .expect("RuntimeClass");
        let _ = classes.delete(name, &DeleteParams::default()).await;
        classes
            .create(&PostParams::default(), &class)
            .await
            .expect("create the RuntimeClass");
        let checks = run(c.client.clone(), &opts(Some(name), 20)).await;
        let _ = classes.delete(name, &DeleteParams::default()).await;
        let said = report(&checks);
        println!("{said}");
        let last = checks.last().expect("checks");
        assert_eq!(last.what, "sandbox pod under gVisor", "{said}");
        assert!(!last.ok, "{said}");
        match handler {
            "runc" => assert!(last.detail.contains("not running under gVisor"), "{said}"),
            _ => assert!(last.detail.contains("no-such-handler"), "{said}"),
        }
    }
}
