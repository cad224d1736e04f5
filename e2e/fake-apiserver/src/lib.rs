//! A small in-memory Kubernetes API server for tests and benchmarks of the gateway's `kube` backend,
//! where no cluster can run. It serves, over real HTTP, the few things the gateway uses, with the
//! semantics the real API server has for them:
//!
//! - list and watch (`?watch=true`, JSON lines, resumable from a `resourceVersion`, label selectors)
//!   of pods, HookChains and Capabilities;
//! - merge PATCH with the optimistic-concurrency precondition (`metadata.resourceVersion` in the patch
//!   must match, else 409 Conflict) and DELETE;
//! - `pods/{name}/exec` over websocket, speaking the real channel protocol (`v5.channel.k8s.io` with
//!   its CLOSE signal, or `v4.channel.k8s.io`; channel 0 stdin, 1 stdout, 2 stderr, 3 a `Status` at
//!   exit).
//!
//! A pod here is a real local runsc sandbox started the way the operator's pod starts: its main
//! process is the supervisor listening for one attach (`supervisor.py --listen`), and it is published
//! Ready once its readiness probe (`attach.py --probe`, run with `runsc exec` as a kubelet would)
//! passes. Exec runs the requested command in the sandbox with `runsc exec` and bridges its stdio to
//! the websocket, so the gateway runs real chains through the real relay over real framing. Deleting
//! or killing the pod destroys the sandbox, and an exec in flight sees its process die.

mod exec;
mod store;

pub use store::Resource;

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
use std::sync::{Arc, Mutex};
use store::Store;
use tokio::io::AsyncReadExt;

pub type Body = BoxBody<Bytes, Infallible>;

/// Which websocket subprotocols the exec endpoint accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExecProtocol {
    /// Prefer v5 (the client's stdin CLOSE signal), fall back to v4: what current clusters do.
    V5,
    /// Only v4, as clusters before Kubernetes 1.30 do.
    V4,
}

/// One request the server received, for tests that assert what a client sent.
#[derive(Clone, Debug)]
pub struct Logged {
    pub method: String,
    pub path: String,
    pub query: String,
    pub body: Value,
}

pub struct FakeApiServer {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    server: tokio::task::JoinHandle<()>,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    _state_dir: tempfile::TempDir,
}

/// A pod's sandbox: its runsc id and the handle that destroys it.
type PodSandbox = (String, Arc<dyn SandboxHandle>);

