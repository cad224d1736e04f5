//! The `kube` mode's source of chains: watch caches of HookChains and Capabilities, turned into a new
//! registry snapshot whenever either changes. Each object is decoded on its own
//! (`DeserializeGuard`), so one malformed object is reported and skipped while the rest keep
//! serving, and the watch itself never breaks on it.
//!
//! Each HookChain generation is checked as `sluice check` and the operator check it (semantic rules
//! and the hook code analyser, once per generation); a generation that fails keeps the chain's last
//! valid generation serving, marked as such in the audit, and the problem is reported.

use futures::StreamExt;
use k8s_openapi::api::apps::v1::ControllerRevision;
use kube::api::Api;
use kube::core::DeserializeGuard;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource as _, ResourceExt};
use sluice_crds::definition::{Definition, Directed, NotServed, Origin};
use sluice_crds::manifest::{Located, Object};
use sluice_crds::rollout;
use sluice_crds::watch::WatchBackoff;
use sluice_crds::{Capability, HookChain, HookChainSpec};
use sluice_engine::{Engine, Registry};
use sluice_sandbox_kube::watch::{Tasks, apis};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;

type Guarded<K> = DeserializeGuard<K>;

/// Changes arriving within this window are folded into one registry rebuild.
const DEBOUNCE: Duration = Duration::from_millis(50);
/// How often the trusted signers file is read again.
const SIGNERS_EVERY: Duration = Duration::from_secs(2);

/// Reads the trusted signers again and logs what changed; true when they did.
pub fn reread_signers(signing: &sluice_crds::signing::PolicyFile) -> bool {
    use sluice_crds::signing::Reread;
    match signing.reread() {
        Reread::Unchanged => false,
        Reread::Changed(problems) => {
            for p in &problems {
                tracing::error!(file = %signing.path().display(), "trusted signers: {p}");
            }
            tracing::info!(file = %signing.path().display(), "trusted signers changed: every chain is verified again");
            true
        }
        Reread::Kept(why) => {
            tracing::error!("{why}; the signers read before stay trusted");
            false
        }
    }
}

pub struct KubeSource {
    /// One cache per watched namespace (or one for all namespaces).
    chains: Vec<Store<Guarded<HookChain>>>,
    capabilities: Vec<Store<Guarded<Capability>>>,
    changed: Arc<Notify>,
    platform_namespace: String,
    /// What judges hook code: the sandboxes' CPython (the cell beside the gateway), or a python3.
    python: sluice_crds::code::Interpreter,
    /// Per (uid, generation): the problems found in that generation (none: it may serve).
    verdicts: HashMap<(String, i64), Vec<String>>,
    /// Per `namespace/name`: the last generation that passed its checks.
    last_valid: HashMap<String, HookChain>,
    client: kube::Client,
    /// Live revisions' specs read from their ControllerRevisions, by `namespace/object name`
    /// (immutable: read once).
    revisions: HashMap<String, HookChainSpec>,
    /// Where signed hook code is required and whose signatures count (`--trusted-signers`).
    signing: Option<Arc<sluice_crds::signing::PolicyFile>>,
    _tasks: Tasks,
}

/// `namespace/name` of an object.
fn key_of(meta: &kube::api::ObjectMeta) -> String {
    format!(
        "{}/{}",
        meta.namespace.as_deref().unwrap_or("default"),
        meta.name.as_deref().unwrap_or_default()
    )
}

/// (uid, generation) of an object: what a verdict is cached by.
fn version_of(meta: &kube::api::ObjectMeta) -> (String, i64) {
    (
        meta.uid.clone().unwrap_or_default(),
        meta.generation.unwrap_or_default(),
    )
}

/// Every problem of one HookChain generation: the semantic rules, then its hooks' code.
fn check_chain(python: &sluice_crds::code::Interpreter, hc: &HookChain) -> Vec<String> {
    let mut out: Vec<String> = sluice_crds::validate::hookchain(&hc.spec)
        .iter()
        .map(|p| p.to_string())
        .collect();
    if !out.is_empty() {
        return out;
    }
    match sluice_crds::code::analyse_with(python, &hc.spec.hooks) {
        Ok(per_hook) => {
            for (hook, problems) in hc.spec.hooks.iter().zip(per_hook) {
                for p in problems {
                    out.push(format!(
                        "hook {:?}, line {} of its code: {}",
                        hook.name, p.line, p.message
                    ));
                }
            }
        }
        Err(e) => tracing::warn!(
            chain = %key_of(&hc.metadata),
            error = %sluice_crds::log_text::Escaped(&e.to_string()),
            "hook code not analysed; serving it unchecked"
        ),
    }
    out
}

