//! Helpers shared by the end-to-end suites: a real gateway in local mode (real runsc sandboxes) on a
//! loopback port, a gRPC client, and the leak check every test ends with.

use serde_json::Value;
use sluice_engine::Audit;
use sluice_gateway::{LocalOptions, RunningGateway, start_local};
use sluice_proto::{self as proto, gateway_client::GatewayClient};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tonic::transport::Channel;

pub use sluice_proto::convert::{from_proto, to_proto};

pub mod tenants;

/// A chain file with one hook per `(name, action, code)`, serving `target` at `trigger_point`.
pub fn chain_yaml(
    name: &str,
    target: &str,
    trigger_point: &str,
    extra_spec: &str,
    hooks: &[(&str, &str, &str)],
) -> String {
    let mut y = format!(
        "apiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n  target: {target}\n  triggerPoint: {trigger_point}\n"
    );
    if !extra_spec.contains("pool:") {
        y.push_str("  pool: {warm: 1, max: 8}\n");
    }
    for line in extra_spec.lines().filter(|l| !l.trim().is_empty()) {
        y.push_str(&format!("  {line}\n"));
    }
    y.push_str("  hooks:\n");
    for (hook, action, code) in hooks {
        y.push_str(&format!(
            "    - name: {hook}\n      action: {action}\n      code: |\n"
        ));
        for line in code.lines() {
            y.push_str(&format!("        {line}\n"));
        }
    }
    y
}

pub struct Harness {
    pub gateway: Option<RunningGateway>,
    pub client: GatewayClient<Channel>,
    pub dir: tempfile::TempDir,
    pub state: tempfile::TempDir,
    pub audit_path: PathBuf,
}

impl Harness {
    /// Starts a gateway serving `files` (name → YAML) and waits until its pools are warm.
    pub async fn start(files: &[(&str, &str)]) -> Self {
        Self::start_with(files, |_| {}).await
    }