struct Shared {
    store: Store,
    backend: LocalBackend,
    /// Every pod's sandbox (its runsc id and handle), to exec into it and destroy it with its pod.
    handles: Mutex<HashMap<String, PodSandbox>>,
    protocol: ExecProtocol,
    log: Mutex<Vec<Logged>>,
    /// What each pod's exec received on stdin so far, by "namespace/name".
    stdin_seen: Mutex<HashMap<String, Vec<u8>>>,
    /// Every open connection and exec bridge, so `restart` can drop them all.
    connections: Mutex<Vec<tokio::task::AbortHandle>>,
    /// Sandboxes of deleted pods still going away (a DELETE answers at once, as the real one does).
    teardowns: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl FakeApiServer {
    pub async fn start(protocol: ExecProtocol) -> anyhow::Result<Self> {
        let state_dir = tempfile::Builder::new()
            .prefix("sluice-fake-apiserver")
            .tempdir()?;
        let mut cfg = LocalConfig::new(state_dir.path());
        cfg.pod_shape = true;
        let backend = LocalBackend::new(cfg).await?;
        let shared = Arc::new(Shared {
            store: Store::new(),
            backend,
            handles: Mutex::default(),
            protocol,
            log: Mutex::default(),
            stdin_seen: Mutex::default(),
            connections: Mutex::default(),
            teardowns: Mutex::default(),
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
            _state_dir: state_dir,
        })
    }

    /// A kube client for this server (plain HTTP, no credentials).
    pub fn client(&self) -> kube_client_config::Client {
        kube_client_config::client(self.addr)
    }

    /// Creates or replaces an object (as `kubectl apply` would), bumping its resourceVersion.
    pub fn apply(&self, resource: Resource, object: Value) -> Value {
        self.shared.store.upsert(resource, object)
    }

    /// Removes an object, as `kubectl delete` would (a pod's sandbox goes with it).
    pub async fn delete(&self, resource: Resource, namespace: &str, name: &str) -> bool {
        let gone = self
            .shared
            .store
            .delete(resource, namespace, name)
            .is_some();
        if resource == Resource::Pods {
            self.shared.destroy_pod(namespace, name).await;
        }
        gone
    }

    pub fn get(&self, resource: Resource, namespace: &str, name: &str) -> Option<Value> {
        self.shared.store.get(resource, namespace, name)
    }

    pub fn list(&self, resource: Resource, namespace: &str) -> Vec<Value> {
        self.shared.store.list(resource, Some(namespace), None)
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Logged> {
        self.shared
            .log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Plays the operator once: boots a sandbox for a warm pod of `spec.chain` and publishes the pod
    /// Running and Ready, labelled as the operator labels it. Returns the pod's name.
    pub async fn add_warm_pod(&self, spec: &SandboxSpec) -> anyhow::Result<String> {
        self.shared.add_warm_pod(spec).await
    }

    /// Plays the operator's backfill: keeps `n` warm pods of `spec.chain` until the server stops.
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
                    .len();
                if warm < n {
                    if let Err(e) = s.add_warm_pod(&spec).await {
                        tracing::warn!(error = %e, "fake operator could not boot a pod");
                        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                    }
                    continue;
                }
                if events.recv().await.is_err() {
                    events = s.store.subscribe();
                }
            }
        });
        self.tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(task);
    }

    /// The pod's container dies (its sandbox is destroyed) while the pod object stays, phase Failed:
    /// what an OOM kill or a node problem looks like to the gateway.
    pub async fn kill_pod(&self, namespace: &str, name: &str) {
        self.shared.destroy_pod(namespace, name).await;
        if let Some(mut pod) = self.shared.store.get(Resource::Pods, namespace, name) {
            pod["status"] =
                json!({"phase": "Failed", "conditions": [{"type": "Ready", "status": "False"}]});
            self.shared.store.upsert(Resource::Pods, pod);
        }
    }

    /// Everything the exec into this pod has received on stdin so far (the gateway's requests).
    pub fn stdin_of(&self, namespace: &str, name: &str) -> String {
        let seen = self
            .shared
            .stdin_seen
            .lock()
            .unwrap_or_else(|p| p.into_inner());
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
        let open: Vec<tokio::task::AbortHandle> = self
            .shared
            .connections
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
            .collect();
        for c in open {
            c.abort();
        }
    }

    /// Runsc sandboxes of pods that still exist (once those of deleted pods have gone).
    pub async fn live_sandboxes(&self) -> Vec<String> {
        self.shared.settle().await;
        self.shared.backend.live().await
    }

    /// Stops backfill tasks, destroys every pod's sandbox and stops serving.
    pub async fn stop(self) {
        for t in self
            .tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            t.abort();
        }
        let keys: Vec<String> = self
            .shared
            .handles
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        for k in keys {
            if let Some((ns, name)) = k.split_once('/') {
                self.shared.destroy_pod(ns, name).await;
            }
        }
        self.shared.settle().await;
        self.shared.backend.clean_leftovers().await;
        self.server.abort();
    }
}

