//! The `kube` sandbox backend: the operator keeps warm gVisor pods per HookChain; the gateway claims
//! one (`claim.rs`) and attaches to its supervisor over the exec API (`exec.rs`) for as long as it
//! holds it: with `reuse: Recycle` the pod serves trigger point after trigger point, each in a fresh
//! cell, over the one exec stream, and is deleted when the pool retires it (`maxUses`, a dirty
//! verdict, a broken stream, idle past the bound); with `reuse: None` after its one trigger point.
//! No API-server write is on a trigger point's path. Pods are found through a watch cache of the
//! pods the operator manages; the claim itself never trusts the cache (see `claim.rs`).

use crate::claim;
use crate::exec;
use crate::labels;
use crate::watch::{Tasks, apis};
use async_trait::async_trait;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use prometheus::IntCounterVec;
use sluice_crds::watch::WatchBackoff;
use sluice_sandbox::{
    Sandbox, SandboxBackend, SandboxHandle, SandboxSpec, StartError, StartFailure,
};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

#[derive(Clone, Debug)]
pub struct KubeConfig {
    /// Who claims: the gateway pod's name, recorded on every claimed pod.
    pub identity: String,
    /// Watch and claim only in these namespaces (empty: all namespaces).
    pub namespaces: Vec<String>,
    /// Serve only the HookChains and Capabilities this label selector matches (the operator's
    /// `--selector`): several releases share a cluster's namespaces by label. None: all.
    pub selector: Option<String>,
    /// Where the operator keeps every sandbox pod (its `--sandbox-namespace`): pods are watched,
    /// claimed and exec'd into there only. `None`: beside their HookChains, in `namespaces`.
    pub sandbox_namespace: Option<String>,
    /// How long one claim waits for a warm pod to appear.
    pub claim_timeout: Duration,
    /// The RuntimeClass a pod must run under to be claimed (the operator's `--runtime-class`);
    /// None trusts any.
    pub runtime_class: Option<String>,
    /// How often a held pod's `claimed-at` is renewed, so that a long stream is not taken for the
    /// claim of a crashed gateway by the operator's claim deadline.
    pub heartbeat: Duration,
    /// Pods per chain (at most its `pool.warm`) this gateway keeps claimed and attached ahead of
    /// demand, so that a run pays neither the claim PATCH nor the exec handshake. 0: claim per run.
    pub hold: usize,
    /// How long the exec into a claimed pod may take to open (the kube client would retry a 429 or
    /// 503 on it for many minutes); past it the pod is given back (deleted) and the boot fails.
    pub exec_timeout: Duration,
    /// The exec connection's heartbeat: a held pod's connection that stops answering is dropped
    /// (and the pod retired), whether it waits or serves a run.
    pub exec_keepalive: exec::Keepalive,
    /// How often this gateway writes its shadow comparison into a chain's `status.rollout.shadow`
    /// while a shadow candidate runs (only when it changed).
    pub shadow_status_every: Duration,
}

impl KubeConfig {
    /// The namespaces whose pods this gateway watches: the sandbox namespace alone, or `namespaces`.
    fn pod_namespaces(&self) -> Vec<String> {
        match &self.sandbox_namespace {
            Some(ns) => vec![ns.clone()],
            None => self.namespaces.clone(),
        }
    }

    /// The namespace of the pods of chains in `chain_namespace`.
    fn pod_namespace<'a>(&'a self, chain_namespace: &'a str) -> &'a str {
        self.sandbox_namespace.as_deref().unwrap_or(chain_namespace)
    }

    pub fn new(identity: impl Into<String>) -> Self {
        Self {
            identity: identity.into(),
            namespaces: Vec::new(),
            selector: None,
            sandbox_namespace: None,
            claim_timeout: Duration::from_secs(2),
            runtime_class: Some("gvisor".into()),
            heartbeat: Duration::from_secs(60),
            hold: 0,
            exec_timeout: Duration::from_secs(20),
            exec_keepalive: exec::Keepalive::default(),
            shadow_status_every: Duration::from_secs(15),
        }
    }
}

