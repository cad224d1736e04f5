//! The `kube` mode's source of chains: watch caches of HookChains and Capabilities, turned into a new
//! registry snapshot whenever either changes. Each object is decoded on its own
//! (`DeserializeGuard`), so one malformed object is reported and skipped while the rest keep
//! serving, and the watch itself never breaks on it.

use crate::watch::{Tasks, apis};
use futures::StreamExt;
use kube::api::Api;
use kube::core::DeserializeGuard;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource as _, ResourceExt};
use sluice_crds::definition::{Definition, NotServed, Origin};
use sluice_crds::manifest::{Located, Object};
use sluice_crds::{Capability, HookChain};
use sluice_engine::{Engine, Registry};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;

type Guarded<K> = DeserializeGuard<K>;

/// Changes arriving within this window are folded into one registry rebuild.
const DEBOUNCE: Duration = Duration::from_millis(50);

pub struct KubeSource {
    /// One cache per watched namespace (or one for all namespaces).
    chains: Vec<Store<Guarded<HookChain>>>,
    capabilities: Vec<Store<Guarded<Capability>>>,
    changed: Arc<Notify>,
    platform_namespace: String,
    _tasks: Tasks,
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
        // The operator writes status (warm and claimed counts) on nearly every claim; only a change
        // of spec (its generation), an object coming or going, or a relist is worth a rebuild.
        let mut generations: HashMap<String, Option<i64>> = HashMap::new();
        while let Some(event) = stream.next().await {
            let relevant = match &event {
                Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => {
                    let key = format!("{}/{}", o.namespace().unwrap_or_default(), o.name_any());
                    generations.insert(key, o.meta().generation) != Some(o.meta().generation)
                }
                Ok(watcher::Event::Delete(o)) => {
                    let key = format!("{}/{}", o.namespace().unwrap_or_default(), o.name_any());
                    generations.remove(&key);
                    true
                }
                Ok(watcher::Event::Init) => false,
                Ok(watcher::Event::InitDone) => true,
                Err(e) => {
                    tracing::warn!(resource = what, error = %e, "watch failed; retrying");
                    false
                }
            };
            if relevant {
                changed.notify_one();
            }
        }
    });
    (store, task)
}

/// Where an object came from, in the place local mode puts file and line.
fn origin(kind: &str, meta: &kube::api::ObjectMeta) -> Origin {
    Origin {
        file: PathBuf::from(format!(
            "{kind} {}/{}",
            meta.namespace.as_deref().unwrap_or("default"),
            meta.name.as_deref().unwrap_or("?")
        )),
        line: 0,
    }
}

/// A cached object as the registry takes it.
fn definition(origin: Origin, value: Object) -> Definition {
    Definition::from(Located {
        file: origin.file,
        line: origin.line,
        value,
    })
}

impl KubeSource {
    /// Starts both watches (in each of `namespaces`, or in all when it is empty) and waits up to
    /// `sync_timeout` for their first full lists.
    pub async fn start(
        client: kube::Client,
        namespaces: &[String],
        platform_namespace: &str,
        sync_timeout: Duration,
    ) -> anyhow::Result<Self> {
        let changed = Arc::new(Notify::new());
        let mut tasks = Vec::new();
        let mut chains = Vec::new();
        for api in apis::<Guarded<HookChain>>(&client, namespaces) {
            let (store, task) = watch_into(api, "hookchains", changed.clone());
            chains.push(store);
            tasks.push(task);
        }
        let mut capabilities = Vec::new();
        for api in apis::<Guarded<Capability>>(&client, namespaces) {
            let (store, task) = watch_into(api, "capabilities", changed.clone());
            capabilities.push(store);
            tasks.push(task);
        }
        let source = Self {
            chains,
            capabilities,
            changed,
            platform_namespace: platform_namespace.to_string(),
            _tasks: Tasks(tasks),
        };
        let synced = async {
            for s in &source.chains {
                s.wait_until_ready().await.ok();
            }
            for s in &source.capabilities {
                s.wait_until_ready().await.ok();
            }
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
        for guarded in self.chains.iter().flat_map(|s| s.state()) {
            match &guarded.0 {
                Ok(hc) => objects.push(definition(
                    origin("HookChain", &hc.metadata),
                    Object::HookChain(Box::new(hc.clone())),
                )),
                Err(bad) => errors.push(NotServed {
                    origin: origin("HookChain", &bad.metadata),
                    message: format!("cannot be read: {}", bad.error),
                }),
            }
        }
        for guarded in self.capabilities.iter().flat_map(|s| s.state()) {
            match &guarded.0 {
                Ok(cap) => {
                    let name = cap.metadata.name.clone().unwrap_or_default();
                    let problems = sluice_crds::validate::capability(&name, &cap.spec);
                    if problems.is_empty() {
                        objects.push(definition(
                            origin("Capability", &cap.metadata),
                            Object::Capability(Box::new(cap.clone())),
                        ));
                    } else {
                        let list: Vec<String> = problems.iter().map(|p| p.to_string()).collect();
                        errors.push(NotServed {
                            origin: origin("Capability", &cap.metadata),
                            message: list.join("; "),
                        });
                    }
                }
                Err(bad) => errors.push(NotServed {
                    origin: origin("Capability", &bad.metadata),
                    message: format!("cannot be read: {}", bad.error),
                }),
            }
        }
        // Sorted so that conflicts (two chains for one target) resolve the same way every time.
        objects.sort_by(|a, b| a.origin.cmp(&b.origin));
        Registry::build_for(&self.platform_namespace, objects, errors)
    }

    /// Swaps the engine's registry whenever the caches change, until the task is dropped.
    pub async fn feed(self, engine: Arc<Engine>) {
        loop {
            self.changed.notified().await;
            tokio::time::sleep(DEBOUNCE).await;
            let registry = self.registry();
            registry.log_summary();
            engine.set_registry(registry).await;
        }
    }
}