impl Shared {
    async fn add_warm_pod(&self, spec: &SandboxSpec) -> anyhow::Result<String> {
        let name = format!("{}-{}", spec.chain, self.store.next_suffix());
        let key = format!("{}/{name}", spec.namespace);
        let sandbox = self.backend.start(spec).await?;
        // The container's log (the supervisor's own lines): read, so it never blocks.
        let mut log = sandbox.protocol;
        tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            while let Ok(n) = log.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                tracing::debug!(log = %String::from_utf8_lossy(&buf[..n]).trim_end(), "fake pod");
            }
        });
        let id = sandbox.id.clone();
        let handle: Arc<dyn SandboxHandle> = Arc::from(sandbox.handle);
        // As the kubelet: the pod is Ready (and published) once its readiness probe passes.
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let Err(last) = self.probe(&id).await else {
                break;
            };
            if tokio::time::Instant::now() >= deadline {
                handle.destroy(true).await;
                anyhow::bail!("the readiness probe of a fake pod never passed: {last}");
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        self.handles
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, (id, handle));
        let pod = json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": spec.namespace,
                "labels": {
                    "app.kubernetes.io/name": "sluice-sandbox",
                    "app.kubernetes.io/managed-by": "sluice-operator",
                    "sluice.dev/chain": spec.chain,
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
                "containers": [{
                    "name": "supervisor", "image": "sluice-supervisor:fake",
                    "command": sandbox_pod::supervisor_command(
                        sluice_crds::quantity::memory_bytes(&spec.memory).unwrap_or(256 << 20),
                        spec.pids,
                    ),
                    "readinessProbe": {"exec": {"command": sandbox_pod::probe_command()}},
                }],
            },
            "status": {
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        });
        self.store.upsert(Resource::Pods, pod);
        Ok(name)
    }

    /// The pod's sandbox, no longer reachable by exec.
    fn take_sandbox(&self, namespace: &str, name: &str) -> Option<Arc<dyn SandboxHandle>> {
        self.handles
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&format!("{namespace}/{name}"))
            .map(|(_, h)| h)
    }

    async fn destroy_pod(&self, namespace: &str, name: &str) {
        if let Some(h) = self.take_sandbox(namespace, name) {
            h.destroy(true).await;
        }
    }

    /// A pod deleted through the API: like a kubelet, its container gets a grace period to end (the
    /// supervisor ends by itself once its session is over), in the background.
    fn terminate_pod(&self, namespace: &str, name: &str) {
        if let Some(h) = self.take_sandbox(namespace, name) {
            let task = tokio::spawn(async move { h.destroy(false).await });
            let mut pending = self.teardowns.lock().unwrap_or_else(|p| p.into_inner());
            pending.retain(|t| !t.is_finished());
            pending.push(task);
        }
    }

    /// Waits until the sandboxes of deleted pods are gone.
    async fn settle(&self) {
        let pending: Vec<_> = self
            .teardowns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
            .collect();
        for t in pending {
            let _ = t.await;
        }
    }

    /// Runs the pod's readiness probe command in sandbox `id`, as the kubelet runs exec probes.
    async fn probe(&self, id: &str) -> Result<(), String> {
        let child = self
            .backend
            .exec(id, &self.in_sandbox(&sandbox_pod::probe_command()))
            .await
            .map_err(|e| e.to_string())?;
        let out = tokio::time::timeout(std::time::Duration::from_secs(5), child.wait_with_output())
            .await
            .map_err(|_| "the probe timed out".to_string())?
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
        }
    }

    /// A pod's command as it runs in a local sandbox: the image's `python3` is the backend's
    /// interpreter, and `/opt/sluice/` of the image is `/sluice/` there.
    fn in_sandbox(&self, command: &[String]) -> Vec<String> {
        command
            .iter()
            .map(|a| match a.as_str() {
                "python3" => self.backend.python().to_string_lossy().into_owned(),
                a => match a.strip_prefix("/opt/sluice/") {
                    Some(file) => format!("/sluice/{file}"),
                    None => a.to_string(),
                },
            })
            .collect()
    }

    /// Starts `command` in pod `namespace/name`'s sandbox, stdio piped: an exec.
    pub(crate) async fn exec(
        &self,
        namespace: &str,
        name: &str,
        command: &[String],
    ) -> Result<tokio::process::Child, String> {
        let id = self
            .handles
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&format!("{namespace}/{name}"))
            .map(|(id, _)| id.clone())
            .ok_or_else(|| format!("pod {namespace}/{name} has no running container"))?;
        self.backend
            .exec(&id, &self.in_sandbox(command))
            .await
            .map_err(|e| e.to_string())
    }

    pub(crate) fn track(&self, task: tokio::task::AbortHandle) {
        let mut open = self.connections.lock().unwrap_or_else(|p| p.into_inner());
        open.retain(|t| !t.is_finished());
        open.push(task);
    }

    fn log(&self, method: &str, path: &str, query: &str, body: &Value) {
        self.log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Logged {
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
        let params = store::query_params(&query);
        let Some(route) = store::Route::parse(&path) else {
            return status(
                StatusCode::NOT_FOUND,
                "NotFound",
                &format!("no route {path}"),
            );
        };
        if route.subresource.as_deref() == Some("exec") {
            self.log(method.as_str(), &path, &query, &Value::Null);
            return exec::upgrade(self.clone(), route, params, req).await;
        }
        let body: Value = match req.into_body().collect().await {
            Ok(b) => serde_json::from_slice(&b.to_bytes()).unwrap_or(Value::Null),
            Err(_) => Value::Null,
        };
        self.log(method.as_str(), &path, &query, &body);
        let selector = params.get("labelSelector").map(String::as_str);
        match (method.as_str(), &route.name) {
            ("GET", None)
                if matches!(params.get("watch").map(String::as_str), Some("true" | "1")) =>
            {
                let since = params
                    .get("resourceVersion")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                self.store.watch(
                    route.resource,
                    route.namespace.clone(),
                    selector.map(str::to_string),
                    since,
                )
            }
            ("GET", None) => json_response(
                StatusCode::OK,
                &self
                    .store
                    .list_response(route.resource, route.namespace.as_deref(), selector),
            ),
            ("GET", Some(name)) => match self.store.get(
                route.resource,
                route.namespace.as_deref().unwrap_or_default(),
                name,
            ) {
                Some(o) => json_response(StatusCode::OK, &o),
                None => not_found(route.resource, name),
            },
            ("PATCH", Some(name)) => {
                let ns = route.namespace.clone().unwrap_or_default();
                match self.store.merge_patch(route.resource, &ns, name, &body) {
                    Ok(o) => json_response(StatusCode::OK, &o),
                    Err(store::PatchError::NotFound) => not_found(route.resource, name),
                    Err(store::PatchError::Conflict) => status(
                        StatusCode::CONFLICT,
                        "Conflict",
                        &format!(
                            "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
                            route.resource.plural()
                        ),
                    ),
                }
            }
            ("DELETE", Some(name)) => {
                let ns = route.namespace.clone().unwrap_or_default();
                let gone = self.store.delete(route.resource, &ns, name);
                if route.resource == Resource::Pods {
                    self.terminate_pod(&ns, name);
                }
                match gone {
                    Some(o) => json_response(StatusCode::OK, &o),
                    None => not_found(route.resource, name),
                }
            }
            _ => status(
                StatusCode::METHOD_NOT_ALLOWED,
                "MethodNotAllowed",
                &format!("{method} {path} is not served by the fake API server"),
            ),
        }
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

/// Building a kube client for a plain-HTTP server.
pub mod kube_client_config {
    pub type Client = kube::Client;
    pub fn client(addr: std::net::SocketAddr) -> kube::Client {
        let url: http::Uri = format!("http://{addr}")
            .parse()
            .expect("a socket address makes a valid URI");
        let config = kube::Config::new(url);
        kube::Client::try_from(config).expect("a plain HTTP kube client always builds")
    }
}
