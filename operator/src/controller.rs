//! Wiring: the watches (HookChains, the operator's pods, Capabilities), each reflected into a cache
//! before it triggers anything, and the applier that runs `reconcile` for every chain they touch.
//!
//! With `--namespace NS` the operator also keeps the pools of the platform namespace (whose enforced
//! chains are the gateway's baselines): one such controller (watches, caches, applier) per watched
//! namespace, run side by side and stopped together. A reflector store mirrors exactly one watch
//! (its relists replace the whole store), so the namespaces do not share a store; nothing else is
//! shared either (every pool, expectation and Capability a chain depends on is of its namespace).
//!
//! One pod watch feeds both the cache and the triggers, so a reconcile triggered by a pod change
//! always sees that change. A node watch (cordoned, lost) requeues the chains with pods on the node
//! that changed. Objects are read through `DeserializeGuard`: a malformed HookChain or
//! Capability is reported on the object and cannot break a watch.

use crate::expectations::Expectations;
use crate::leader::{self, LeaseLock};
use crate::metrics::Metrics;
use crate::reconcile::build::{
    FIELD_MANAGER, LABEL_CHAIN, LABEL_CHAIN_NAMESPACE, LABEL_MANAGED_BY, Settings,
};
use crate::reconcile::{self, Context};
use futures::future::{BoxFuture, Shared};
use futures::{FutureExt, StreamExt, stream::BoxStream};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::core::DeserializeGuard;
use kube::runtime::controller::{ReconcileRequest, trigger_self, trigger_with};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{WatchStreamExt, applier, watcher};
use kube::{Api, Client, ResourceExt};
use sluice_crds::watch::WatchBackoff;
use sluice_crds::{Capability, HookChain};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{broadcast, watch};

#[derive(Clone, Debug)]
pub struct RunConfig {
    pub settings: Settings,
    pub claim_deadline: Duration,
    /// A new pod not ready this long after its creation is replaced.
    pub start_deadline: Duration,
    /// Watch only this namespace (and `platform_namespace`); all when `None`.
    pub namespace: Option<String>,
    /// Keep only the HookChains and Capabilities this label selector matches (`--selector`, the
    /// gateway's alike): several releases then share namespaces by label. None: all.
    pub selector: Option<String>,
    /// The namespace whose enforced chains are platform baselines (the gateway's
    /// `--platform-namespace`): watched as well when `namespace` is another one.
    pub platform_namespace: String,
    /// Where Capabilities may point (`--allowed-endpoints`); others are not Ready.
    pub allowed_endpoints: sluice_crds::endpoints::AllowedEndpoints,
    /// This replica's name, recorded in Events.
    pub identity: String,
    /// Watch the cluster's nodes (cordons, lost nodes: `pool::NodeState`). Off for installs that
    /// may not read cluster-scoped objects: every pod's node then counts as serving.
    pub watch_nodes: bool,
}

impl RunConfig {
    /// The namespaces to watch, one controller each: `[None]` (all) without `namespace`, else
    /// `namespace` and, when it is another one, `platform_namespace`.
    pub fn watched_namespaces(&self) -> Vec<Option<String>> {
        match &self.namespace {
            None => vec![None],
            Some(ns) if *ns == self.platform_namespace => vec![Some(ns.clone())],
            Some(ns) => vec![Some(ns.clone()), Some(self.platform_namespace.clone())],
        }
    }
}

fn api<K>(client: &Client, namespace: &Option<String>) -> Api<K>
where
    K: kube::Resource<Scope = kube::core::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

type Chain = DeserializeGuard<HookChain>;
type Queue = BoxStream<'static, Result<ReconcileRequest<Chain>, watcher::Error>>;

/// Reconciles until `stop` resolves, then lets running reconciles finish (at most
/// `SHUTDOWN_GRACE`) and returns.
pub async fn run(
    client: Client,
    config: &RunConfig,
    metrics: Metrics,
    stop: impl Future<Output = ()> + Send + 'static,
) {
    let stop = stop.boxed().shared();
    let abandon = {
        let stop = stop.clone();
        async move {
            stop.await;
            tokio::time::sleep(SHUTDOWN_GRACE).await
        }
    };
    run_until(client, config, metrics, stop, abandon).await
}