    pub async fn start_with(files: &[(&str, &str)], tweak: impl FnOnce(&mut LocalOptions)) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        for (name, text) in files {
            std::fs::write(dir.path().join(name), text).expect("write chain file");
        }
        let state = tempfile::Builder::new()
            .prefix("sluice-e2e")
            .tempdir_in("/tmp")
            .expect("state dir");
        let audit_path = state.path().join("audit.jsonl");
        let mut opts = LocalOptions::new(dir.path(), state.path().join("sandboxes"));
        opts.audit = Audit::to_file(&audit_path).expect("audit file");
        opts.limits.boot_timeout = Duration::from_secs(60);
        opts.limits.claim_timeout = Duration::from_secs(60);
        tweak(&mut opts);
        let gateway = start_local(opts).await.expect("gateway starts");
        assert!(
            gateway
                .engine
                .pools()
                .wait_warm(Duration::from_secs(90))
                .await,
            "pools never became warm"
        );
        Self::connected(gateway, dir, state, audit_path).await
    }

    /// Starts a gateway in kube mode against `api` (a fake API server whose pods are local runsc
    /// sandboxes), serving the HookChains and Capabilities `api` holds.
    pub async fn start_kube(
        api: &sluice_fake_apiserver::FakeApiServer,
        identity: &str,
        claim_timeout: Duration,
    ) -> Self {
        Self::start_kube_with(api, identity, claim_timeout, |_| {}).await
    }

    pub async fn start_kube_with(
        api: &sluice_fake_apiserver::FakeApiServer,
        identity: &str,
        claim_timeout: Duration,
        tweak: impl FnOnce(&mut sluice_gateway::KubeOptions),
    ) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let state = tempfile::Builder::new()
            .prefix("sluice-e2e-kube")
            .tempdir_in("/tmp")
            .expect("state dir");
        let audit_path = state.path().join("audit.jsonl");
        let mut cfg = sluice_sandbox_kube::KubeConfig::new(identity);
        cfg.claim_timeout = claim_timeout;
        // The gateway's own client stack (TCP keepalive), as `sluice-gateway` builds it.
        let client = sluice_sandbox_kube::client(api.config()).expect("a kube client");
        let mut opts = sluice_gateway::KubeOptions::new(client, cfg);
        opts.audit = Audit::to_file(&audit_path).expect("audit file");
        opts.limits.claim_timeout = claim_timeout;
        opts.limits.boot_timeout = Duration::from_secs(60);
        opts.sync_timeout = Duration::from_secs(10);
        tweak(&mut opts);
        let gateway = sluice_gateway::start_kube(opts)
            .await
            .expect("gateway starts in kube mode");
        Self::connected(gateway, dir, state, audit_path).await
    }

    /// Shuts a kube-mode gateway down and asserts it claimed nothing it did not delete.
    pub async fn stop_kube_and_check(mut self, api: &sluice_fake_apiserver::FakeApiServer) {
        let gateway = self.gateway.take().expect("gateway running");
        let backend = gateway.backend().clone();
        gateway.shutdown().await;
        let live = backend.live().await;
        assert!(live.is_empty(), "claimed pods not deleted: {live:?}");
        let claimed: Vec<String> = api
            .list(sluice_fake_apiserver::Resource::Pods, "default")
            .iter()
            .filter(|p| p["metadata"]["labels"]["sluice.dev/pool"] == "claimed")
            // Deleted and Terminating (its container still getting its grace period) is deleted.
            .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
            .map(|p| p["metadata"]["name"].to_string())
            .collect();
        assert!(
            claimed.is_empty(),
            "claimed pods left in the API: {claimed:?}"
        );
    }

    async fn connected(
        gateway: RunningGateway,
        dir: tempfile::TempDir,
        state: tempfile::TempDir,
        audit_path: PathBuf,
    ) -> Self {
        let client = GatewayClient::connect(format!("http://{}", gateway.addr))
            .await
            .expect("connect");
        Self {
            gateway: Some(gateway),
            client,
            dir,
            state,
            audit_path,
        }
    }

    /// Sandboxes booted so far (`sluice_gateway_sandboxes_started_total`).
    pub fn boots(&self) -> u64 {
        self.gateway().engine.metrics().boots()
    }

    /// Sandboxes retired so far, by reason (`sluice_gateway_sandbox_retirements_total`).
    pub fn retirements(&self) -> Vec<(String, u64)> {
        let m = self.gateway().engine.metrics();
        [
            "reuse_none",
            "max_uses",
            "dirty",
            "broken",
            "idle",
            "pool_closed",
        ]
        .iter()
        .map(|r| (r.to_string(), m.retirements(r)))
        .filter(|(_, n)| *n > 0)
        .collect()
    }

    pub fn gateway(&self) -> &RunningGateway {
        self.gateway.as_ref().expect("gateway running")
    }

    pub async fn run_text(
        &self,
        target: &str,
        trigger_point: &str,
        text: &str,
    ) -> Result<proto::RunResponse, tonic::Status> {
        self.run(
            target,
            trigger_point,
            proto::run_request::Payload::Text(text.into()),
            Default::default(),
        )
        .await
    }

    /// Text at `trigger_point` of `target` for `session` (the other helpers use session `s-1`).
    pub async fn run_in_session(
        &self,
        target: &str,
        trigger_point: &str,
        text: &str,
        session: &str,
    ) -> Result<proto::RunResponse, tonic::Status> {
        let req = proto::RunRequest {
            namespace: "default".into(),
            target: target.into(),
            trigger_point: trigger_point.into(),
            payload: Some(proto::run_request::Payload::Text(text.into())),
            session_id: session.into(),
            ..Default::default()
        };
        self.client.clone().run(req).await.map(|r| r.into_inner())
    }

    pub async fn run_value(
        &self,
        target: &str,
        trigger_point: &str,
        value: Value,
    ) -> Result<proto::RunResponse, tonic::Status> {
        self.run(
            target,
            trigger_point,
            proto::run_request::Payload::Value(to_proto(&value)),
            Default::default(),
        )
        .await
    }

    pub async fn run(
        &self,
        target: &str,
        trigger_point: &str,
        payload: proto::run_request::Payload,
        context: std::collections::HashMap<String, String>,
    ) -> Result<proto::RunResponse, tonic::Status> {
        let req = proto::RunRequest {
            namespace: "default".into(),
            target: target.into(),
            trigger_point: trigger_point.into(),
            payload: Some(payload),
            context,
            session_id: "s-1".into(),
        };
        self.client.clone().run(req).await.map(|r| r.into_inner())
    }

    /// Every audit line written so far.
    pub fn audit(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.audit_path)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).expect("audit lines are JSON"))
            .collect()
    }

    pub fn write_file(&self, name: &str, text: &str) {
        let tmp = self.dir.path().join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text).expect("write");
        std::fs::rename(&tmp, self.dir.path().join(name)).expect("rename");
    }

    /// Shuts the gateway down and asserts that nothing of its sandboxes is left: no runsc
    /// containers, no processes, no bundles, no cgroups.
    pub async fn stop_and_check_leaks(mut self) {
        let gateway = self.gateway.take().expect("gateway running");
        let backend = gateway.backend().clone();
        gateway.shutdown().await;
        let live = backend.live().await;
        if !live.is_empty() {
            let root = self.state.path().join("sandboxes/runsc");
            let list = std::process::Command::new("runsc")
                .arg("--root")
                .arg(&root)
                .arg("list")
                .output()
                .unwrap();
            panic!(
                "runsc containers left: {live:?}\n{}",
                String::from_utf8_lossy(&list.stdout)
            );
        }
        let sandboxes = self.state.path().join("sandboxes");
        assert_no_leaks(&sandboxes);
    }
}

