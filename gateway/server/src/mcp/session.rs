//! MCP sessions as the proxy hands them out: the id a client gets is the server's session id sealed
//! to the caller, namespace and server that opened it (an HMAC under the gateway's session key), so
//! any gateway replica with the same key serves it and to anyone else it does not exist; and which
//! tools the chains let each session see (a hidden tool cannot be called), kept per replica.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use sluice_engine::CallerAuth;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Sessions whose visible tools are kept at most; past that the one used longest ago is forgotten
/// (its next call lists the tools again).
const MAX_SESSIONS: usize = 10_000;
/// Hex digits of the seal (128 bits).
const SEAL_HEX: usize = 32;

#[derive(Debug)]
pub(crate) struct Session {
    used: Mutex<Instant>,
    /// The tools the chains let this session see, once a `tools/list` passed them (`None`: not
    /// listed yet on this replica).
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

/// Who a session is bound to.
pub(crate) struct Owner<'a> {
    pub(crate) auth: &'a CallerAuth,
    pub(crate) namespace: &'a str,
    pub(crate) server: &'a str,
}

pub(crate) struct Sessions {
    key: Vec<u8>,
    by_id: Mutex<HashMap<String, Arc<Session>>>,
}

impl Sessions {
    /// Sessions sealed under `key` (every replica of a gateway needs the same one).
    pub(crate) fn new(key: Vec<u8>) -> Self {
        Self {
            key,
            by_id: Mutex::new(HashMap::new()),
        }
    }

    /// A key of this process alone: sessions live as long as it does.
    pub(crate) fn random_key() -> Vec<u8> {
        use rand::RngCore;
        let mut key = vec![0u8; 32];
        rand::rng().fill_bytes(&mut key);
        key
    }

    fn seal_of(&self, upstream: &str, owner: &Owner) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.key).expect("HMAC takes any key");
        for part in [
            owner.auth.name().unwrap_or_default(),
            owner.namespace,
            owner.server,
            upstream,
        ] {
            mac.update(&(part.len() as u64).to_be_bytes());
            mac.update(part.as_bytes());
        }
        let mut seal = hex::encode(mac.finalize().into_bytes());
        seal.truncate(SEAL_HEX);
        seal
    }

    /// The id the client gets for the server's session `upstream`.
    pub(crate) fn seal(&self, upstream: &str, owner: &Owner) -> String {
        format!("{upstream}.{}", self.seal_of(upstream, owner))
    }

    /// The server's session behind the client's `id`, when `owner` is the one it was sealed to.
    pub(crate) fn unseal(&self, id: &str, owner: &Owner) -> Option<String> {
        let (upstream, seal) = id.rsplit_once('.')?;
        let expected = self.seal_of(upstream, owner);
        // Compared in constant time: the seal is what keeps a session its owner's.
        let same = seal.len() == expected.len()
            && seal
                .bytes()
                .zip(expected.bytes())
                .fold(0u8, |d, (a, b)| d | (a ^ b))
                == 0;
        same.then(|| upstream.to_string())
    }

    /// This replica's record of the client's session `id` (already unsealed).
    pub(crate) fn get(&self, id: &str) -> Arc<Session> {
        let mut by_id = self.by_id.lock().expect("sessions");
        if let Some(s) = by_id.get(id) {
            *s.used.lock().expect("session use") = Instant::now();
            return s.clone();
        }
        if by_id.len() >= MAX_SESSIONS
            && let Some(oldest) = by_id
                .iter()
                .min_by_key(|(_, s)| *s.used.lock().expect("session use"))
                .map(|(k, _)| k.clone())
        {
            by_id.remove(&oldest);
        }
        let s = Arc::new(Session {
            used: Mutex::new(Instant::now()),
            visible: Mutex::new(None),
        });
        by_id.insert(id.to_string(), s.clone());
        s
    }

    pub(crate) fn end(&self, id: &str) {
        self.by_id.lock().expect("sessions").remove(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_engine::Identity;

    fn caller(name: &str, ns: &str) -> CallerAuth {
        CallerAuth::Verified(Identity {
            name: name.into(),
            namespaces: vec![ns.into()],
        })
    }

    #[test]
    fn a_sealed_session_opens_for_its_owner_alone_and_under_its_key_alone() {
        let sessions = Sessions::new(b"a key of the gateway's".to_vec());
        let a = caller("agent-a", "team-a");
        let b = caller("agent-b", "team-b");
        let owner = |auth, namespace, server| Owner {
            auth,
            namespace,
            server,
        };
        let id = sessions.seal("upstream-1", &owner(&a, "team-a", "tools"));
        assert!(id.starts_with("upstream-1."), "{id}");
        assert_eq!(
            sessions
                .unseal(&id, &owner(&a, "team-a", "tools"))
                .as_deref(),
            Some("upstream-1")
        );
        // Another replica with the same key serves it.
        let replica = Sessions::new(b"a key of the gateway's".to_vec());
        assert!(replica.unseal(&id, &owner(&a, "team-a", "tools")).is_some());
        for (auth, ns, server) in [
            (&b, "team-b", "tools"),
            (&b, "team-a", "tools"),
            (&a, "team-b", "tools"),
            (&a, "team-a", "other"),
        ] {
            assert_eq!(sessions.unseal(&id, &owner(auth, ns, server)), None);
        }
        // Neither another key, nor the server's id with another seal, nor one without a seal.
        let other = Sessions::new(b"another key".to_vec());
        assert_eq!(other.unseal(&id, &owner(&a, "team-a", "tools")), None);
        let forged = format!("upstream-2.{}", id.rsplit_once('.').unwrap().1);
        assert_eq!(
            sessions.unseal(&forged, &owner(&a, "team-a", "tools")),
            None
        );
        assert_eq!(
            sessions.unseal("upstream-1", &owner(&a, "team-a", "tools")),
            None
        );
    }
}