/// Reconciles until `stop` resolves, then lets running reconciles finish; when `abandon` resolves,
/// whatever still runs is dropped at once (no further request is sent).
pub async fn run_until(
    client: Client,
    config: &RunConfig,
    metrics: Metrics,
    stop: impl Future<Output = ()> + Send + 'static,
    abandon: impl Future<Output = ()> + Send,
) {
    let stop = stop.boxed().shared();
    // One node watch for every namespace's controller (nodes are cluster-scoped).
    let (nodes, node_writer) = reflector::store::<Node>();
    let (node_changed, _) = broadcast::channel(NODE_CHANGES);
    let controllers = config.watched_namespaces().into_iter().map(|namespace| {
        run_namespace(
            client.clone(),
            config,
            namespace,
            NodeFeed {
                store: nodes.clone(),
                changed: node_changed.subscribe(),
            },
            metrics.clone(),
            stop.clone(),
        )
    });
    let applied = futures::future::join_all(controllers);
    let node_watch = if config.watch_nodes {
        watch_nodes(client.clone(), node_writer, node_changed)
            .take_until(stop.clone())
            .for_each(|_| async {})
            .boxed()
    } else {
        drop((node_writer, node_changed));
        futures::future::ready(()).boxed()
    };
    let running = futures::future::join(applied, node_watch);
    tokio::select! {
        _ = running => {}
        _ = abandon => {
            tracing::warn!("reconciles did not finish within the grace; abandoning them");
        }
    }
}

/// How many node changes a namespace's controller may fall behind by before it skips some.
const NODE_CHANGES: usize = 256;

/// The operator's node cache, and the names of the nodes that change, for one namespace's
/// controller.
struct NodeFeed {
    store: reflector::Store<Node>,
    changed: broadcast::Receiver<String>,
}

/// Watches the cluster's nodes into `writer` (without what the pool never reads: their image lists
/// and volumes are most of a node's size), and tells `changed` the name of each node that changes.
/// Without the right to watch nodes the watch retries (with a warning) and the cache stays empty:
/// every pod's node then counts as serving.
fn watch_nodes(
    client: Client,
    writer: reflector::store::Writer<Node>,
    changed: broadcast::Sender<String>,
) -> impl futures::Stream<Item = ()> {
    watcher(Api::<Node>::all(client), watcher::Config::default())
        .backoff(WatchBackoff::default())
        .modify(|node| {
            node.managed_fields_mut().clear();
            if let Some(status) = node.status.as_mut() {
                status.images = None;
                status.volumes_attached = None;
                status.volumes_in_use = None;
            }
        })
        .reflect(writer)
        .touched_objects()
        .filter_map(move |node| {
            let changed = changed.clone();
            async move {
                match node {
                    // Nobody listening (no controller yet, or all stopped) is not an error.
                    Ok(node) => {
                        let _ = changed.send(node.name_any());
                    }
                    Err(e) => tracing::warn!(error = %e, "node watch failed; retrying"),
                }
                Some(())
            }
        })
}