/// No process mentions the state dir, no bundle is left in it, no cgroup of it exists.
pub fn assert_no_leaks(state_dir: &Path) {
    let needle = state_dir.to_string_lossy().to_string();
    // Processes may take a moment to be reaped after their sandbox is deleted.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let procs = processes_mentioning(&needle);
        if procs.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "processes left: {procs:#?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let bundles: Vec<_> = std::fs::read_dir(state_dir.join("bundles"))
        .map(|r| r.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(bundles.is_empty(), "bundles left: {bundles:?}");
    // Every hierarchy: blkio, cpuset, devices, freezer, systemd... not only the limited ones.
    let cgroups = sluice_sandbox_local::leftover_cgroups(state_dir);
    assert!(cgroups.is_empty(), "cgroups left: {cgroups:?}");
}

fn processes_mentioning(needle: &str) -> Vec<String> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmd.contains(needle) {
            out.push(format!("{}: {cmd}", entry.file_name().to_string_lossy()));
        }
    }
    out
}

pub fn action(r: &proto::RunResponse) -> proto::Action {
    proto::Action::try_from(r.action).expect("known action")
}

pub fn text(r: &proto::RunResponse) -> &str {
    match &r.payload {
        Some(proto::run_response::Payload::Text(t)) => t,
        _ => panic!("expected a text payload, got {:?}", r.payload),
    }
}

/// What a stream gave back.
#[derive(Debug, Default)]
pub struct StreamResult {
    pub commits: Vec<String>,
    pub blocked: Option<proto::StreamBlocked>,
    /// Index into `commits` at which `blocked` arrived (commits before it).
    pub blocked_after: Option<usize>,
    pub final_: Option<proto::RunResponse>,
    pub status: Option<tonic::Status>,
}

impl StreamResult {
    pub fn committed(&self) -> String {
        self.commits.concat()
    }
}

impl Harness {
    /// Opens an interactive stream: send chunks (and finish) on the sender, read the responses.
    pub async fn open_stream(
        &self,
        target: &str,
        trigger_point: &str,
    ) -> (
        tokio::sync::mpsc::Sender<proto::StreamRequest>,
        tonic::Streaming<proto::StreamResponse>,
    ) {
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let open = proto::StreamOpen {
            namespace: "default".into(),
            target: target.into(),
            trigger_point: trigger_point.into(),
            ..Default::default()
        };
        tx.send(proto::StreamRequest {
            msg: Some(proto::stream_request::Msg::Open(open)),
        })
        .await
        .expect("queue open");
        let responses = self
            .client
            .clone()
            .stream(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .expect("stream opens")
            .into_inner();
        (tx, responses)
    }

    /// Streams `chunks` through `target` at `trigger_point` and collects every answer.
    pub async fn stream(
        &self,
        target: &str,
        trigger_point: &str,
        chunks: &[String],
    ) -> StreamResult {
        let mut msgs = vec![proto::StreamRequest {
            msg: Some(proto::stream_request::Msg::Open(proto::StreamOpen {
                namespace: "default".into(),
                target: target.into(),
                trigger_point: trigger_point.into(),
                context: Default::default(),
                session_id: "s-1".into(),
                chunk_by_chunk: false,
            })),
        }];
        msgs.extend(chunks.iter().map(|c| proto::StreamRequest {
            msg: Some(proto::stream_request::Msg::Chunk(c.clone())),
        }));
        msgs.push(proto::StreamRequest {
            msg: Some(proto::stream_request::Msg::Finish(proto::StreamFinish {})),
        });
        let mut out = StreamResult::default();
        let mut responses = match self
            .client
            .clone()
            .stream(futures::stream::iter(msgs))
            .await
        {
            Ok(r) => r.into_inner(),
            Err(s) => {
                out.status = Some(s);
                return out;
            }
        };
        loop {
            match responses.message().await {
                Ok(Some(m)) => match m.msg {
                    Some(proto::stream_response::Msg::Commit(c)) => {
                        assert!(out.blocked.is_none(), "a commit arrived after blocked");
                        out.commits.push(c)
                    }
                    Some(proto::stream_response::Msg::Blocked(b)) => {
                        out.blocked_after = Some(out.commits.len());
                        out.blocked = Some(b)
                    }
                    Some(proto::stream_response::Msg::Final(f)) => {
                        assert!(out.final_.is_none(), "two finals");
                        out.final_ = Some(f)
                    }
                    None => {}
                },
                Ok(None) => break,
                Err(s) => {
                    out.status = Some(s);
                    break;
                }
            }
        }
        out
    }
}

pub use sluice_engine::chunk_at;

/// Whether pod `namespace/name` was deleted: gone, or Terminating (its container still getting its
/// grace period, as a kubelet gives it).
pub fn pod_deleted(
    api: &sluice_fake_apiserver::FakeApiServer,
    namespace: &str,
    name: &str,
) -> bool {
    api.get(sluice_fake_apiserver::Resource::Pods, namespace, name)
        .is_none_or(|p| !p["metadata"]["deletionTimestamp"].is_null())
}

/// A YAML manifest as the JSON object the API server stores (namespace defaulted).
pub fn manifest_json(yaml: &str) -> Value {
    let mut v: Value = serde_saphyr::from_str(yaml).expect("test manifests are valid YAML");
    if v["metadata"]["namespace"].is_null() {
        v["metadata"]["namespace"] = "default".into();
    }
    v
}

/// The operator as `sluice-operator run` runs it (leader election included), against the fake
/// API server, until the returned sender says stop.
pub mod operator {
    use sluice_operator::controller::{self, LeaseTiming, RunConfig};
    use sluice_operator::leader::{self, LeaseLock};
    use sluice_operator::metrics::Metrics;
    use sluice_operator::reconcile::build::Settings;
    use std::time::Duration;

