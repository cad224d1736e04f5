//! Watches local mode's chain directory and swaps the engine's registry when its files change.
//! Changes are noticed through the kernel's file notifications (inotify, through `notify`) with a slow
//! fingerprint check as a backstop, or by polling the fingerprint alone where notifications cannot
//! be had (an inotify limit reached, a file system without them). Reading and checking happen off
//! the async workers, and a slow file never holds back the others (see `LocalSource::reload`).

use crate::local_dir::{self, LocalSource};
use notify::Watcher as _;
use sluice_engine::Engine;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;

/// How often the fingerprint is compared when there are no notifications.
const POLL: Duration = Duration::from_millis(250);
/// How often it is compared anyway when notifications work.
const BACKSTOP: Duration = Duration::from_secs(5);
/// How often the trusted signers file (`--trusted-signers`) is read again.
const SIGNERS_EVERY: Duration = Duration::from_secs(1);
/// After a notification, how long to let an editor's burst of writes settle before reading.
const SETTLE: Duration = Duration::from_millis(50);

/// How changes are noticed.
enum Noticing {
    /// Kept alive for as long as the directory is watched.
    Notifications {
        _watcher: notify::RecommendedWatcher,
    },
    Polling,
}

fn notice(dir: &std::path::Path, changed: Arc<Notify>) -> Noticing {
    let watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        // Reading the files is an event too (open, close): reacting to it would reload forever.
        if event.is_ok_and(|e| !matches!(e.kind, notify::EventKind::Access(_))) {
            changed.notify_one();
        }
    })
    .and_then(|mut w| {
        w.watch(dir, notify::RecursiveMode::Recursive)?;
        Ok(w)
    });
    match watcher {
        Ok(w) => {
            tracing::info!(dir = %dir.display(), "watching the chain directory (file notifications)");
            Noticing::Notifications { _watcher: w }
        }
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "file notifications unavailable; polling the chain directory every 250 ms");
            Noticing::Polling
        }
    }
}

/// Re-reads the directory whenever its YAML files change (or a file's checks finish) and swaps the
/// registry. Runs until the gateway stops.
pub(crate) async fn watch(engine: Arc<Engine>, dir: PathBuf, mut source: LocalSource) {
    let changed = Arc::new(Notify::new());
    let noticing = notice(&dir, changed.clone());
    let mut seen = fingerprint(&dir).await;
    let signing = source.signing();
    loop {
        let tick = match (&noticing, source.has_pending()) {
            (_, true) | (Noticing::Polling, _) => POLL,
            (Noticing::Notifications { .. }, false) => BACKSTOP,
        };
        // The trusted signers file is read again at least every second.
        let tick = if signing.is_some() {
            tick.min(SIGNERS_EVERY)
        } else {
            tick
        };
        let notified = tokio::select! {
            _ = changed.notified() => true,
            _ = tokio::time::sleep(tick) => false,
        };
        if notified {
            tokio::time::sleep(SETTLE).await;
        }
        let now = fingerprint(&dir).await;
        let signers_changed = signing
            .as_ref()
            .is_some_and(|s| sluice_source_kube::reread_signers(s));
        if !notified && now == seen && !source.has_pending() && !signers_changed {
            continue;
        }
        seen = now;
        let (back, result) = match tokio::task::spawn_blocking(move || {
            let result = source.reload(local_dir::RELOAD_WAIT);
            (source, result)
        })
        .await
        {
            Ok(done) => done,
            Err(e) => {
                tracing::error!(error = %e, "the chain directory reader failed; no longer watching");
                return;
            }
        };
        source = back;
        match result {
            Ok(registry) => {
                registry.log_summary();
                engine.set_registry(registry).await;
            }
            Err(e) => {
                tracing::error!(dir = %dir.display(), error = %e, "cannot read the chain directory; keeping the last registry")
            }
        }
    }
}

async fn fingerprint(
    dir: &std::path::Path,
) -> Vec<(local_dir::Found, u64, Option<std::time::SystemTime>)> {
    let dir = dir.to_path_buf();
    tokio::task::spawn_blocking(move || local_dir::fingerprint(&dir))
        .await
        .unwrap_or_default()
}