/// The controller of one namespace (`None`: all): its watches, caches and applier, until `stop`
/// resolves and its running reconciles have finished.
async fn run_namespace(
    client: Client,
    config: &RunConfig,
    namespace: Option<String>,
    nodes: NodeFeed,
    metrics: Metrics,
    stop: Shared<BoxFuture<'static, ()>>,
) {
    let (chains, chain_writer) = reflector::store::<Chain>();
    let (pods, pod_writer) = reflector::store::<Pod>();
    let (capabilities, cap_writer) = reflector::store::<DeserializeGuard<Capability>>();
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: FIELD_MANAGER.into(),
            instance: Some(config.identity.clone()),
        },
    );
    let ctx = Arc::new(
        Context::new(
            client.clone(),
            config.settings.clone(),
            config.claim_deadline,
            pods,
            capabilities,
            Expectations::default(),
            recorder,
            metrics,
        )
        .with_start_deadline(config.start_deadline)
        .with_nodes(nodes.store)
        .with_allowed_endpoints(config.allowed_endpoints.clone()),
    );

    let forget_ctx = ctx.clone();
    let objects = match &config.selector {
        Some(selector) => watcher::Config::default().labels(selector),
        None => watcher::Config::default(),
    };
    let chain_events = watcher(api::<Chain>(&client, &namespace), objects.clone())
        .backoff(WatchBackoff::default())
        .reflect(chain_writer)
        .inspect(move |ev| {
            if let Ok(watcher::Event::Delete(chain)) = ev {
                reconcile::forget(
                    &forget_ctx,
                    &chain.namespace().unwrap_or_default(),
                    &chain.name_any(),
                );
            }
        })
        .applied_objects();

    // The pods live beside their chains, or all in the sandbox namespace: there, this controller
    // watches the pods of its namespace's chains (by their chain-namespace label).
    let (pod_api, pod_selector) = match &config.settings.sandbox_namespace {
        Some(sandboxes) => (
            Api::namespaced(client.clone(), sandboxes),
            match &namespace {
                Some(ns) => {
                    format!("{LABEL_MANAGED_BY}={FIELD_MANAGER},{LABEL_CHAIN_NAMESPACE}={ns}")
                }
                None => format!("{LABEL_MANAGED_BY}={FIELD_MANAGER}"),
            },
        ),
        None => (
            api::<Pod>(&client, &namespace),
            format!("{LABEL_MANAGED_BY}={FIELD_MANAGER}"),
        ),
    };
    let pod_events = watcher(pod_api, watcher::Config::default().labels(&pod_selector))
        .backoff(WatchBackoff::default())
        .reflect(pod_writer)
        .touched_objects();

    let cap_ctx = ctx.clone();
    let cap_events = watcher(
        api::<DeserializeGuard<Capability>>(&client, &namespace),
        objects,
    )
    .backoff(WatchBackoff::default())
    .reflect(cap_writer)
    .inspect(move |ev| {
        // A change may touch the others of its namespace too (it may be their gate): all of the
        // namespace are judged again; only changed statuses are written.
        if let Ok(
            watcher::Event::Apply(cap)
            | watcher::Event::InitApply(cap)
            | watcher::Event::Delete(cap),
        ) = ev
            && let Some(ns) = cap.namespace()
        {
            let ctx = cap_ctx.clone();
            tokio::spawn(async move { reconcile::check_capabilities(&ctx, &ns).await });
        }
    })
    .touched_objects();
    // A Capability change re-judges the chains of its namespace whose hooks name it.
    let chain_reader = chains.clone();
    let by_capability = move |cap: DeserializeGuard<Capability>| {
        let (ns, name) = (cap.namespace(), cap.name_any());
        chain_reader
            .state()
            .into_iter()
            .filter(|c| c.namespace() == ns)
            .filter(|c| match &c.0 {
                Ok(chain) => chain
                    .spec
                    .hooks
                    .iter()
                    .any(|h| h.capabilities.contains(&name)),
                Err(_) => false,
            })
            .map(|c| ObjectRef::from_obj(&*c))
            .collect::<Vec<_>>()
    };

    // A pod change requeues its chain, named by the pod's labels (owner references do not cross
    // namespaces; a pod made before the chain-namespace label existed lives beside its chain).
    let by_pod = |pod: Pod| {
        let labels = pod.labels();
        let chain = labels.get(LABEL_CHAIN)?;
        let ns = labels
            .get(LABEL_CHAIN_NAMESPACE)
            .cloned()
            .or_else(|| pod.namespace())?;
        Some(ObjectRef::<Chain>::new(chain).within(&ns))
    };
    // A node change requeues the chains with pods on it.
    let pod_reader = ctx.pods.clone();
    let node_events = futures::stream::unfold(nodes.changed, |mut changed| async move {
        loop {
            match changed.recv().await {
                Ok(name) => return Some((Ok::<_, watcher::Error>(name), changed)),
                // Missed changes: every chain is looked at again within RESYNC anyway.
                Err(broadcast::error::RecvError::Lagged(_)) => continue,
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    });
    let by_node = move |name: String| {
        pod_reader
            .state()
            .into_iter()
            .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(&name))
            .filter_map(|p| by_pod((*p).clone()))
            .collect::<std::collections::HashSet<_>>()
    };
    let queues: Vec<Queue> = vec![
        trigger_self(chain_events, ()).boxed(),
        trigger_with(pod_events, by_pod).boxed(),
        trigger_with(node_events, by_node).boxed(),
        trigger_with(cap_events, by_capability).boxed(),
    ];
    // Ending the input lets running reconciles finish: a graceful stop. A reconcile stuck on an
    // API server that does not answer (or a cache that never synced) is dropped at `abandon`
    // (`run_until`).
    let queue = futures::stream::select_all(queues).take_until(stop);
    let applied = applier(
        |chain, ctx| Box::pin(reconcile::reconcile(chain, ctx)),
        reconcile::error_policy,
        ctx,
        chains,
        queue,
        kube::runtime::Config::default().debounce(Duration::from_millis(200)),
    )
    .for_each(|result| async move {
        match result {
            Ok((chain, _)) => tracing::debug!(%chain, "reconciled"),
            Err(e) => tracing::debug!(error = %e, "reconcile not run"),
        }
    });
    applied.await
}