    pub type Running = (
        tokio::sync::watch::Sender<bool>,
        tokio::task::JoinHandle<()>,
    );

    /// `run` with the defaults (pods beside their chains, no namespace limit) and `identity`.
    pub fn config(identity: &str, settings: Settings) -> RunConfig {
        RunConfig {
            settings,
            claim_deadline: Duration::from_secs(300),
            start_deadline: Duration::from_secs(120),
            namespace: None,
            selector: None,
            platform_namespace: "sluice-system".into(),
            allowed_endpoints: Default::default(),
            identity: identity.into(),
            watch_nodes: true,
        }
    }

    /// Starts it with `client`, its Lease in the platform namespace.
    pub fn start(client: kube::Client, config: RunConfig) -> Running {
        let lock = LeaseLock::new(
            kube::Api::namespaced(client.clone(), &config.platform_namespace),
            "sluice-operator",
            &config.identity,
            leader::LEASE_DURATION,
        );
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(controller::run_when_leading(
            client,
            config,
            Metrics::new(),
            lock,
            LeaseTiming::default(),
            stopped,
        ));
        (stop, task)
    }

    /// Stops it and waits (at most a minute) for it to hand back its Lease.
    pub async fn stop((stop, task): Running) {
        stop.send_replace(true);
        tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .expect("the operator stops")
            .expect("the operator did not panic");
    }
}

/// A pod's CFS throttling so far, from its pod cgroup on this machine (a node of the test cluster):
/// the kubelet's cgroupfs layout under its cgroupRoot (the test cluster's is /sluice-cluster), so
/// the pod's directory is looked for a few levels down each cpu hierarchy. `None` when it is not
/// here.
pub fn pod_cpu_throttling(uid: &str) -> Option<sluice_sandbox::CpuThrottling> {
    pod_cpu_throttling_in(Path::new("/sys/fs/cgroup"), uid)
}

fn pod_cpu_throttling_in(cgroups: &Path, uid: &str) -> Option<sluice_sandbox::CpuThrottling> {
    fn find(dir: &Path, name: &str, depth: u32) -> Option<std::path::PathBuf> {
        let subdirs: Vec<_> = std::fs::read_dir(dir)
            .ok()?
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.path())
            .collect();
        if let Some(hit) = subdirs
            .iter()
            .find(|p| p.file_name().is_some_and(|n| n == name))
        {
            return Some(hit.clone());
        }
        if depth == 0 {
            return None;
        }
        subdirs.iter().find_map(|p| find(p, name, depth - 1))
    }
    let dir = format!("pod{uid}");
    ["cpu", "cpu,cpuacct"].iter().find_map(|hierarchy| {
        let pod = find(&cgroups.join(hierarchy), &dir, 5)?;
        let stat = std::fs::read_to_string(pod.join("cpu.stat")).ok()?;
        sluice_sandbox::CpuThrottling::from_cpu_stat(&stat)
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_pods_throttling_is_found_under_the_kubelets_cgroup_root() {
        let root = tempfile::tempdir().unwrap();
        let pod = root
            .path()
            .join("cpu/sluice-cluster/kubepods/burstable/podu-1");
        std::fs::create_dir_all(&pod).unwrap();
        std::fs::write(
            pod.join("cpu.stat"),
            "nr_periods 9\nnr_throttled 4\nthrottled_time 7\n",
        )
        .unwrap();
        let found = super::pod_cpu_throttling_in(root.path(), "u-1").expect("found");
        assert_eq!(found.periods, 4);
        assert_eq!(super::pod_cpu_throttling_in(root.path(), "u-2"), None);
    }
}
