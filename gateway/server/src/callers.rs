//! The caller policy (`--callers FILE`, a `CallerPolicy`): who may call the gateway and which
//! namespaces each caller may use. A caller is matched by its client certificate (a URI SAN, SPIFFE
//! IDs included, or a DNS SAN; the certificate was verified against `--client-ca` in the handshake)
//! or by the SHA-256 of the bearer token it sends as `authorization: Bearer ...`. The file is
//! re-read when it changes; a broken edit is logged and the last good policy keeps serving.

use arc_swap::ArcSwap;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use sluice_engine::{CallerAuth, Identity};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

const API_VERSION: &str = "sluice.dev/v1alpha1";
const KIND: &str = "CallerPolicy";
/// How often the policy file is looked at.
const POLL: Duration = Duration::from_secs(2);

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    #[serde(rename = "apiVersion")]
    api_version: String,
    kind: String,
    /// Allowed (a name, labels) and not used.
    #[serde(default, rename = "metadata")]
    _metadata: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    callers: Vec<CallerEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CallerEntry {
    name: String,
    #[serde(rename = "match")]
    matcher: MatchEntry,
    namespaces: Vec<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct MatchEntry {
    #[serde(rename = "uriSAN")]
    uri_san: Option<String>,
    #[serde(rename = "dnsSAN")]
    dns_san: Option<String>,
    token_sha256: Option<String>,
}

/// What identifies one caller.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Match {
    UriSan(String),
    DnsSan(String),
    /// The SHA-256 of the bearer token, lowercase hex.
    TokenSha256(String),
}

/// A parsed, checked caller policy.
#[derive(Clone, Debug)]
pub(crate) struct CallerPolicy {
    callers: Vec<(Match, Identity)>,
}

/// Why a policy file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("reading the caller policy {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the caller policy {path} is not valid YAML of a CallerPolicy: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("the caller policy {path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

impl CallerPolicy {
    pub(crate) fn load(path: &Path) -> Result<Self, PolicyError> {
        let text = std::fs::read_to_string(path).map_err(|source| PolicyError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text).map_err(|e| match e {
            Parsed::Yaml(message) => PolicyError::Parse {
                path: path.to_path_buf(),
                message,
            },
            Parsed::Invalid(message) => PolicyError::Invalid {
                path: path.to_path_buf(),
                message,
            },
        })
    }

    fn parse(text: &str) -> Result<Self, Parsed> {
        let file: PolicyFile =
            serde_saphyr::from_str(text).map_err(|e| Parsed::Yaml(e.to_string()))?;
        if file.api_version != API_VERSION || file.kind != KIND {
            return Err(Parsed::Invalid(format!(
                "expected apiVersion {API_VERSION} and kind {KIND}, found {} {}",
                file.api_version, file.kind
            )));
        }
        let mut names = BTreeSet::new();
        let mut callers: Vec<(Match, Identity)> = Vec::new();
        for (i, c) in file.callers.into_iter().enumerate() {
            let at = || format!("callers[{i}] ({:?})", c.name);
            if c.name.is_empty() {
                return Err(Parsed::Invalid(format!("callers[{i}] has no name")));
            }
            if !names.insert(c.name.clone()) {
                return Err(Parsed::Invalid(format!("{}: the name is used twice", at())));
            }
            if c.namespaces.is_empty() || c.namespaces.iter().any(|n| n.is_empty()) {
                return Err(Parsed::Invalid(format!(
                    "{}: namespaces must list at least one namespace (\"*\" for all)",
                    at()
                )));
            }
            let m = match (c.matcher.uri_san, c.matcher.dns_san, c.matcher.token_sha256) {
                (Some(u), None, None) if !u.is_empty() => Match::UriSan(u),
                (None, Some(d), None) if !d.is_empty() => Match::DnsSan(d.to_ascii_lowercase()),
                (None, None, Some(t)) => {
                    let t = t.to_ascii_lowercase();
                    if t.len() != 64 || !t.bytes().all(|b| b.is_ascii_hexdigit()) {
                        return Err(Parsed::Invalid(format!(
                            "{}: tokenSha256 must be 64 hex digits (sha256sum of the token)",
                            at()
                        )));
                    }
                    Match::TokenSha256(t)
                }
                _ => {
                    return Err(Parsed::Invalid(format!(
                        "{}: match needs exactly one of uriSAN, dnsSAN, tokenSha256",
                        at()
                    )));
                }
            };
            if let Some((_, other)) = callers.iter().find(|(seen, _)| *seen == m) {
                return Err(Parsed::Invalid(format!(
                    "{}: the same match as {:?}: one identity is one caller",
                    at(),
                    other.name
                )));
            }
            callers.push((
                m,
                Identity {
                    name: c.name,
                    namespaces: c.namespaces,
                },
            ));
        }
        Ok(Self { callers })
    }