pub struct KubeBackend {
    client: kube::Client,
    cfg: KubeConfig,
    /// One watch cache per watched namespace (one in all for a cluster-wide gateway).
    pods: Vec<Store<Pod>>,
    /// Woken on every change the pod watch sees: a claim waiting for a warm pod looks again.
    changed: Arc<Notify>,
    /// Pod watches whose last word was an error: they are retrying, and their cache may be behind
    /// the API server (after an API server restart, by a whole relist). While any is, a claim reads
    /// the chain's pods from the API server instead of the cache.
    failing: Arc<AtomicUsize>,
    /// Pods this gateway claimed and has not yet seen deleted: "namespace/name".
    live: Arc<Mutex<HashSet<String>>>,
    /// Nodes where an exec into a claimed pod failed lately, and when: their pods are tried last
    /// (a lost node's kubelet refuses every exec, and the node controller takes a minute to say so).
    suspect: Arc<Mutex<HashMap<String, Instant>>>,
    /// Claim attempts by result (`sluice_gateway_pod_claims_total`).
    claims: IntCounterVec,
    _watches: Tasks,
}

fn selector() -> String {
    format!("{}={}", labels::LABEL_MANAGED_BY, labels::OPERATOR)
}

impl KubeBackend {
    /// Starts the pod watch and waits (up to `sync_timeout`) for its first full list. `claims`
    /// counts claim attempts by `result` (the engine's `sluice_gateway_pod_claims_total`).
    pub async fn new(
        client: kube::Client,
        cfg: KubeConfig,
        claims: IntCounterVec,
        sync_timeout: Duration,
    ) -> anyhow::Result<Self> {
        let changed = Arc::new(Notify::new());
        let failing = Arc::new(AtomicUsize::new(0));
        let mut pods = Vec::new();
        let mut watches = Vec::new();
        for api in apis::<Pod>(&client, &cfg.pod_namespaces()) {
            let (store, writer) = reflector::store();
            let stream = reflector::reflector(
                writer,
                watcher(api, watcher::Config::default().labels(&selector()))
                    .backoff(WatchBackoff::default()),
            );
            let notify = changed.clone();
            let failing = failing.clone();
            watches.push(tokio::spawn(async move {
                let mut stream = std::pin::pin!(stream);
                let mut failed = false;
                while let Some(event) = stream.next().await {
                    match event {
                        Ok(event) => {
                            // Mid-relist the cache still holds the old list (it is swapped at
                            // `InitDone`): it is current again only after that, or a watch event.
                            let relisting = matches!(
                                event,
                                watcher::Event::Init | watcher::Event::InitApply(_)
                            );
                            if !relisting && std::mem::take(&mut failed) {
                                failing.fetch_sub(1, Ordering::Relaxed);
                            }
                            notify.notify_waiters();
                        }
                        Err(e) => {
                            if !std::mem::replace(&mut failed, true) {
                                failing.fetch_add(1, Ordering::Relaxed);
                            }
                            tracing::warn!(error = %e, "pod watch failed; retrying");
                            // Claims waiting on the cache read the API server from now on.
                            notify.notify_waiters();
                        }
                    }
                }
            }));
            pods.push(store);
        }
        let synced = futures::future::join_all(pods.iter().map(|s| s.wait_until_ready()));
        if tokio::time::timeout(sync_timeout, synced).await.is_err() {
            for w in &watches {
                w.abort();
            }
            anyhow::bail!(
                "the pod watch did not sync within {sync_timeout:?}: is the API server reachable and may this service account list pods?"
            );
        }
        Ok(Self {
            client,
            cfg,
            pods,
            changed,
            failing,
            live: Arc::default(),
            suspect: Arc::default(),
            claims,
            _watches: Tasks(watches),
        })
    }

