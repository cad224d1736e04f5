//! A small in-memory Kubernetes API server for tests and benchmarks of the gateway's `kube` backend
//! and the operator, where no cluster can run. It serves, over real HTTP, what they use, with the
//! semantics the real API server (and a kubelet) has for them:
//!
//! - list and watch (`?watch=true`, JSON lines, label selectors) of pods, HookChains, Capabilities,
//!   Events (core and `events.k8s.io`), Leases and NetworkPolicies; a watch resumes from a recent
//!   `resourceVersion`, is told `410 Gone` (an ERROR event, reason Expired) when it asks for one
//!   older than the bounded history kept, and gets BOOKMARKs when it allows them (periodically, and
//!   at the end of the initial events with `sendInitialEvents`);
//! - create (`generateName` included), replace, merge PATCH and server-side apply (taken as a merge),
//!   the `status` subresource apart from the object, with the optimistic-concurrency precondition
//!   (`metadata.resourceVersion` must match, else 409 Conflict), and DELETE with its
//!   preconditions and, for pods, the grace period (the pod stays Terminating until its container
//!   is gone);
//! - `pods/{name}/exec` over websocket, speaking the real channel protocol (`v5.channel.k8s.io` with
//!   its CLOSE signal, or `v4.channel.k8s.io`; channel 0 stdin, 1 stdout, 2 stderr, 3 a `Status` at
//!   exit);
//! - every write counted by verb and resource ([`FakeApiServer::writes`]), the scheduler's and the
//!   kubelet's included;
//! - injected faults a real API server cannot be made to produce on demand ([`FakeApiServer::inject`]):
//!   `429`/`503` with `Retry-After` (API Priority and Fairness, a rollout), and `504` after the write
//!   took effect (a timeout between the API server and etcd whose write committed anyway).
//!
//! A created pod is scheduled and started by stand-ins for the scheduler and the kubelet
//! (`kubelet.rs`): after a configurable start latency its container is a real local runsc sandbox
//! started the way the operator's pod starts (the supervisor listening for one attach), probed for
//! readiness every period. Exec runs the requested command in the sandbox with `runsc exec` and
//! bridges its stdio to the websocket, so the gateway runs real chains through the real relay over
//! real framing.

mod exec;
mod kubelet;
mod store;
mod writes;

/// The node every pod of the fake runs on.
pub use kubelet::NODE;
pub use store::Resource;
pub use writes::{Verb, Write, Writes};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::{Request, Response, StatusCode};
use serde_json::{Value, json};
use sluice_crds::sandbox_pod;
use sluice_engine::{SandboxBackend, SandboxHandle, SandboxSpec};
use sluice_sandbox_local::{LocalBackend, LocalConfig};
use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use store::{Part, Store, StoreError, WatchParams};
use tokio::sync::watch;

pub type Body = BoxBody<Bytes, Infallible>;

/// Which websocket subprotocols the exec endpoint accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExecProtocol {
    /// Prefer v5 (the client's stdin CLOSE signal), fall back to v4: what current clusters do.
    V5,
    /// Only v4, as clusters before Kubernetes 1.30 do.
    V4,
}

/// An answer the fake gives instead of the real one, to requests that match: what API Priority and
/// Fairness (429), an API server going away (503), a timed-out write that committed (504) or one
/// that cannot serve the request at all (500) look like.
#[derive(Clone, Debug)]
pub struct Fault {
    method: String,
    path_contains: String,
    code: u16,
    retry_after: Option<u64>,
    commit: bool,
    times: Option<usize>,
    watches_only: bool,
}

impl Fault {
    /// Answers `code` to every `method` request whose path contains `path_contains` (`"/pods/"`,
    /// `"/exec"`), without doing it.
    pub fn answer(method: &str, path_contains: &str, code: u16) -> Self {
        Self {
            method: method.into(),
            path_contains: path_contains.into(),
            code,
            retry_after: None,
            commit: false,
            times: None,
            watches_only: false,
        }
    }

    /// With a `Retry-After` header of `secs` seconds (what the real server sends with 429 and 503).
    pub fn retry_after(mut self, secs: u64) -> Self {
        self.retry_after = Some(secs);
        self
    }

    /// The request takes effect (the write is stored) and only then is answered with the fault.
    pub fn after_commit(mut self) -> Self {
        self.commit = true;
        self
    }

    /// Only watch requests (`?watch=true`): lists and gets of the same path are answered truly, as
    /// when an API server's watch cache is not ready yet but etcd reads work.
    pub fn watches_only(mut self) -> Self {
        self.watches_only = true;
        self
    }

