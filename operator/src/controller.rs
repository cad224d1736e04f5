//! Wiring: the watches (HookChains, the operator's pods, Capabilities), each reflected into a cache
//! before it triggers anything, and the applier that runs `reconcile` for every chain they touch.
//!
//! One pod watch feeds both the cache and the triggers, so a reconcile triggered by a pod change
//! always sees that change. Objects are read through `DeserializeGuard`: a malformed HookChain or
//! Capability is reported on the object and cannot break a watch.

use crate::build::{FIELD_MANAGER, LABEL_MANAGED_BY, Settings};
use crate::expectations::Expectations;
use crate::metrics::Metrics;
use crate::reconcile::{self, Context};
use futures::{FutureExt, StreamExt, stream::BoxStream};
use k8s_openapi::api::core::v1::Pod;
use kube::core::DeserializeGuard;
use kube::runtime::controller::{ReconcileRequest, trigger_owners, trigger_self, trigger_with};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{WatchStreamExt, applier, watcher};
use kube::{Api, Client, ResourceExt};
use sluice_crds::{Capability, HookChain};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct RunConfig {
    pub settings: Settings,
    pub claim_deadline: Duration,
    /// Watch only this namespace; all when `None`.
    pub namespace: Option<String>,
    /// This replica's name, recorded in Events.
    pub identity: String,
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

/// Reconciles until `stop` resolves, then lets running reconciles finish and returns.
pub async fn run(
    client: Client,
    config: &RunConfig,
    metrics: Metrics,
    stop: impl Future<Output = ()> + Send + 'static,
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
    let ctx = Arc::new(Context::new(
        client.clone(),
        config.settings.clone(),
        config.claim_deadline,
        pods,
        capabilities,
        Expectations::default(),
        recorder,
        metrics,
    ));

    let forget_ctx = ctx.clone();
    let chain_events = watcher(
        api::<Chain>(&client, &config.namespace),
        watcher::Config::default(),
    )
    .default_backoff()
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

    let pod_config =
        watcher::Config::default().labels(&format!("{LABEL_MANAGED_BY}={FIELD_MANAGER}"));
    let pod_events = watcher(api::<Pod>(&client, &config.namespace), pod_config)
        .default_backoff()
        .reflect(pod_writer)
        .touched_objects();

    let cap_ctx = ctx.clone();
    let cap_events = watcher(
        api::<DeserializeGuard<Capability>>(&client, &config.namespace),
        watcher::Config::default(),
    )
    .default_backoff()
    .reflect(cap_writer)
    .inspect(move |ev| {
        if let Ok(watcher::Event::Apply(cap) | watcher::Event::InitApply(cap)) = ev {
            let (ctx, cap) = (cap_ctx.clone(), cap.clone());
            tokio::spawn(async move { reconcile::check_capability(&ctx, &cap).await });
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

    let queues: Vec<Queue> = vec![
        trigger_self(chain_events, ()).boxed(),
        trigger_owners(pod_events, (), ()).boxed(),
        trigger_with(cap_events, by_capability).boxed(),
    ];
    // Ending the input lets running reconciles finish: a graceful stop.
    let queue = futures::stream::select_all(queues).take_until(stop.boxed());
    applier(
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
    })
    .await;
}