    /// Claims a warm pod of the spec's chain, waiting up to the claim timeout for one.
    pub async fn claim(&self, spec: &SandboxSpec) -> Result<(Api<Pod>, String), StartError> {
        let pod_namespace = self.cfg.pod_namespace(&spec.namespace);
        let api: Api<Pod> = Api::namespaced(self.client.clone(), pod_namespace);
        let deadline = Instant::now() + self.cfg.claim_timeout;
        let mut lost = HashSet::new();
        loop {
            let changed = self.changed.notified();
            let mut changed = std::pin::pin!(changed);
            changed.as_mut().enable();
            let behind = self.failing.load(Ordering::Relaxed) > 0;
            let listed = if behind {
                self.listed_pods(&api, spec, deadline).await
            } else {
                None
            };
            let pods = listed.unwrap_or_else(|| self.pods.iter().flat_map(|s| s.state()).collect());
            let wanted = claim::Wanted {
                namespace: &spec.namespace,
                pod_namespace,
                in_sandbox_namespace: self.cfg.sandbox_namespace.is_some(),
                chain: &spec.chain,
                runtime_class: self.cfg.runtime_class.as_deref(),
            };
            let mut candidates = claim::candidates(&pods, &wanted, &lost);
            // Pods on nodes where an exec failed lately go last (a stable sort: still shuffled).
            let suspect = self.suspect_nodes();
            if !suspect.is_empty() {
                candidates.sort_by_key(|(name, _)| {
                    claim::node_of(&pods, pod_namespace, name).is_some_and(|n| suspect.contains(n))
                });
            }
            for (name, rv) in candidates {
                match claim::try_claim(&api, &name, &rv, &self.cfg.identity, deadline).await {
                    Ok(claim::Outcome::Claimed) => {
                        self.metric("claimed");
                        self.live().insert(format!("{pod_namespace}/{name}"));
                        return Ok((api, name));
                    }
                    Ok(claim::Outcome::Lost) => {
                        self.metric("conflict");
                        lost.insert((name, rv));
                    }
                    Err(e) => {
                        self.metric("error");
                        if e.maybe_ours {
                            tokio::spawn(give_back_if_ours(
                                api.clone(),
                                name.clone(),
                                self.cfg.identity.clone(),
                                e.stamp.clone(),
                            ));
                        }
                        let failure = StartFailure::Runtime(format!(
                            "claiming pod {pod_namespace}/{name} within {} ms: {e}",
                            self.cfg.claim_timeout.as_millis()
                        ));
                        return Err(StartError::new(spec, failure).of(name.clone()));
                    }
                }
            }
            // A watch that is retrying wakes nobody: read the API server again a moment later.
            let look_again = if behind {
                deadline.min(Instant::now() + RELIST_EVERY)
            } else {
                deadline
            };
            if tokio::time::timeout_at(look_again, changed).await.is_err()
                && Instant::now() >= deadline
            {
                self.metric("none");
                let failure = StartFailure::Runtime(format!(
                    "no warm pod within {} ms (is the operator running and the pool Ready? `kubectl get hc -n {}`)",
                    self.cfg.claim_timeout.as_millis(),
                    spec.namespace
                ));
                return Err(StartError::new(spec, failure));
            }
        }
    }