    /// Only the next `n` matching requests (default: all of them, until `clear_faults`).
    pub fn times(mut self, n: usize) -> Self {
        self.times = Some(n);
        self
    }

    fn matches(&self, method: &str, path: &str, watch: bool) -> bool {
        self.method == method
            && path.contains(&self.path_contains)
            && self.times != Some(0)
            && (watch || !self.watches_only)
    }

    fn response(&self) -> Response<Body> {
        let code = StatusCode::from_u16(self.code).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
        let reason = match self.code {
            429 => "TooManyRequests",
            500 => "InternalError",
            504 => "Timeout",
            _ => "ServiceUnavailable",
        };
        let mut r = status(code, reason, &format!("injected {} ({reason})", self.code));
        if let Some(secs) = self.retry_after
            && let Ok(v) = http::HeaderValue::from_str(&secs.to_string())
        {
            r.headers_mut().insert("retry-after", v);
        }
        r
    }
}

/// One request the server received, for tests that assert what a client sent.
#[derive(Clone, Debug)]
pub struct Logged {
    /// Who sent it: the name given to `client_as`, or `None` for `client()`.
    pub client: Option<String>,
    pub method: String,
    pub path: String,
    pub query: String,
    pub body: Value,
}

/// Why the fake could not give a test what it asked for.
#[derive(Debug, thiserror::Error)]
pub enum FakeError {
    #[error("cannot set up the fake API server: {0}")]
    Setup(#[from] std::io::Error),
    #[error("cannot start the local sandbox backend: {0}")]
    Backend(String),
    #[error("pod {namespace}/{name} was not created: {reason}")]
    Create {
        namespace: String,
        name: String,
        reason: StoreError,
    },
    #[error("pod {namespace}/{name} did not turn Ready within {waited:?}: {why}")]
    NotReady {
        namespace: String,
        name: String,
        waited: Duration,
        why: String,
    },
}

/// How the fake behaves where clusters differ; `FakeApiServer::builder()`.
#[derive(Clone, Debug)]
pub struct Builder {
    protocol: ExecProtocol,
    pod_start_latency: Duration,
    history: usize,
    bookmark_interval: Duration,
}

impl Default for Builder {
    fn default() -> Self {
        Self {
            protocol: ExecProtocol::V5,
            pod_start_latency: DEFAULT_POD_START_LATENCY,
            history: 10_000,
            bookmark_interval: Duration::from_secs(60),
        }
    }
}

/// Between a pod's creation and its container's start on a real node (scheduling aside): image
/// present, a gVisor sandbox created, the network set up.
pub const DEFAULT_POD_START_LATENCY: Duration = Duration::from_secs(2);

impl Builder {
    pub fn protocol(mut self, protocol: ExecProtocol) -> Self {
        self.protocol = protocol;
        self
    }

    /// How long after its creation a pod's container starts (default 2 s, as on a real node).
    pub fn pod_start_latency(mut self, latency: Duration) -> Self {
        self.pod_start_latency = latency;
        self
    }

    /// How many changes the fake remembers for watches to resume from: a watch from an older
    /// resourceVersion is answered `410 Gone` (default 10 000).
    pub fn watch_history(mut self, changes: usize) -> Self {
        self.history = changes;
        self
    }

    /// How often a watch that allows bookmarks gets one (default 60 s, about what the real server
    /// does).
    pub fn bookmark_interval(mut self, every: Duration) -> Self {
        self.bookmark_interval = every;
        self
    }

