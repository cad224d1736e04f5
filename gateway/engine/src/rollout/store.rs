//! Local mode keeps every chain's rollout in its state directory (`rollouts.json`), so that a
//! restart goes on with the live hooks it had, not the chain file's candidate.

use super::Rollouts;
use super::chain::ChainRollout;
use super::status::RevisionStatus;
use crate::chain::Chain;
use serde::{Deserialize, Serialize};
use sluice_crds::HookChainSpec;
use std::collections::HashMap;
use std::sync::Arc;

pub(super) struct Store {
    path: std::path::PathBuf,
    restored: HashMap<String, Saved>,
}

/// What survives a restart of one chain's rollout: the live hooks (a restarted gateway must not take
/// the candidate in the chain file for them), the history, a rollback, the canary's step.
#[derive(Serialize, Deserialize)]
struct Saved {
    namespace: String,
    name: String,
    live: HookChainSpec,
    history: Vec<RevisionStatus>,
    next_number: u64,
    rolled_back: Option<(String, String)>,
    candidate: Option<(String, usize)>,
}

impl Rollouts {
    /// Keeps the state in `path` from now on, and takes what an earlier gateway left there for the
    /// chains it will see. Unreadable state is logged and started over (the chain file's hooks go
    /// live, as on a first start).
    pub(crate) fn keep_in(&self, path: std::path::PathBuf) {
        if let Some(dir) = path.parent()
            && let Err(e) = std::fs::create_dir_all(dir)
        {
            tracing::warn!(path = %dir.display(), error = %e, "cannot make the directory for the rollout state");
        }
        let restored = match std::fs::read(&path) {
            Ok(bytes) => match serde_json::from_slice::<Vec<Saved>>(&bytes) {
                Ok(saved) => saved
                    .into_iter()
                    .map(|s| (format!("{}/{}", s.namespace, s.name), s))
                    .collect(),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "rollout state unreadable; starting over");
                    HashMap::new()
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => HashMap::new(),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "rollout state unreadable; starting over");
                HashMap::new()
            }
        };
        *self.store.lock().unwrap_or_else(|p| p.into_inner()) = Some(Store { path, restored });
    }

    /// A chain's rollout as an earlier gateway left it, if it did.
    pub(super) fn restore(&self, chain: &Arc<Chain>) -> Option<ChainRollout> {
        let mut store = self.store.lock().unwrap_or_else(|p| p.into_inner());
        let saved = store.as_mut()?.restored.remove(&chain.qualified_name())?;
        let live = Chain::new(&saved.namespace, &saved.name, &saved.live).ok()?;
        let mut r = ChainRollout {
            history: saved.history.into(),
            next_number: saved.next_number,
            live: Arc::new(live),
            candidate: None,
            rolled_back: saved.rolled_back,
        };
        r.follow(chain);
        if let (Some(c), Some((revision, step))) = (r.candidate.as_mut(), saved.candidate)
            && c.chain.revision() == revision
            && step < c.spec.steps.len()
        {
            c.step = step;
        }
        Some(r)
    }

    /// Writes every chain's state where `keep_in` said (atomically: a crash leaves the old file).
    pub(super) fn save(&self, all: &HashMap<String, ChainRollout>) {
        let store = self.store.lock().unwrap_or_else(|p| p.into_inner());
        let Some(store) = store.as_ref() else { return };
        let saved: Vec<Saved> = all
            .values()
            .map(|r| Saved {
                namespace: r.live.namespace.clone(),
                name: r.live.name.clone(),
                live: r.live.spec.clone(),
                history: r.history.iter().cloned().collect(),
                next_number: r.next_number,
                rolled_back: r.rolled_back.clone(),
                candidate: r
                    .candidate
                    .as_ref()
                    .map(|c| (c.chain.revision().to_string(), c.step)),
            })
            .collect();
        let tmp = store.path.with_extension("json.tmp");
        let written = serde_json::to_vec(&saved)
            .map_err(std::io::Error::other)
            .and_then(|bytes| std::fs::write(&tmp, bytes))
            .and_then(|()| std::fs::rename(&tmp, &store.path));
        if let Err(e) = written {
            tracing::warn!(path = %store.path.display(), error = %e, "could not keep the rollout state");
        }
    }
}