/// How long running reconciles may take to finish once the controller is told to stop (SIGTERM),
/// while this replica still holds (and renews) the Lease.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// How often the Lease is renewed, how long a leader may fail to renew before it steps down, and
/// how long the Lease lasts.
#[derive(Clone, Copy, Debug)]
pub struct LeaseTiming {
    pub renew_every: Duration,
    pub renew_deadline: Duration,
    pub lease_duration: Duration,
}

impl Default for LeaseTiming {
    fn default() -> Self {
        Self {
            renew_every: leader::RENEW_EVERY,
            renew_deadline: leader::RENEW_DEADLINE,
            lease_duration: leader::LEASE_DURATION,
        }
    }
}

impl LeaseTiming {
    /// How long a leader that stepped down lets running reconciles finish: half of what is left
    /// of the Lease after the renew deadline (the rest is margin for timers and clocks), so its
    /// last write comes before another replica may take the Lease.
    pub fn stop_grace(&self) -> Duration {
        self.lease_duration.saturating_sub(self.renew_deadline) / 2
    }
}

/// Reconciles only while this replica holds the Lease: a follower waits, a leader that loses the
/// Lease stops reconciling and abandons what still runs after `LeaseTiming::stop_grace`, then waits
/// again. On `stop` it lets running reconciles finish (`SHUTDOWN_GRACE`, renewing the Lease
/// meanwhile), then hands the Lease back and returns.
pub async fn run_when_leading(
    client: Client,
    config: RunConfig,
    metrics: Metrics,
    lock: LeaseLock,
    timing: LeaseTiming,
    stop: watch::Receiver<bool>,
) {
    let (leader_tx, leader_rx) = watch::channel(false);
    // The elector hands the Lease back only once the controller has stopped writing.
    let (release_tx, release_rx) = watch::channel(false);
    let elector = tokio::spawn(leader::run(
        lock,
        timing.renew_every,
        timing.renew_deadline,
        leader_tx,
        release_rx,
    ));
    let stop_grace = timing.stop_grace();
    loop {
        let (mut leading, mut stopping) = (leader_rx.clone(), stop.clone());
        let lead = tokio::select! {
            biased;
            _ = stopping.wait_for(|s| *s) => false,
            // An error means the elector has ended: there is no leadership to wait for.
            r = leading.wait_for(|l| *l) => r.is_ok(),
        };
        if !lead || *stop.borrow() {
            break;
        }
        metrics.leader.set(1);
        tracing::info!("leading: reconciling");
        let (mut leading, mut stopping) = (leader_rx.clone(), stop.clone());
        let until = async move {
            tokio::select! {
                _ = leading.wait_for(|l| !*l) => tracing::warn!("leadership lost: stopping reconciles"),
                _ = stopping.wait_for(|s| *s) => {}
            }
        };
        let (mut leading, mut stopping) = (leader_rx.clone(), stop.clone());
        let abandon = async move {
            // Whichever comes first: leadership lost (even during a shutdown) ends writes within
            // the stop grace, a shutdown while leading within SHUTDOWN_GRACE.
            tokio::select! {
                _ = async {
                    let _ = leading.wait_for(|l| !*l).await;
                    tokio::time::sleep(stop_grace).await
                } => {}
                _ = async {
                    let _ = stopping.wait_for(|s| *s).await;
                    tokio::time::sleep(SHUTDOWN_GRACE).await
                } => {}
            }
        };
        run_until(client.clone(), &config, metrics.clone(), until, abandon).await;
        metrics.leader.set(0);
        if *stop.borrow() {
            break;
        }
    }
    release_tx.send_replace(true);
    let _ = elector.await;
}
