//! The `kube` mode's source of chains: watch caches of HookChains and Capabilities, turned into a new
//! registry snapshot whenever either changes. Each object is decoded on its own
//! (`DeserializeGuard`), so one malformed object is reported and skipped while the rest keep
//! serving, and the watch itself never breaks on it.

use crate::engine::Engine;
use crate::registry::Registry;
use futures::StreamExt;
use kube::api::Api;
use kube::core::DeserializeGuard;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use sluice_crds::manifest::{LoadError, Located, Object};
use sluice_crds::{Capability, HookChain};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;

type Guarded<K> = DeserializeGuard<K>;

/// Changes arriving within this window are folded into one registry rebuild.
const DEBOUNCE: Duration = Duration::from_millis(50);

pub struct KubeSource {
    chains: Store<Guarded<HookChain>>,
    capabilities: Store<Guarded<Capability>>,
    changed: Arc<Notify>,
    platform_namespace: String,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for KubeSource {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn watch_into<K>(
    api: Api<Guarded<K>>,
    what: &'static str,
    changed: Arc<Notify>,
) -> (Store<Guarded<K>>, tokio::task::JoinHandle<()>)
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let (store, writer) = reflector::store();
    let stream = reflector::reflector(
        writer,
        watcher(api, watcher::Config::default()).default_backoff(),
    );
    let task = tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            match event {
                Ok(_) => changed.notify_one(),
                Err(e) => tracing::warn!(resource = what, error = %e, "watch failed; retrying"),
            }
        }
    });
    (store, task)
}

/// Where an object came from, in the place local mode puts file and line.
fn origin(kind: &str, meta: &kube::api::ObjectMeta) -> PathBuf {
    PathBuf::from(format!(
        "{kind} {}/{}",
        meta.namespace.as_deref().unwrap_or("default"),
        meta.name.as_deref().unwrap_or("?")
    ))
}

impl KubeSource {
    /// Starts both watches (in one namespace or all) and waits up to `sync_timeout` for their first
    /// full lists.
    pub async fn start(
        client: kube::Client,
        namespace: Option<&str>,
        platform_namespace: &str,
        sync_timeout: Duration,
    ) -> anyhow::Result<Self> {
        fn api<K>(client: &kube::Client, namespace: Option<&str>) -> Api<Guarded<K>>
        where
            K: kube::Resource<DynamicType = (), Scope = kube::core::NamespaceResourceScope>,
        {
            match namespace {
                Some(ns) => Api::namespaced(client.clone(), ns),
                None => Api::all(client.clone()),
            }
        }
        let changed = Arc::new(Notify::new());
        let (chains, t1) = watch_into(
            api::<HookChain>(&client, namespace),
            "hookchains",
            changed.clone(),
        );
        let (capabilities, t2) = watch_into(
            api::<Capability>(&client, namespace),
            "capabilities",
            changed.clone(),
        );
        let source = Self {
            chains,
            capabilities,
            changed,
            platform_namespace: platform_namespace.to_string(),
            tasks: vec![t1, t2],
        };
        let synced = async {
            source.chains.wait_until_ready().await.ok();
            source.capabilities.wait_until_ready().await.ok();
        };
        if tokio::time::timeout(sync_timeout, synced).await.is_err() {
            anyhow::bail!(
                "HookChain and Capability watches did not sync within {sync_timeout:?}: are the CRDs installed and may this service account list them?"
            );
        }
        Ok(source)
    }

    /// The registry the caches describe now.
    pub fn registry(&self) -> Registry {
        let mut objects = Vec::new();
        let mut errors = Vec::new();
        for guarded in self.chains.state() {
            match &guarded.0 {
                Ok(hc) => objects.push(Located {
                    file: origin("HookChain", &hc.metadata),
                    line: 0,
                    value: Object::HookChain(Box::new(hc.clone())),
                }),
                Err(bad) => errors.push(LoadError {
                    file: origin("HookChain", &bad.metadata),
                    line: 0,
                    message: format!("cannot be read: {}", bad.error),
                }),
            }
        }
        for guarded in self.capabilities.state() {
            match &guarded.0 {
                Ok(cap) => {
                    let name = cap.metadata.name.clone().unwrap_or_default();
                    let problems = sluice_crds::validate::capability(&name, &cap.spec);
                    if problems.is_empty() {
                        objects.push(Located {
                            file: origin("Capability", &cap.metadata),
                            line: 0,
                            value: Object::Capability(Box::new(cap.clone())),
                        });
                    } else {
                        let list: Vec<String> = problems.iter().map(|p| p.to_string()).collect();
                        errors.push(LoadError {
                            file: origin("Capability", &cap.metadata),
                            line: 0,
                            message: list.join("; "),
                        });
                    }
                }
                Err(bad) => errors.push(LoadError {
                    file: origin("Capability", &bad.metadata),
                    line: 0,
                    message: format!("cannot be read: {}", bad.error),
                }),
            }
        }
        // Sorted so that conflicts (two chains for one target) resolve the same way every time.
        objects.sort_by(|a, b| a.file.cmp(&b.file));
        Registry::build_for(&self.platform_namespace, objects, errors)
    }

    /// Swaps the engine's registry whenever the caches change, until the task is dropped.
    pub async fn feed(self, engine: Arc<Engine>) {
        loop {
            self.changed.notified().await;
            tokio::time::sleep(DEBOUNCE).await;
            let registry = self.registry();
            crate::gateway::report(&registry);
            engine.set_registry(registry).await;
        }
    }
}
