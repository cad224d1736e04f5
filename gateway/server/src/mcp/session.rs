//! MCP sessions as the proxy keeps them: which caller, namespace and server opened each (a session
//! id presented by anyone else does not exist for them), and which tools the chains let the session
//! see (a hidden tool cannot be called).

use sluice_engine::CallerAuth;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Sessions kept at most; past that the one used longest ago is forgotten (its client then gets
/// 404 and opens a new one, as after a restart).
const MAX_SESSIONS: usize = 10_000;

#[derive(Debug)]
pub(crate) struct Session {
    caller: Option<String>,
    namespace: String,
    server: String,
    used: Mutex<Instant>,
    /// The tools the chains let this session see, once a `tools/list` passed them (`None`: not
    /// listed yet).
    visible: Mutex<Option<HashSet<String>>>,
}

impl Session {
    pub(crate) fn visible(&self) -> Option<HashSet<String>> {
        self.visible.lock().expect("visible tools").clone()
    }

    /// What a `tools/list` page let through: the first page (no cursor) starts the set again.
    pub(crate) fn saw_tools(&self, first_page: bool, names: impl IntoIterator<Item = String>) {
        let mut visible = self.visible.lock().expect("visible tools");
        let set = visible.get_or_insert_with(HashSet::new);
        if first_page {
            set.clear();
        }
        set.extend(names);
    }
}

#[derive(Default)]
pub(crate) struct Sessions {
    by_id: Mutex<HashMap<String, Arc<Session>>>,
}

impl Sessions {
    /// Records the session a server opened for this caller.
    pub(crate) fn open(
        &self,
        id: &str,
        auth: &CallerAuth,
        namespace: &str,
        server: &str,
    ) -> Arc<Session> {
        let session = Arc::new(Session {
            caller: auth.name().map(str::to_string),
            namespace: namespace.to_string(),
            server: server.to_string(),
            used: Mutex::new(Instant::now()),
            visible: Mutex::new(None),
        });
        let mut by_id = self.by_id.lock().expect("sessions");
        if by_id.len() >= MAX_SESSIONS
            && let Some(oldest) = by_id
                .iter()
                .min_by_key(|(_, s)| *s.used.lock().expect("session use"))
                .map(|(k, _)| k.clone())
        {
            by_id.remove(&oldest);
        }
        by_id.insert(id.to_string(), session.clone());
        session
    }

    /// The session `id`, when this caller opened it in this namespace on this server.
    pub(crate) fn find(
        &self,
        id: &str,
        auth: &CallerAuth,
        namespace: &str,
        server: &str,
    ) -> Option<Arc<Session>> {
        let by_id = self.by_id.lock().expect("sessions");
        let s = by_id.get(id)?;
        let same =
            s.caller.as_deref() == auth.name() && s.namespace == namespace && s.server == server;
        if !same {
            return None;
        }
        *s.used.lock().expect("session use") = Instant::now();
        Some(s.clone())
    }

    pub(crate) fn end(&self, id: &str) {
        self.by_id.lock().expect("sessions").remove(id);
    }
}