    /// The caller a request comes from: its verified client certificate's SANs first, then its
    /// bearer token. `authorization` is the metadata value as sent.
    pub(crate) fn identify(
        &self,
        peer_certs: Option<&[rustls_pki_types::CertificateDer<'static>]>,
        authorization: Option<&[u8]>,
    ) -> CallerAuth {
        let sans = peer_certs
            .and_then(|c| c.first())
            .map(|leaf| Sans::of(leaf.as_ref()));
        if let Some(sans) = &sans {
            let hit = self.callers.iter().find(|(m, _)| match m {
                Match::UriSan(u) => sans.uris.iter().any(|s| s == u),
                Match::DnsSan(d) => sans.dns.iter().any(|s| s.eq_ignore_ascii_case(d)),
                Match::TokenSha256(_) => false,
            });
            if let Some((_, id)) = hit {
                return CallerAuth::Verified(id.clone());
            }
        }
        let token = authorization.map(bearer);
        if let Some(Some(token)) = &token {
            let digest = hex::encode(Sha256::digest(token));
            if let Some((_, id)) = self
                .callers
                .iter()
                .find(|(m, _)| matches!(m, Match::TokenSha256(t) if *t == digest))
            {
                return CallerAuth::Verified(id.clone());
            }
        }
        let why = match (&sans, &token) {
            (_, Some(None)) => "the authorization metadata is not \"Bearer <token>\"".to_string(),
            (_, Some(Some(_))) => "the bearer token matches no caller".to_string(),
            (Some(s), None) => format!(
                "the client certificate (SANs: {}) matches no caller and no bearer token was sent",
                s.describe()
            ),
            (None, None) => {
                "no verified client certificate and no bearer token (authorization: Bearer ...)"
                    .to_string()
            }
        };
        CallerAuth::Unauthenticated(why)
    }
}

enum Parsed {
    Yaml(String),
    Invalid(String),
}

/// The token of `Bearer <token>` (the scheme is case-insensitive), or None for any other value.
fn bearer(value: &[u8]) -> Option<&[u8]> {
    let (scheme, token) = value.split_at_checked(7)?;
    (scheme.eq_ignore_ascii_case(b"bearer ") && !token.is_empty()).then_some(token)
}

/// The subject alternative names of a certificate the handshake verified.
struct Sans {
    uris: Vec<String>,
    dns: Vec<String>,
}

impl Sans {
    fn of(der: &[u8]) -> Self {
        use x509_parser::extensions::GeneralName;
        let mut sans = Sans {
            uris: vec![],
            dns: vec![],
        };
        // The handshake already parsed and verified it; one that does not parse here has no SANs.
        if let Ok((_, cert)) = x509_parser::parse_x509_certificate(der)
            && let Ok(Some(ext)) = cert.subject_alternative_name()
        {
            for name in &ext.value.general_names {
                match name {
                    GeneralName::URI(u) => sans.uris.push(u.to_string()),
                    GeneralName::DNSName(d) => sans.dns.push(d.to_string()),
                    _ => {}
                }
            }
        }
        sans
    }

    fn describe(&self) -> String {
        let all: Vec<&str> = self
            .uris
            .iter()
            .chain(&self.dns)
            .map(String::as_str)
            .collect();
        if all.is_empty() {
            "none".into()
        } else {
            all.join(", ")
        }
    }
}

/// `sluice_gateway_caller_policy_reloads_total{result}`, registered in `registry`.
pub(crate) fn reload_counter(
    registry: &prometheus::Registry,
) -> prometheus::Result<prometheus::IntCounterVec> {
    let c = prometheus::IntCounterVec::new(
        prometheus::Opts::new(
            "sluice_gateway_caller_policy_reloads_total",
            "Changed caller policy files read, by result (ok, failed: the last good policy stays)",
        ),
        &["result"],
    )?;
    registry.register(Box::new(c.clone()))?;
    Ok(c)
}

/// The policy in force, re-read when its file changes.
pub(crate) struct ReloadingPolicy {
    path: PathBuf,
    current: ArcSwap<CallerPolicy>,
}

impl ReloadingPolicy {
    /// Reads the file once; a bad file here stops the start.
    pub(crate) fn new(path: PathBuf) -> Result<Self, PolicyError> {
        let policy = CallerPolicy::load(&path)?;
        tracing::info!(path = %path.display(), callers = policy.callers.len(), "caller policy loaded");
        Ok(Self {
            path,
            current: ArcSwap::from_pointee(policy),
        })
    }