    pub async fn start(self) -> Result<FakeApiServer, FakeError> {
        FakeApiServer::start_with(self).await
    }
}

pub struct FakeApiServer {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    server: tokio::task::JoinHandle<()>,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// Set by `stop`; a fake dropped without it (a test that panicked) cleans up in `Drop`.
    stopped: bool,
    _state_dir: tempfile::TempDir,
}

/// A pod's running container: its runsc id and the handle that destroys it.
type PodSandbox = (String, Arc<dyn SandboxHandle>);

/// What the kubelet stand-in holds for one pod it runs.
struct PodRuntime {
    /// The container, while it runs (exec reaches it here).
    sandbox: Option<PodSandbox>,
    /// Set when the pod is deleted: by when its container must be gone.
    deletion: watch::Sender<Option<tokio::time::Instant>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

struct Shared {
    store: Store,
    backend: LocalBackend,
    runsc_root: PathBuf,
    pod_start_latency: Duration,
    /// The pods the kubelet stand-in runs, by "namespace/name".
    pods: Mutex<HashMap<String, PodRuntime>>,
    protocol: ExecProtocol,
    log: Mutex<Vec<Logged>>,
    writes: writes::Counter,
    /// The kubelet's Events by what makes them similar (pod, reason, message), to count repeats.
    kubelet_events: Mutex<HashMap<String, String>>,
    /// What each pod's exec received on stdin so far, by "namespace/name".
    stdin_seen: Mutex<HashMap<String, Vec<u8>>>,
    /// Every open connection and exec bridge, so `restart` can drop them all.
    connections: Mutex<Vec<tokio::task::AbortHandle>>,
    /// Injected faults, the first that matches a request answers it.
    faults: Mutex<Vec<Fault>>,
    /// Pods ("namespace/name") whose exec connections went half-open.
    half_open: Mutex<std::collections::HashSet<String>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl FakeApiServer {
    pub fn builder() -> Builder {
        Builder::default()
    }

    /// A fake with the defaults (a 2 s pod start latency) serving exec over `protocol`.
    pub async fn start(protocol: ExecProtocol) -> Result<Self, FakeError> {
        Self::builder().protocol(protocol).start().await
    }

    async fn start_with(b: Builder) -> Result<Self, FakeError> {
        let state_dir = tempfile::Builder::new()
            .prefix("sluice-fake-apiserver")
            .tempdir()?;
        let mut cfg = LocalConfig::new(state_dir.path());
        cfg.pod_shape = true;
        let backend = LocalBackend::new(cfg)
            .await
            .map_err(|e| FakeError::Backend(e.to_string()))?;
        let shared = Arc::new(Shared {
            store: Store::new(b.history, b.bookmark_interval),
            backend,
            runsc_root: state_dir.path().join("runsc"),
            pod_start_latency: b.pod_start_latency,
            pods: Mutex::default(),
            protocol: b.protocol,
            log: Mutex::default(),
            writes: writes::Counter::default(),
            kubelet_events: Mutex::default(),
            stdin_seen: Mutex::default(),
            connections: Mutex::default(),
            faults: Mutex::default(),
            half_open: Mutex::default(),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let s = shared.clone();
        let server = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                // As the real API server (Go) does: small exec frames must not wait for Nagle.
                let _ = tcp.set_nodelay(true);
                let s2 = s.clone();
                let conn = tokio::spawn(async move {
                    let s = s2;
                    let service = hyper::service::service_fn(move |req| {
                        let s = s.clone();
                        async move { Ok::<_, Infallible>(s.handle(req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tcp), service)
                        .with_upgrades()
                        .await;
                });
                s.track(conn.abort_handle());
            }
        });
        Ok(Self {
            addr,
            shared,
            server,
            tasks: Mutex::default(),
            stopped: false,
            _state_dir: state_dir,
        })
    }

    /// A kube client for this server (plain HTTP, no credentials).
    pub fn client(&self) -> kube_client_config::Client {
        kube_client_config::client(self.addr)
    }

    /// The kube configuration of this server (plain HTTP, no credentials), for a client built
    /// another way than kube's default (the gateway's own, `sluice_sandbox_kube::client`).
    pub fn config(&self) -> kube::Config {
        kube_client_config::config(self.addr)
    }

    /// A kube client whose requests are logged as `who`'s (`Logged::client`), so a test can tell
    /// which component asked for what (the RBAC each needs).
    pub fn client_as(&self, who: &str) -> kube_client_config::Client {
        kube_client_config::client_as(self.addr, who)
    }

    /// Creates or replaces an object (as `kubectl apply` would), bumping its resourceVersion. A pod
    /// put here is stored as given: no kubelet runs it (a static fixture).
    pub fn apply(&self, resource: Resource, object: Value) -> Value {
        self.shared.store.upsert(resource, object)
    }

    /// Creates a pod as a client's POST does: the scheduler and the kubelet stand-ins take it from
    /// there (start latency, container, probes).
    pub fn create_pod(&self, pod: Value) -> Result<Value, FakeError> {
        let namespace = pod["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default")
            .to_string();
        self.shared
            .create(Resource::Pods, &namespace, pod)
            .map_err(|(name, reason)| FakeError::Create {
                namespace,
                name,
                reason,
            })
    }

    /// Deletes an object, as `kubectl delete` would: a running pod gets its grace period and stays
    /// Terminating until its container is gone. True if it existed.
    pub async fn delete(&self, resource: Resource, namespace: &str, name: &str) -> bool {
        match resource {
            Resource::Pods => self.shared.delete_pod(namespace, name, None, None).is_ok(),
            r => self.shared.store.remove(r, namespace, name, None).is_ok(),
        }
    }

    pub fn get(&self, resource: Resource, namespace: &str, name: &str) -> Option<Value> {
        self.shared.store.get(resource, namespace, name)
    }

    pub fn list(&self, resource: Resource, namespace: &str) -> Vec<Value> {
        self.shared.store.list(resource, Some(namespace), None)
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Logged> {
        lock(&self.shared.log).clone()
    }

    /// Every write so far, by verb and resource (clients', the scheduler's and the kubelet's).
    pub fn writes(&self) -> Writes {
        self.shared.writes.snapshot()
    }

    /// Plays the operator once: creates a warm pod of `spec.chain`, labelled and shaped as the
    /// operator makes it, and waits until the kubelet stand-in has it Running and Ready. Returns
    /// the pod's name.
    pub async fn add_warm_pod(&self, spec: &SandboxSpec) -> Result<String, FakeError> {
        self.shared.add_warm_pod(spec).await
    }

    /// Plays the operator's backfill: keeps `n` warm pods of `spec.chain` until the server stops.
    /// (To run the real operator against this server instead, give it `client()`.)
    pub fn keep_warm(&self, spec: SandboxSpec, n: usize) {
        let s = self.shared.clone();
        let task = tokio::spawn(async move {
            let mut events = s.store.subscribe();
            loop {
                let warm = s
                    .store
                    .list(
                        Resource::Pods,
                        Some(&spec.namespace),
                        Some(&format!(
                            "sluice.dev/chain={},sluice.dev/pool=warm",
                            spec.chain
                        )),
                    )
                    .iter()
                    .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
                    .count();
                if warm < n {
                    if let Err(e) = s.add_warm_pod(&spec).await {
                        tracing::warn!(error = %e, "fake operator could not boot a pod");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    continue;
                }
                if events.recv().await.is_err() {
                    events = s.store.subscribe();
                }
            }
        });
        lock(&self.tasks).push(task);
    }

    /// The pod's container dies (its sandbox is destroyed) while the pod object stays: the kubelet
    /// stand-in reports it Failed, as after an OOM kill. Returns once the pod shows it.
    pub async fn kill_pod(&self, namespace: &str, name: &str) {
        let key = format!("{namespace}/{name}");
        let sandbox = lock(&self.shared.pods)
            .get_mut(&key)
            .and_then(|rt| rt.sandbox.take());
        if let Some((_, h)) = sandbox {
            h.destroy(true).await;
        }
        for _ in 0..600 {
            let finished = self.get(Resource::Pods, namespace, name).is_none_or(|p| {
                matches!(p["status"]["phase"].as_str(), Some("Failed" | "Succeeded"))
            });
            if finished {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tracing::warn!(pod = %key, "the killed pod's phase never showed it");
    }

    /// Everything the exec into this pod has received on stdin so far (the gateway's requests).
    pub fn stdin_of(&self, namespace: &str, name: &str) -> String {
        let seen = lock(&self.shared.stdin_seen);
        String::from_utf8_lossy(
            seen.get(&format!("{namespace}/{name}"))
                .map(Vec::as_slice)
                .unwrap_or_default(),
        )
        .into_owned()
    }

    /// What an API server restart looks like to clients: every open connection (watches, execs in
    /// flight) drops at once; new connections are served as before.
    pub fn restart(&self) {
        let open: Vec<tokio::task::AbortHandle> =
            lock(&self.shared.connections).drain(..).collect();
        for c in open {
            c.abort();
        }
    }

    /// From now on, requests that match `fault` get its answer instead of the real one.
    pub fn inject(&self, fault: Fault) {
        lock(&self.shared.faults).push(fault);
    }

    /// The exec connections into pod `namespace/name` go half-open, as when the API server's node
    /// vanishes without a FIN or RST: the connection stays open, but nothing sent on it arrives any
    /// more (stdin, pings) and nothing comes back from the pod.
    pub fn half_open(&self, namespace: &str, name: &str) {
        lock(&self.shared.half_open).insert(format!("{namespace}/{name}"));
    }

    /// Removes every injected fault: the server answers truly again.
    pub fn clear_faults(&self) {
        lock(&self.shared.faults).clear();
    }

    /// Runsc sandboxes of pods that still exist (once those of deleted pods have gone).
    pub async fn live_sandboxes(&self) -> Vec<String> {
        self.shared.settle().await;
        self.shared.backend.live().await
    }

    /// Stops backfill tasks and the kubelet, destroys every pod's container and stops serving.
    pub async fn stop(mut self) {
        for t in lock(&self.tasks).drain(..) {
            t.abort();
        }
        let runtimes: Vec<PodRuntime> = lock(&self.shared.pods).drain().map(|(_, rt)| rt).collect();
        let mut sandboxes = Vec::new();
        for mut rt in runtimes {
            if let Some(t) = rt.task.take() {
                t.abort();
            }
            if let Some((_, h)) = rt.sandbox.take() {
                sandboxes.push(h);
            }
        }
        // All at once: each is a `runsc delete` and waits for its processes, mostly idle time.
        futures::future::join_all(sandboxes.iter().map(|h| h.destroy(true))).await;
        self.shared.backend.clean_leftovers().await;
        self.server.abort();
        self.stopped = true;
    }

    /// Where the fake keeps its pods' sandboxes (their runsc root, bundles).
    pub fn state_dir(&self) -> &std::path::Path {
        self._state_dir.path()
    }
}

/// A test that fails panics before `stop`: the pods' sandboxes (real runsc containers, their
/// processes and cgroups) must not outlive it. Nothing can be awaited here, so they are
/// force-deleted with blocking runsc commands.
impl Drop for FakeApiServer {
    fn drop(&mut self) {
        if self.stopped {
            return;
        }
        for t in lock(&self.tasks).drain(..) {
            t.abort();
        }
        self.server.abort();
        for (_, rt) in lock(&self.shared.pods).drain() {
            if let Some(t) = rt.task {
                t.abort();
            }
        }
        let removed = self.shared.backend.clean_leftovers_blocking();
        if removed > 0 {
            tracing::warn!(
                removed,
                "the fake API server was dropped without stop(): its pods' sandboxes were force-deleted"
            );
        }
    }
}

impl Shared {
    /// A create (POST) of `object` in `namespace`: the name from `generateName` when it has none;
    /// a pod goes to the scheduler and kubelet stand-ins. On failure, the name and why.
    fn create(
        self: &Arc<Self>,
        resource: Resource,
        namespace: &str,
        mut object: Value,
    ) -> Result<Value, (String, StoreError)> {
        object["metadata"]["namespace"] = json!(namespace);
        if object["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .is_empty()
        {
            let prefix = object["metadata"]["generateName"]
                .as_str()
                .unwrap_or_default();
            object["metadata"]["name"] = json!(format!("{prefix}{}", self.store.next_suffix()));
        }
        let name = object["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if resource == Resource::Pods {
            object["status"] = json!({"phase": "Pending"});
            if let Some(spec) = object["spec"].as_object_mut() {
                spec.remove("nodeName");
            }
        }
        let created = self
            .store
            .create(resource, object)
            .map_err(|e| (name.clone(), e))?;
        if resource == Resource::Pods {
            let (deletion, rx) = watch::channel(None);
            let key = format!("{namespace}/{name}");
            // Registered before the kubelet starts, so its first look finds its own entry.
            let mut pods = lock(&self.pods);
            pods.insert(
                key.clone(),
                PodRuntime {
                    sandbox: None,
                    deletion,
                    task: None,
                },
            );
            let task = tokio::spawn(kubelet::run_pod(
                self.clone(),
                namespace.to_string(),
                name.clone(),
                rx,
            ));
            if let Some(rt) = pods.get_mut(&key) {
                rt.task = Some(task);
            }
        }
        Ok(created)
    }

    /// A pod DELETE: a pod no kubelet runs goes at once; a running one gets its grace period
    /// (`grace`, else its `terminationGracePeriodSeconds`, else 30 s) and stays Terminating until
    /// the kubelet stand-in has stopped its container. Deleting a Terminating pod keeps the earlier
    /// deadline. `precondition`: the resourceVersion the pod must have.
    fn delete_pod(
        &self,
        namespace: &str,
        name: &str,
        grace: Option<i64>,
        precondition: Option<&str>,
    ) -> Result<Value, StoreError> {
        let key = format!("{namespace}/{name}");
        let current = self
            .store
            .get(Resource::Pods, namespace, name)
            .ok_or(StoreError::NotFound)?;
        if precondition
            .is_some_and(|rv| current["metadata"]["resourceVersion"].as_str() != Some(rv))
        {
            return Err(StoreError::Conflict);
        }
        let deletion = lock(&self.pods).get(&key).map(|rt| rt.deletion.clone());
        let Some(deletion) = deletion else {
            return self
                .store
                .remove(Resource::Pods, namespace, name, precondition);
        };
        let grace = grace
            .or_else(|| current["spec"]["terminationGracePeriodSeconds"].as_i64())
            .unwrap_or(30)
            .max(0);
        let now = tokio::time::Instant::now();
        if grace == 0 {
            let gone = self
                .store
                .remove(Resource::Pods, namespace, name, precondition)?;
            deletion.send_replace(Some(now));
            return Ok(gone);
        }
        let deadline = now + Duration::from_secs(grace.unsigned_abs());
        if deletion.borrow().is_some_and(|earlier| earlier <= deadline) {
            return Ok(current);
        }
        let at = jiff::Timestamp::now()
            .checked_add(jiff::SignedDuration::from_secs(grace))
            .unwrap_or_else(|_| jiff::Timestamp::now())
            .round(jiff::Unit::Second)
            .unwrap_or_else(|_| jiff::Timestamp::now());
        let mut conflict = false;
        let marked = self.store.modify(Resource::Pods, namespace, name, |pod| {
            if precondition
                .is_some_and(|rv| pod["metadata"]["resourceVersion"].as_str() != Some(rv))
            {
                conflict = true;
                return false;
            }
            pod["metadata"]["deletionTimestamp"] = json!(at.to_string());
            pod["metadata"]["deletionGracePeriodSeconds"] = json!(grace);
            true
        });
        match marked {
            None => Err(StoreError::NotFound),
            Some(_) if conflict => Err(StoreError::Conflict),
            Some(pod) => {
                deletion.send_replace(Some(deadline));
                Ok(pod)
            }
        }
    }

    async fn add_warm_pod(self: &Arc<Self>, spec: &SandboxSpec) -> Result<String, FakeError> {
        let pod = json!({
            "metadata": {
                "generateName": format!("{}-", spec.chain),
                "namespace": spec.namespace,
                "labels": {
                    "app.kubernetes.io/name": "sluice-sandbox",
                    "app.kubernetes.io/managed-by": "sluice-operator",
                    "sluice.dev/chain": spec.chain,
                    "sluice.dev/chain-namespace": spec.namespace,
                    "sluice.dev/template": "fake",
                    "sluice.dev/pool": "warm",
                },
                "ownerReferences": [{
                    "apiVersion": "sluice.dev/v1alpha1", "kind": "HookChain", "name": spec.chain,
                    "uid": format!("uid-{}-{}", spec.namespace, spec.chain), "controller": true,
                }],
            },
            "spec": {
                "runtimeClassName": "gvisor",
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 1,
                "containers": [{
                    "name": "supervisor", "image": "sluice-supervisor:fake",
                    "command": sandbox_pod::supervisor_command(
                        sluice_crds::quantity::memory_bytes(&spec.memory).unwrap_or(256 << 20),
                        spec.pids,
                    ),
                    "resources": {"requests": {"cpu": spec.cpu}, "limits": {"cpu": spec.cpu_limit.as_deref().unwrap_or(spec.cpu.as_str())}},
                    // As the operator's pods: a startup probe every second until it passes, then
                    // nothing (an attached pod is not probed).
                    "startupProbe": {
                        "exec": {"command": sandbox_pod::probe_command()},
                        "periodSeconds": 1, "timeoutSeconds": 5,
                        "failureThreshold": 300, "successThreshold": 1,
                    },
                }],
            },
        });
        let mut events = self.store.subscribe();
        let created =
            self.create(Resource::Pods, &spec.namespace, pod)
                .map_err(|(name, reason)| FakeError::Create {
                    namespace: spec.namespace.clone(),
                    name,
                    reason,
                })?;
        self.writes.count(writes::Verb::Create, "pods");
        let name = created["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let waited = self.pod_start_latency + Duration::from_secs(60);
        let deadline = tokio::time::Instant::now() + waited;
        let why = loop {
            let pod = self.store.get(Resource::Pods, &spec.namespace, &name);
            let Some(pod) = pod else {
                break "the pod was deleted".to_string();
            };
            let ready = pod["status"]["conditions"].as_array().is_some_and(|cs| {
                cs.iter()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True")
            });
            if ready {
                return Ok(name);
            }
            if let Some(phase @ ("Failed" | "Succeeded")) = pod["status"]["phase"].as_str() {
                break format!(
                    "the pod ended {phase}: {}",
                    pod["status"]["containerStatuses"]
                );
            }
            match tokio::time::timeout_at(deadline, events.recv()).await {
                Err(_) => break "its readiness probe never passed".to_string(),
                Ok(Err(tokio::sync::broadcast::error::RecvError::Closed)) => {
                    break "the server stopped".to_string();
                }
                Ok(_) => {}
            }
        };
        let _ = self.delete_pod(&spec.namespace, &name, Some(0), None);
        Err(FakeError::NotReady {
            namespace: spec.namespace.clone(),
            name,
            waited,
            why,
        })
    }

    /// Waits (a bounded while) until the containers of deleted pods are gone.
    async fn settle(&self) {
        for _ in 0..1200 {
            let terminating = lock(&self.pods)
                .values()
                .any(|rt| rt.deletion.borrow().is_some());
            if !terminating {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A pod's command as it runs in a local sandbox: `/opt/sluice/` of the image is `/sluice/`
    /// there.
    fn in_sandbox(&self, command: &[String]) -> Vec<String> {
        command
            .iter()
            .map(|a| match a.strip_prefix("/opt/sluice/") {
                Some(file) => format!("/sluice/{file}"),
                None => a.to_string(),
            })
            .collect()
    }

    /// Starts `command` in pod `namespace/name`'s container, stdio piped: an exec.
    pub(crate) async fn exec(
        &self,
        namespace: &str,
        name: &str,
        command: &[String],
    ) -> Result<tokio::process::Child, String> {
        let id = lock(&self.pods)
            .get(&format!("{namespace}/{name}"))
            .and_then(|rt| rt.sandbox.as_ref().map(|(id, _)| id.clone()))
            .ok_or_else(|| format!("pod {namespace}/{name} has no running container"))?;
        self.backend
            .exec(&id, &self.in_sandbox(command))
            .await
            .map_err(|e| e.to_string())
    }

    pub(crate) fn is_half_open(&self, key: &str) -> bool {
        lock(&self.half_open).contains(key)
    }

    pub(crate) fn track(&self, task: tokio::task::AbortHandle) {
        let mut open = lock(&self.connections);
        open.retain(|t| !t.is_finished());
        open.push(task);
    }

    fn log(&self, client: &Option<String>, method: &str, path: &str, query: &str, body: &Value) {
        lock(&self.log).push(Logged {
            client: client.clone(),
            method: method.into(),
            path: path.into(),
            query: query.into(),
            body: body.clone(),
        });
    }

    async fn handle(self: &Arc<Self>, req: Request<hyper::body::Incoming>) -> Response<Body> {
        let method = req.method().clone();
        let path = req.uri().path().to_string();
        let query = req.uri().query().unwrap_or_default().to_string();
        let client = req
            .headers()
            .get(CLIENT_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let fault = {
            let mut faults = lock(&self.faults);
            faults
                .iter_mut()
                .find(|f| f.matches(method.as_str(), &path, is_watch(&query)))
                .map(|f| {
                    if let Some(n) = f.times.as_mut() {
                        *n -= 1;
                    }
                    f.clone()
                })
        };
        if let Some(f) = fault {
            if f.commit {
                // Done as asked, answered as if it had failed.
                let _ = Box::pin(self.serve(req, method, path, query, client)).await;
            } else {
                self.log(&client, method.as_str(), &path, &query, &Value::Null);
            }
            return f.response();
        }
        self.serve(req, method, path, query, client).await
    }

    async fn serve(
        self: &Arc<Self>,
        req: Request<hyper::body::Incoming>,
        method: hyper::Method,
        path: String,
        query: String,
        client: Option<String>,
    ) -> Response<Body> {
        let params = store::query_params(&query);
        let Some(route) = store::Route::parse(&path) else {
            return status(
                StatusCode::NOT_FOUND,
                "NotFound",
                &format!("no route {path}"),
            );
        };
        if route.subresource.as_deref() == Some("exec") {
            self.log(&client, method.as_str(), &path, &query, &Value::Null);
            self.writes.count(Verb::Create, "pods/exec");
            return exec::upgrade(self.clone(), route, params, req).await;
        }
        let content_type = req
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        let raw = match req.into_body().collect().await {
            Ok(b) => b.to_bytes(),
            Err(_) => Bytes::new(),
        };
        let body: Value = serde_json::from_slice(&raw).unwrap_or(Value::Null);
        self.log(&client, method.as_str(), &path, &query, &body);
        let verb = Verb::of_method(method.as_str());
        if let Some(verb) = verb {
            self.writes.count(verb, &route.audit_resource());
        }
        let ns = route.namespace.clone().unwrap_or_default();
        let part = match route.subresource.as_deref() {
            None => Part::Main,
            Some("status") => Part::Status,
            Some(other) => {
                return status(
                    StatusCode::NOT_FOUND,
                    "NotFound",
                    &format!(
                        "the fake serves no {} subresource {other}",
                        route.resource.plural()
                    ),
                );
            }
        };
        let json_patch = content_type.starts_with("application/json-patch");
        let needs_object = matches!(method.as_str(), "POST" | "PUT" | "PATCH") && !json_patch;
        if needs_object && !body.is_object() {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "the request body is not a JSON object",
            );
        }
        let selector = params.get("labelSelector").map(String::as_str);
        let answer = |r: Result<Value, StoreError>, name: &str, code: StatusCode| match r {
            Ok(o) => json_response(code, &o),
            Err(e) => store_error(route.resource, name, &e),
        };
        match (method.as_str(), &route.name) {
            ("GET", None) if is_watch(&query) => {
                let flag = |k: &str| params.get(k).is_some_and(|v| v == "true" || v == "1");
                self.store.watch(
                    route.resource,
                    WatchParams {
                        namespace: route.namespace.clone(),
                        selector: selector.map(str::to_string),
                        since: params.get("resourceVersion").and_then(|v| v.parse().ok()),
                        bookmarks: flag("allowWatchBookmarks"),
                        send_initial_events: flag("sendInitialEvents"),
                    },
                )
            }
            ("GET", None) => json_response(
                StatusCode::OK,
                &self
                    .store
                    .list_response(route.resource, route.namespace.as_deref(), selector),
            ),
            ("GET", Some(name)) => match self.store.get(route.resource, &ns, name) {
                Some(o) => json_response(StatusCode::OK, &o),
                None => not_found(route.resource, name),
            },
            ("POST", None) => match self.create(route.resource, &ns, body) {
                Ok(o) => json_response(StatusCode::CREATED, &o),
                Err((name, e)) => store_error(route.resource, &name, &e),
            },
            ("PUT", Some(name)) => answer(
                self.store.replace(route.resource, part, &ns, name, &body),
                name,
                StatusCode::OK,
            ),
            ("PATCH", Some(name)) => {
                let apply = content_type.starts_with("application/apply-patch");
                if content_type.starts_with("application/json-patch") {
                    return answer(
                        self.store
                            .json_patch(route.resource, part, &ns, name, &body),
                        name,
                        StatusCode::OK,
                    );
                }
                answer(
                    self.store
                        .patch(route.resource, part, &ns, name, &body, apply),
                    name,
                    StatusCode::OK,
                )
            }
            ("DELETE", Some(name)) => {
                let precondition = body["preconditions"]["resourceVersion"].as_str();
                let grace = body["gracePeriodSeconds"].as_i64().or_else(|| {
                    params
                        .get("gracePeriodSeconds")
                        .and_then(|g| g.parse().ok())
                });
                let r = match route.resource {
                    Resource::Pods => self.delete_pod(&ns, name, grace, precondition),
                    r => self.store.remove(r, &ns, name, precondition),
                };
                answer(r, name, StatusCode::OK)
            }
            _ => status(
                StatusCode::METHOD_NOT_ALLOWED,
                "MethodNotAllowed",
                &format!("{method} {path} is not served by the fake API server"),
            ),
        }
    }
}

/// True if a request's query string asks for a watch.
fn is_watch(query: &str) -> bool {
    matches!(
        store::query_params(query).get("watch").map(String::as_str),
        Some("true" | "1")
    )
}

fn store_error(resource: Resource, name: &str, e: &StoreError) -> Response<Body> {
    let plural = resource.plural();
    match e {
        StoreError::NotFound => not_found(resource, name),
        StoreError::Conflict => status(
            StatusCode::CONFLICT,
            "Conflict",
            &format!("Operation cannot be fulfilled on {plural} \"{name}\": {e}"),
        ),
        StoreError::AlreadyExists => status(
            StatusCode::CONFLICT,
            "AlreadyExists",
            &format!("{plural} \"{name}\" already exists"),
        ),
    }
}

pub(crate) fn json_response(code: StatusCode, v: &Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(v.to_string())).boxed())
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new()).boxed()))
}

pub(crate) fn status(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    json_response(
        code,
        &json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": message, "reason": reason, "code": code.as_u16(),
        }),
    )
}

fn not_found(resource: Resource, name: &str) -> Response<Body> {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        &format!("{} \"{name}\" not found", resource.plural()),
    )
}

/// The header `client_as` clients send their name in.
const CLIENT_HEADER: &str = "x-sluice-fake-client";

/// Building a kube client for a plain-HTTP server.
pub mod kube_client_config {
    pub type Client = kube::Client;
    pub fn client(addr: std::net::SocketAddr) -> kube::Client {
        kube::Client::try_from(config(addr)).expect("a plain HTTP kube client always builds")
    }

    pub fn client_as(addr: std::net::SocketAddr, who: &str) -> kube::Client {
        let mut config = config(addr);
        if let Ok(value) = http::HeaderValue::from_str(who) {
            config
                .headers
                .push((http::HeaderName::from_static(super::CLIENT_HEADER), value));
        }
        kube::Client::try_from(config).expect("a plain HTTP kube client always builds")
    }

    pub fn config(addr: std::net::SocketAddr) -> kube::Config {
        let url: http::Uri = format!("http://{addr}")
            .parse()
            .expect("a socket address makes a valid URI");
        kube::Config::new(url)
    }
}