    /// The chain's pods as the API server has them now (None if it did not answer by `deadline`):
    /// for a claim while the pod watch is retrying, so that pods made meanwhile are not missed.
    async fn listed_pods(
        &self,
        api: &Api<Pod>,
        spec: &SandboxSpec,
        deadline: Instant,
    ) -> Option<Vec<Arc<Pod>>> {
        let params = ListParams::default().labels(&format!(
            "{},{}={}",
            selector(),
            labels::LABEL_CHAIN,
            spec.chain
        ));
        match tokio::time::timeout_at(deadline, api.list(&params)).await {
            Ok(Ok(list)) => Some(list.items.into_iter().map(Arc::new).collect()),
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "listing a chain's pods while the pod watch retries");
                None
            }
            Err(_) => None,
        }
    }

    /// The nodes an exec failed on within `SUSPECT_FOR`.
    fn suspect_nodes(&self) -> HashSet<String> {
        let mut suspect = self.suspect.lock().unwrap_or_else(|p| p.into_inner());
        suspect.retain(|_, at| at.elapsed() < SUSPECT_FOR);
        suspect.keys().cloned().collect()
    }

    /// Remembers that an exec into `pod` failed: its node may be lost.
    fn suspect_node_of(&self, pod_namespace: &str, pod: &str) {
        let pods: Vec<Arc<Pod>> = self.pods.iter().flat_map(|s| s.state()).collect();
        if let Some(node) = claim::node_of(&pods, pod_namespace, pod) {
            tracing::warn!(%node, %pod, "an exec into a pod on this node failed: its pods are tried last for a while");
            self.suspect
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(node.to_string(), Instant::now());
        }
    }

    fn metric(&self, result: &str) {
        self.claims.with_label_values(&[result]).inc();
    }

    fn live(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[async_trait]
impl SandboxBackend for KubeBackend {
    /// Claims a warm pod and attaches to its supervisor. An exec refused at once (a lost node's
    /// kubelet refuses every one) gives the pod back and claims another right away, at most
    /// `EXEC_RETRIES` times, preferring other nodes: a run does not wait out a boot retry for one
    /// dead pod. An exec that timed out has spent the boot's time: its error is the answer, as it
    /// is when no other pod is there to claim.
    async fn start(&self, spec: &SandboxSpec) -> Result<Sandbox, StartError> {
        let (api, pod) = self.claim(spec).await?;
        let mut failed = match self.attach(spec, api, pod).await {
            Ok(sandbox) => return Ok(sandbox),
            Err(f) => f,
        };
        for _ in 0..EXEC_RETRIES {
            if failed.timed_out {
                break;
            }
            tracing::warn!(error = %failed.error, "claiming another pod");
            let Ok((api, pod)) = self.claim(spec).await else {
                break;
            };
            failed = match self.attach(spec, api, pod).await {
                Ok(sandbox) => return Ok(sandbox),
                Err(f) => f,
            };
        }
        Err(failed.error)
    }

    async fn clean_leftovers(&self) -> usize {
        self.clean_leftovers_now().await
    }

    async fn live(&self) -> Vec<String> {
        let mut v: Vec<String> = self.live().iter().cloned().collect();
        v.sort();
        v
    }

    fn warm_target(&self, chain_warm: usize) -> usize {
        self.cfg.hold.min(chain_warm)
    }

    /// The hold is the pods kept claimed: one serving a recycled trigger point still counts.
    fn claimed_count_toward_warm(&self) -> bool {
        true
    }

    fn ready_needs_warm(&self) -> bool {
        false
    }
}

impl KubeBackend {
    /// Attaches to the supervisor of the claimed `pod`; on failure the pod is given back (deleted)
    /// and its node remembered as suspect.
    async fn attach(
        &self,
        spec: &SandboxSpec,
        api: Api<Pod>,
        pod: String,
    ) -> Result<Sandbox, AttachFailed> {
        let pod_namespace = self.cfg.pod_namespace(&spec.namespace).to_string();
        let handle = KubeHandle {
            api: api.clone(),
            key: format!("{pod_namespace}/{pod}"),
            pod: pod.clone(),
            connection: Mutex::new(None),
            heartbeat: Mutex::new(None),
            stdout_bytes: Arc::default(),
            live: self.live.clone(),
            destroyed: AtomicBool::new(false),
            pods: self.pods.clone(),
            pod_namespace: pod_namespace.clone(),
        };
        let exec = exec::start(&self.client, &pod_namespace, &pod, self.cfg.exec_keepalive);
        let exec = tokio::time::timeout(self.cfg.exec_timeout, exec).await;
        let exec = exec.unwrap_or(Err(exec::ExecError::Timeout(self.cfg.exec_timeout)));
        match exec {
            Ok(e) => {
                let heartbeat = tokio::spawn(claim::heartbeat(
                    api.clone(),
                    pod.clone(),
                    self.cfg.heartbeat,
                ));
                let handle = KubeHandle {
                    connection: Mutex::new(Some(e.connection)),
                    stdout_bytes: e.stdout_bytes,
                    heartbeat: Mutex::new(Some(heartbeat)),
                    ..handle
                };
                Ok(Sandbox {
                    id: handle.key.clone(),
                    stdin: Box::pin(e.stdin),
                    protocol: Box::pin(e.protocol),
                    handle: Box::new(handle),
                })
            }
            Err(e) => {
                self.suspect_node_of(&pod_namespace, &pod);
                // The pod is ours now: it goes, whatever state it is in.
                handle.destroy(true).await;
                let timed_out = matches!(e, exec::ExecError::Timeout(_));
                let failure =
                    StartFailure::Runtime(format!("exec into pod {pod_namespace}/{pod}: {e}"));
                Err(AttachFailed {
                    error: StartError::new(spec, failure).of(pod.clone()),
                    timed_out,
                })
            }
        }
    }

    async fn clean_leftovers_now(&self) -> usize {
        let mut gone = 0;
        // Our own claims still open, and pods an earlier process under our name claimed.
        let mut victims: HashMap<String, (String, String)> = self
            .live()
            .iter()
            .filter_map(|k| {
                let (ns, name) = k.split_once('/')?;
                Some((k.clone(), (ns.to_string(), name.to_string())))
            })
            .collect();
        let params = ListParams::default().labels(&format!(
            "{},{}={}",
            selector(),
            labels::LABEL_POOL,
            labels::POOL_CLAIMED
        ));
        for api in apis::<Pod>(&self.client, &self.cfg.pod_namespaces()) {
            match api.list(&params).await {
                Ok(list) => {
                    for p in list.items {
                        let ours = p
                            .metadata
                            .annotations
                            .as_ref()
                            .and_then(|a| a.get(labels::ANNOTATION_CLAIMED_BY))
                            .is_some_and(|by| *by == self.cfg.identity);
                        if let (true, Some(ns), Some(name)) =
                            (ours, p.metadata.namespace, p.metadata.name)
                        {
                            victims.insert(format!("{ns}/{name}"), (ns, name));
                        }
                    }
                }
                Err(e) => tracing::warn!(error = %e, "cannot list claimed pods to clean up"),
            }
        }
        for (key, (ns, name)) in victims {
            let api: Api<Pod> = Api::namespaced(self.client.clone(), &ns);
            if delete_pod(&api, &name).await {
                gone += 1;
                self.live().remove(&key);
            }
        }
        gone
    }
}

/// An exec into a claimed pod that failed (the pod is given back).
struct AttachFailed {
    error: StartError,
    /// It took the whole exec deadline.
    timed_out: bool,
}

/// How many more pods a start claims after an exec that failed.
const EXEC_RETRIES: u32 = 2;

/// How long a node where an exec failed has its pods tried last.
const SUSPECT_FOR: Duration = Duration::from_secs(30);

/// How often a claim reads the API server again while the pod watch is retrying.
const RELIST_EVERY: Duration = Duration::from_millis(500);

/// How long one try of a pod's delete may take.
const DELETE_TRY: Duration = Duration::from_secs(10);

/// How often, and how far apart at most, a claim whose answer was lost is checked before it is left
/// to the operator's claim deadline.
const GIVE_BACK_TRIES: u32 = 10;
const GIVE_BACK_PAUSE_MAX: Duration = Duration::from_secs(10);

/// A claim PATCH whose answer was lost (no answer by the deadline, a 504, a broken connection) may
/// have been applied: the pod would be ours and idle, unseen by the operator until its claim
/// deadline. Read it back (with bounded retries) and delete it if our claim is on it.
async fn give_back_if_ours(api: Api<Pod>, name: String, identity: String, stamp: String) {
    let mut pause = Duration::from_millis(200);
    for _ in 0..GIVE_BACK_TRIES {
        let by = Instant::now() + Duration::from_secs(5);
        match claim::claimed_by_us(&api, &name, &identity, &stamp, by).await {
            Ok(true) => {
                tracing::warn!(pod = %name, "a claim whose answer was lost took the pod: deleting it");
                delete_pod(&api, &name).await;
                return;
            }
            Ok(false) => return,
            Err(claim::ReadBackError::Failed(kube::Error::Api(s))) if s.code == 403 => {
                tracing::warn!(
                    pod = %name,
                    error = %s.message,
                    "may not read the pod back to check a lost claim (the gateway's Role needs \
                     `get` on pods); the operator's claim deadline will"
                );
                return;
            }
            Err(why) => tracing::debug!(pod = %name, %why, "checking a lost claim"),
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(GIVE_BACK_PAUSE_MAX);
    }
    tracing::warn!(pod = %name, "could not tell whether a lost claim took the pod; the operator's claim deadline will");
}

/// Deletes a pod with its own (1 s) grace: a forced delete would drop it from the API while its
/// sandbox still runs on the node, uncounted by the operator and the scheduler. True when it is
/// gone or going (or was gone already).
async fn delete_pod(api: &Api<Pod>, name: &str) -> bool {
    let params = DeleteParams::default();
    for attempt in 0..3u32 {
        // Each try bounded: the kube client would retry a 429 or 503 for many minutes.
        let deleted = tokio::time::timeout(DELETE_TRY, api.delete(name, &params)).await;
        match deleted.unwrap_or_else(|_| Err(kube::Error::Service("no answer in time".into()))) {
            Ok(_) => return true,
            Err(kube::Error::Api(s)) if s.code == 404 => return true,
            Err(e) => {
                tracing::warn!(pod = %name, error = %e, attempt, "deleting a used pod failed");
                tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
            }
        }
    }
    // The operator deletes claimed pods past their deadline: the pod does not outlive that.
    false
}

struct KubeHandle {
    api: Api<Pod>,
    pod: String,
    key: String,
    connection: Mutex<Option<exec::Connection>>,
    heartbeat: Mutex<Option<tokio::task::JoinHandle<()>>>,
    stdout_bytes: Arc<AtomicU64>,
    live: Arc<Mutex<HashSet<String>>>,
    destroyed: AtomicBool,
    /// The pod watch caches, to tell when the operator has moved on to another template.
    pods: Vec<Store<Pod>>,
    pod_namespace: String,
}

#[async_trait]
impl SandboxHandle for KubeHandle {
    fn outdated(&self) -> bool {
        let pods: Vec<Arc<Pod>> = self.pods.iter().flat_map(|s| s.state()).collect();
        claim::outdated(&pods, &self.pod_namespace, &self.pod)
    }

    async fn destroy(&self, _force: bool) {
        if self.destroyed.swap(true, Ordering::SeqCst) {
            return;
        }
        let connection = self
            .connection
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(h) = self
            .heartbeat
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            h.abort();
        }
        // The pod is deleted either way, so there is nothing to wait for: the exec connection goes
        // at once (its exit status, if any came, was logged by the exec's protocol reader).
        if let Some(mut connection) = connection {
            connection.close();
        }
        if delete_pod(&self.api, &self.pod).await {
            self.live
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&self.key);
        }
    }

    fn stdout_bytes(&self) -> u64 {
        self.stdout_bytes.load(Ordering::Relaxed)
    }
}