    pub(crate) fn current(&self) -> Arc<CallerPolicy> {
        self.current.load_full()
    }

    /// Re-reads the file whenever its contents change; `reloads` counts how that went (ok, failed).
    pub(crate) async fn watch(self: Arc<Self>, reloads: Option<prometheus::IntCounterVec>) {
        let count = |result: &str| {
            if let Some(r) = &reloads {
                r.with_label_values(&[result]).inc();
            }
        };
        let mut seen = std::fs::read(&self.path).ok();
        loop {
            tokio::time::sleep(POLL).await;
            let now = std::fs::read(&self.path).ok();
            if now == seen {
                continue;
            }
            seen = now;
            match CallerPolicy::load(&self.path) {
                Ok(policy) => {
                    tracing::info!(path = %self.path.display(), callers = policy.callers.len(), "caller policy reloaded");
                    self.current.store(Arc::new(policy));
                    count("ok");
                }
                Err(e) => {
                    tracing::error!(error = %e, "cannot use the changed caller policy; the last good one stays in force");
                    count("failed");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<CallerPolicy, String> {
        CallerPolicy::parse(text).map_err(|e| match e {
            Parsed::Yaml(m) | Parsed::Invalid(m) => m,
        })
    }

    const HEAD: &str = "apiVersion: sluice.dev/v1alpha1\nkind: CallerPolicy\nmetadata: {name: callers, labels: {team: platform}}\n";

    #[test]
    fn a_token_caller_is_found_by_the_sha256_of_its_bearer_token() {
        let digest = hex::encode(Sha256::digest(b"s3cret"));
        let p = parse(&format!(
            "{HEAD}callers:\n  - name: app\n    match: {{tokenSha256: \"{}\"}}\n    namespaces: [support]\n",
            digest.to_uppercase()
        ))
        .unwrap();
        match p.identify(None, Some(b"Bearer s3cret")) {
            CallerAuth::Verified(id) => assert_eq!(id.name, "app"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            p.identify(None, Some(b"Bearer wrong")),
            CallerAuth::Unauthenticated(m) if m.contains("matches no caller")
        ));
        assert!(matches!(
            p.identify(None, Some(b"Basic czNjcmV0")),
            CallerAuth::Unauthenticated(m) if m.contains("Bearer")
        ));
        assert!(matches!(
            p.identify(None, None),
            CallerAuth::Unauthenticated(m) if m.contains("no verified client certificate")
        ));
    }

    #[test]
    fn malformed_policies_say_what_is_wrong() {
        let cases = [
            ("apiVersion: v1\nkind: ConfigMap\n", "expected apiVersion"),
            (
                &format!("{HEAD}callers:\n  - {{name: a, match: {{}}, namespaces: [x]}}\n"),
                "exactly one of",
            ),
            (
                &format!(
                    "{HEAD}callers:\n  - {{name: a, match: {{uriSAN: u, dnsSAN: d}}, namespaces: [x]}}\n"
                ),
                "exactly one of",
            ),
            (
                &format!(
                    "{HEAD}callers:\n  - {{name: a, match: {{tokenSha256: abc}}, namespaces: [x]}}\n"
                ),
                "64 hex digits",
            ),
            (
                &format!("{HEAD}callers:\n  - {{name: a, match: {{dnsSAN: d}}, namespaces: []}}\n"),
                "at least one namespace",
            ),
            (
                &format!(
                    "{HEAD}callers:\n  - {{name: a, match: {{dnsSAN: d}}, namespaces: [x]}}\n  - {{name: a, match: {{dnsSAN: e}}, namespaces: [x]}}\n"
                ),
                "used twice",
            ),
            (
                &format!(
                    "{HEAD}callers:\n  - {{name: a, match: {{dnsSAN: d}}, namespaces: [x]}}\n  - {{name: b, match: {{dnsSAN: D}}, namespaces: [y]}}\n"
                ),
                "the same match as \"a\"",
            ),
            (
                &format!(
                    "{HEAD}callers:\n  - {{name: a, match: {{spiffe: d}}, namespaces: [x]}}\n"
                ),
                "spiffe",
            ),
        ];
        for (text, want) in cases {
            let err = parse(text).expect_err(text);
            assert!(err.contains(want), "{text}: {err}");
        }
    }
}