fn watch_into<K>(
    api: Api<Guarded<K>>,
    what: &'static str,
    selector: Option<&str>,
    changed: Arc<Notify>,
    served_status: fn(&Guarded<K>) -> Option<String>,
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
    let config = match selector {
        Some(selector) => watcher::Config::default().labels(selector),
        None => watcher::Config::default(),
    };
    let stream = reflector::reflector(
        writer,
        watcher(api, config).backoff(WatchBackoff::default()),
    );
    let task = tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        // The operator writes status (warm and claimed counts) on nearly every claim; only a change
        // of spec (its generation), of the part of status that decides what serves (a rollout's),
        // an object coming or going, or a relist is worth a rebuild.
        let mut generations: HashMap<String, (Option<i64>, Option<String>)> = HashMap::new();
        while let Some(event) = stream.next().await {
            let relevant = match &event {
                Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => {
                    let key = format!("{}/{}", o.namespace().unwrap_or_default(), o.name_any());
                    let version = (o.meta().generation, served_status(o));
                    generations.insert(key, version.clone()) != Some(version)
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
    /// Starts both watches (in each of `namespaces`, or in all when it is empty; of the objects
    /// `selector` matches, or all) and waits up to `sync_timeout` for their first full lists.
    pub async fn start(
        client: kube::Client,
        namespaces: &[String],
        selector: Option<&str>,
        platform_namespace: &str,
        python: sluice_crds::code::Interpreter,
        sync_timeout: Duration,
    ) -> anyhow::Result<Self> {
        let changed = Arc::new(Notify::new());
        let mut tasks = Vec::new();
        let mut chains = Vec::new();
        for api in apis::<Guarded<HookChain>>(&client, namespaces) {
            let (store, task) = watch_into(api, "hookchains", selector, changed.clone(), |g| {
                let rollout = g.0.as_ref().ok()?.status.as_ref()?.rollout.as_ref()?;
                serde_json::to_string(rollout).ok()
            });
            chains.push(store);
            tasks.push(task);
        }
        let mut capabilities = Vec::new();
        for api in apis::<Guarded<Capability>>(&client, namespaces) {
            let (store, task) =
                watch_into(api, "capabilities", selector, changed.clone(), |_| None);
            capabilities.push(store);
            tasks.push(task);
        }
        let source = Self {
            chains,
            capabilities,
            changed,
            platform_namespace: platform_namespace.to_string(),
            python,
            verdicts: HashMap::new(),
            last_valid: HashMap::new(),
            client: client.clone(),
            revisions: HashMap::new(),
            signing: None,
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

    /// Serves only hook code signed by a key `signing` trusts, where it requires signed code; the
    /// trusted signers are read again every few seconds (`feed`).
    pub fn with_signing(mut self, signing: Arc<sluice_crds::signing::PolicyFile>) -> Self {
        self.signing = Some(signing);
        self
    }

    /// The registry the caches describe now: each chain at its newest generation that passes its
    /// checks (its signatures against the signers trusted now included), or at its last valid one.
    pub async fn registry(&mut self) -> Registry {
        let policy = self
            .signing
            .as_ref()
            .map_or_else(Default::default, |s| s.current());
        let chains: Vec<Arc<Guarded<HookChain>>> =
            self.chains.iter().flat_map(|s| s.state()).collect();
        // Generations not judged yet are checked off the async workers (the analyser is python).
        let new: Vec<HookChain> = chains
            .iter()
            .filter_map(|g| g.0.as_ref().ok())
            .filter(|hc| !self.verdicts.contains_key(&version_of(&hc.metadata)))
            .cloned()
            .collect();
        if !new.is_empty() {
            let python = self.python.clone();
            let judged = tokio::task::spawn_blocking(move || {
                new.into_iter()
                    .map(|hc| (version_of(&hc.metadata), check_chain(&python, &hc)))
                    .collect::<Vec<_>>()
            })
            .await;
            match judged {
                Ok(judged) => self.verdicts.extend(judged),
                Err(e) => tracing::error!(error = %e, "checking HookChains failed"),
            }
        }
        let live: std::collections::HashSet<(String, i64)> = chains
            .iter()
            .filter_map(|g| g.0.as_ref().ok())
            .map(|hc| version_of(&hc.metadata))
            .collect();
        self.verdicts.retain(|v, _| live.contains(v));
        let mut objects = Vec::new();
        let mut errors = Vec::new();
        let mut present = std::collections::HashSet::new();
        for guarded in &chains {
            let (meta, problems) = match &guarded.0 {
                Ok(hc) => {
                    let mut problems = self
                        .verdicts
                        .get(&version_of(&hc.metadata))
                        .cloned()
                        .unwrap_or_default();
                    let namespace = hc.metadata.namespace.as_deref().unwrap_or("default");
                    let name = hc.metadata.name.as_deref().unwrap_or_default();
                    if let Err(why) = policy.check(namespace, name, &hc.spec) {
                        problems.push(why.to_string());
                    }
                    if problems.is_empty() {
                        self.last_valid.insert(key_of(&hc.metadata), hc.clone());
                        present.insert(key_of(&hc.metadata));
                        let mut d = definition(
                            origin("HookChain", &hc.metadata),
                            Object::HookChain(Box::new(hc.clone())),
                        );
                        d.directed = self.directed(hc).await;
                        objects.push(d);
                        continue;
                    }
                    (&hc.metadata, problems)
                }
                Err(bad) => (
                    &bad.metadata,
                    vec![format!("cannot be read: {}", bad.error)],
                ),
            };
            let key = key_of(meta);
            present.insert(key.clone());
            let generation = meta.generation.unwrap_or_default();
            let kept = self
                .last_valid
                .get(&key)
                .filter(|kept| kept.metadata.uid == meta.uid)
                .cloned();
            let message = match kept.as_ref() {
                Some(kept) => {
                    let kept_generation = kept.metadata.generation.unwrap_or_default();
                    let mut d = definition(
                        origin("HookChain", &kept.metadata),
                        Object::HookChain(Box::new(kept.clone())),
                    );
                    // The rollout as the operator keeps it now, with the hooks that serve.
                    let mut now = kept.clone();
                    if let Ok(current) = &guarded.0 {
                        now.status = current.status.clone();
                    }
                    d.directed = self.directed(&now).await;
                    d.superseded = Some(format!(
                        "serving generation {kept_generation} of HookChain {key}; generation {generation} fails its checks: {}",
                        problems.join("; ")
                    ));
                    objects.push(d);
                    format!(
                        "generation {generation} fails its checks: {}; generation {kept_generation} keeps serving",
                        problems.join("; ")
                    )
                }
                None => format!(
                    "generation {generation} fails its checks: {}; not served",
                    problems.join("; ")
                ),
            };
            errors.push(NotServed {
                origin: origin("HookChain", meta),
                message,
            });
        }
        self.last_valid.retain(|k, _| present.contains(k));
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
        Registry::build_for(&self.platform_namespace, objects, errors, &policy)
    }

    /// The rollout the operator directs for a chain (`status.rollout`), with the live revision's
    /// spec when it is not the chain's own (read once from its ControllerRevision). None before the
    /// operator has written one: the gateway then keeps the rollout itself.
    async fn directed(&mut self, hc: &HookChain) -> Option<Directed> {
        let state = hc.status.as_ref()?.rollout.clone()?;
        let namespace = hc.metadata.namespace.clone().unwrap_or_default();
        let name = hc.metadata.name.clone().unwrap_or_default();
        if state.live_revision == rollout::revision_of(&hc.spec) {
            return Some(Directed { state, live: None });
        }
        let object = rollout::revision_object_name(&name, &state.live_revision);
        let key = format!("{namespace}/{object}");
        if !self.revisions.contains_key(&key) {
            let api: kube::Api<ControllerRevision> =
                kube::Api::namespaced(self.client.clone(), &namespace);
            match api.get(&object).await {
                Ok(r) => match r
                    .data
                    .and_then(|d| serde_json::from_value::<HookChainSpec>(d.0["spec"].clone()).ok())
                {
                    Some(spec) if rollout::revision_of(&spec) == state.live_revision => {
                        self.revisions.insert(key.clone(), spec);
                    }
                    _ => {
                        tracing::warn!(chain = %key_of(&hc.metadata), revision = %object, "the live revision's ControllerRevision does not hold its hooks")
                    }
                },
                Err(e) => {
                    tracing::warn!(chain = %key_of(&hc.metadata), revision = %object, error = %e, "cannot read the live revision's ControllerRevision")
                }
            }
        }
        let live = self.revisions.get(&key).cloned().map(Box::new);
        Some(Directed { state, live })
    }

    /// Swaps the engine's registry whenever the caches change, until the task is dropped.
    pub async fn feed(mut self, engine: Arc<Engine>) {
        loop {
            let reread = async {
                match &self.signing {
                    Some(signing) => loop {
                        tokio::time::sleep(SIGNERS_EVERY).await;
                        if reread_signers(signing) {
                            return;
                        }
                    },
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = self.changed.notified() => {}
                _ = reread => {}
            }
            tokio::time::sleep(DEBOUNCE).await;
            let registry = self.registry().await;
            registry.log_summary();
            engine.set_registry(registry).await;
        }
    }
}

/// Reports a canary a gateway rolled back on its own by setting the chain's `sluice.dev/rollback`
/// annotation to the candidate's revision: the operator then moves `status.rollout` to RolledBack
/// and every gateway follows. A merge patch of the annotation alone: the chain's spec is untouched,
/// and a failed patch is logged (this gateway has rolled back already; the others judge for
/// themselves).
pub struct AnnotateRollback {
    client: kube::Client,
}

impl AnnotateRollback {
    pub fn new(client: kube::Client) -> Self {
        Self { client }
    }
}

impl sluice_engine::RolloutSink for AnnotateRollback {
    fn rolled_back(&self, namespace: &str, name: &str, revision: &str, why: &str) {
        let api: Api<HookChain> = Api::namespaced(self.client.clone(), namespace);
        let (name, revision, why) = (name.to_string(), revision.to_string(), why.to_string());
        tokio::spawn(async move {
            let patch = serde_json::json!({"metadata": {"annotations": {
                sluice_crds::definition::ROLLBACK_ANNOTATION: revision,
            }}});
            match api
                .patch(
                    &name,
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(&patch),
                )
                .await
            {
                Ok(_) => {
                    tracing::warn!(chain = %name, revision = %revision, why = %sluice_crds::log_text::Escaped(&why), "canary rolled back for the cluster (sluice.dev/rollback set)")
                }
                Err(e) => {
                    tracing::error!(chain = %name, revision = %revision, error = %e, "could not set sluice.dev/rollback; this gateway has rolled back, the others judge for themselves")
                }
            }
        });
    }
}

/// When this gateway writes its shadow comparisons (`publish_shadows`).
#[derive(Clone, Copy, Debug)]
pub struct ShadowTimes {
    /// How often the numbers are looked at (and written when they changed).
    pub every: Duration,
    /// Most time between two writes of an unchanged entry: the entry's `updatedAt` is this
    /// gateway's heartbeat, and the operator takes away an entry not renewed within its claim
    /// deadline (the gateway is gone: crashed, or its node lost).
    pub renew: Duration,
}

/// Writes this gateway's shadow comparisons into the chains' `status.rollout.shadow` (its own
/// entry, by server-side apply under its own field manager) every `times.every` while a shadow
/// candidate runs and the numbers changed (and every `times.renew` even when they did not), and
/// takes its entry away when the shadow is over. When `stop` fires (the gateway is stopping) or
/// the engine is gone, it takes away every entry it wrote and ends: a gateway that stops leaves
/// no comparison behind to be read as live.
pub async fn publish_shadows(
    client: kube::Client,
    identity: String,
    times: ShadowTimes,
    engine: std::sync::Weak<Engine>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    let manager = rollout::gateway_field_manager(&identity);
    let params = kube::api::PatchParams::apply(&manager).force();
    // Per chain: what was written last (without its time), and when.
    let mut written: HashMap<String, (rollout::GatewayShadow, tokio::time::Instant)> =
        HashMap::new();
    loop {
        let stopping = tokio::select! {
            _ = tokio::time::sleep(times.every) => false,
            _ = &mut stop => true,
        };
        let now = match engine.upgrade() {
            Some(engine) if !stopping => shadows_of(&engine, &identity),
            // Stopping: every entry written goes.
            _ => HashMap::new(),
        };
        let gone: Vec<String> = written
            .keys()
            .filter(|k| !now.contains_key(*k))
            .cloned()
            .collect();
        for chain in gone {
            // An apply without the entry takes it away (this manager owned nothing else there); a
            // chain deleted meanwhile took it along.
            match apply_status(&client, &chain, &params, serde_json::json!({})).await {
                StatusWrite::Written | StatusWrite::NoChain => {
                    written.remove(&chain);
                }
                StatusWrite::Failed => {}
            }
        }
        if now.is_empty() && (stopping || engine.strong_count() == 0) {
            if !written.is_empty() {
                tracing::warn!(chains = ?written.keys().collect::<Vec<_>>(), "stopping with shadow comparisons in the chains' status that could not be taken away; the operator removes them once they are older than its claim deadline");
            }
            return;
        }
        for (chain, entry) in now {
            let renewed = written
                .get(&chain)
                .is_some_and(|(e, at)| e == &entry && at.elapsed() < times.renew);
            if renewed {
                continue;
            }
            let mut stamped = entry.clone();
            stamped.updated_at = jiff::Timestamp::now().to_string();
            let status = serde_json::json!({"rollout": {"shadow": [stamped]}});
            match apply_status(&client, &chain, &params, status).await {
                // A chain not (or no longer) in the API server counts as written until its numbers
                // change: it is not retried every period for as long as the gateway runs.
                StatusWrite::Written | StatusWrite::NoChain => {
                    written.insert(chain, (entry, tokio::time::Instant::now()));
                }
                StatusWrite::Failed => {}
            }
        }
    }
}

/// This gateway's shadow comparisons now, per chain (`namespace/name`).
fn shadows_of(engine: &Engine, identity: &str) -> HashMap<String, rollout::GatewayShadow> {
    let mut now = HashMap::new();
    for s in engine.rollouts() {
        let (Some(shadow), Some(candidate)) = (s.shadow, s.candidate_revision) else {
            continue;
        };
        now.insert(
            s.chain,
            rollout::GatewayShadow {
                gateway: identity.to_string(),
                candidate_revision: candidate,
                runs: shadow.runs,
                agreed: shadow.agreed,
                action_differs: shadow.action_differs,
                output_differs: shadow.output_differs,
                errors: shadow.errors,
                dropped: shadow.dropped,
                disagreement_percent: format!("{:.1}", shadow.disagreement_percent),
                updated_at: String::new(),
            },
        );
    }
    now
}

/// How a write of this gateway's entry into a chain's status went.
enum StatusWrite {
    Written,
    /// The chain is not in the API server (deleted): there is no status to write or clear.
    NoChain,
    /// Failed otherwise (logged): tried again next period.
    Failed,
}

/// Server-side applies `status` to the chain `namespace/name`.
async fn apply_status(
    client: &kube::Client,
    chain: &str,
    params: &kube::api::PatchParams,
    status: serde_json::Value,
) -> StatusWrite {
    let Some((namespace, name)) = chain.split_once('/') else {
        return StatusWrite::NoChain;
    };
    let api: Api<HookChain> = Api::namespaced(client.clone(), namespace);
    let patch = serde_json::json!({
        "apiVersion": "sluice.dev/v1alpha1",
        "kind": "HookChain",
        "status": status,
    });
    match api
        .patch_status(name, params, &kube::api::Patch::Apply(&patch))
        .await
    {
        Ok(_) => StatusWrite::Written,
        Err(kube::Error::Api(s)) if s.code == 404 => {
            tracing::debug!(chain, "no shadow comparison to write: the chain is gone");
            StatusWrite::NoChain
        }
        Err(e) => {
            tracing::warn!(chain, error = %e, "cannot write this gateway's shadow comparison into the chain's status");
            StatusWrite::Failed
        }
    }
}
