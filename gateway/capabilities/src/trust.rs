//! What the platform trusts capabilities with: where they may point ([`AllowedEndpoints`]) and what
//! the gateway presents to them, so that an application can tell the gateway from anything else
//! that reaches its port.
//!
//! Credentials come in sets, one directory each under `--capability-credentials` (in a cluster, a
//! Secret the chart mounts there), named by a Capability's `spec.endpoint.credentials`. A set holds
//! any of:
//! - `token`: sent as `authorization: Bearer <token>`, over HTTPS only (or to a loopback address);
//! - `tls.crt` and `tls.key`: the client certificate the gateway presents (mutual TLS);
//! - `ca.crt`: the CA that signed the endpoint's server certificate (else the system's roots).
//!
//! Files are read again at every call (a few small reads), so a rotated Secret is used as soon as
//! the kubelet has written it; the TLS clients are rebuilt only when a file changed.

use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use sluice_crds::endpoints::AllowedEndpoints;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Where capabilities may point and the credentials directory: set by the platform team, for the
/// gateway as a whole.
#[derive(Clone, Debug)]
pub struct Trust {
    pub allowed: AllowedEndpoints,
    /// One subdirectory per credential set; `None`: no Capability may name credentials.
    pub credentials: Option<PathBuf>,
}

impl Trust {
    /// Local mode's default: loopback endpoints (where the example services listen), no credentials.
    pub fn local() -> Self {
        Self {
            allowed: AllowedEndpoints::loopback(),
            credentials: None,
        }
    }

    /// A cluster's default: built-in endpoints only, until the platform lists others.
    pub fn cluster() -> Self {
        Self {
            allowed: AllowedEndpoints::default(),
            credentials: None,
        }
    }
}

pub(crate) type HttpClient = hyper_util::client::legacy::Client<
    HttpsConnector<HttpConnector>,
    http_body_util::Full<bytes::Bytes>,
>;

/// Why a credential set cannot be used.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CredentialError {
    #[error(
        "the Capability names credentials {0:?}, but the gateway has none (--capability-credentials)"
    )]
    NoDirectory(String),
    #[error("credential set {name:?}: cannot read {path}: {reason}")]
    Read {
        name: String,
        path: PathBuf,
        reason: String,
    },
    #[error(
        "credential set {name:?} holds nothing the gateway can present (token, tls.crt with tls.key, ca.crt) in {dir}"
    )]
    Empty { name: String, dir: PathBuf },
    #[error("credential set {name:?}: {reason}")]
    Unusable { name: String, reason: String },
}

/// The files of one set, as last read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Files {
    token: Option<Vec<u8>>,
    cert: Option<Vec<u8>>,
    key: Option<Vec<u8>>,
    ca: Option<Vec<u8>>,
}

impl Files {
    async fn read(name: &str, dir: &Path) -> Result<Self, CredentialError> {
        let read = |file: &'static str| {
            let path = dir.join(file);
            async move {
                match tokio::fs::read(&path).await {
                    Ok(bytes) => Ok(Some(bytes)),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                    Err(e) => Err(CredentialError::Read {
                        name: name.to_string(),
                        path,
                        reason: e.to_string(),
                    }),
                }
            }
        };
        let files = Self {
            token: read("token").await?,
            cert: read("tls.crt").await?,
            key: read("tls.key").await?,
            ca: read("ca.crt").await?,
        };
        if files == Self::default() {
            return Err(CredentialError::Empty {
                name: name.to_string(),
                dir: dir.to_path_buf(),
            });
        }
        Ok(files)
    }
}

/// One credential set, ready to use: its HTTPS client, its TLS settings for gRPC channels and the
/// bearer token.
pub(crate) struct CredentialSet {
    files: Files,
    pub(crate) http: HttpClient,
    pub(crate) token: Option<http::HeaderValue>,
    /// `(client certificate, key)` and CA, PEM, for tonic's channels.
    pub(crate) identity: Option<(Vec<u8>, Vec<u8>)>,
    pub(crate) ca: Option<Vec<u8>>,
    /// gRPC channels of this set, by URL.
    pub(crate) channels: Mutex<HashMap<String, tonic::transport::Channel>>,
}

impl CredentialSet {
    fn build(name: &str, files: Files) -> Result<Self, CredentialError> {
        let unusable = |reason: String| CredentialError::Unusable {
            name: name.to_string(),
            reason,
        };
        let token = match &files.token {
            None => None,
            Some(raw) => {
                let text = std::str::from_utf8(raw)
                    .map_err(|_| unusable("token is not UTF-8".into()))?
                    .trim();
                if text.is_empty() {
                    return Err(unusable("token is empty".into()));
                }
                let mut value = http::HeaderValue::from_str(&format!("Bearer {text}"))
                    .map_err(|_| unusable("token holds characters a header cannot".into()))?;
                value.set_sensitive(true);
                Some(value)
            }
        };
        let identity = match (&files.cert, &files.key) {
            (Some(c), Some(k)) => Some((c.clone(), k.clone())),
            (None, None) => None,
            _ => return Err(unusable("tls.crt and tls.key go together".into())),
        };
        let config = tls_config(identity.as_ref(), files.ca.as_deref()).map_err(unusable)?;
        Ok(Self {
            http: https_client(config),
            token,
            identity,
            ca: files.ca.clone(),
            files,
            channels: Mutex::default(),
        })
    }
}

/// A rustls client configuration: the given CA or the system's roots, and the client certificate.
pub(crate) fn tls_config(
    identity: Option<&(Vec<u8>, Vec<u8>)>,
    ca: Option<&[u8]>,
) -> Result<rustls::ClientConfig, String> {
    let mut roots = rustls::RootCertStore::empty();
    match ca {
        Some(pem) => {
            for cert in CertificateDer::pem_slice_iter(pem) {
                let cert = cert.map_err(|e| format!("ca.crt: {e}"))?;
                roots.add(cert).map_err(|e| format!("ca.crt: {e}"))?;
            }
            if roots.is_empty() {
                return Err("ca.crt holds no certificate".into());
            }
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            for cert in native.certs {
                // A system bundle may carry certificates rustls cannot use; the rest still serve.
                let _ = roots.add(cert);
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots);
    match identity {
        None => Ok(builder.with_no_client_auth()),
        Some((cert, key)) => {
            let chain = CertificateDer::pem_slice_iter(cert)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("tls.crt: {e}"))?;
            if chain.is_empty() {
                return Err("tls.crt holds no certificate".into());
            }
            let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| format!("tls.key: {e}"))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| format!("tls.crt and tls.key: {e}"))
        }
    }
}

/// An HTTP/1 client that speaks HTTPS with `config`, or plain HTTP to `http://` URLs.
pub(crate) fn https_client(config: rustls::ClientConfig) -> HttpClient {
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_or_http()
        .enable_http1()
        .build();
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_idle_timeout(std::time::Duration::from_secs(30))
        .build(connector)
}

/// The credential sets under a directory, each rebuilt when one of its files changes.
#[derive(Default)]
pub(crate) struct Credentials {
    dir: Option<PathBuf>,
    sets: Mutex<HashMap<String, Arc<CredentialSet>>>,
}

impl Credentials {
    pub(crate) fn new(dir: Option<PathBuf>) -> Self {
        Self {
            dir,
            sets: Mutex::default(),
        }
    }

    /// The set `name`, as its files read now.
    pub(crate) async fn get(&self, name: &str) -> Result<Arc<CredentialSet>, CredentialError> {
        let dir = self
            .dir
            .as_ref()
            .ok_or_else(|| CredentialError::NoDirectory(name.to_string()))?;
        // The name was validated as a DNS-label-like word, so it cannot leave the directory; a
        // set that did not pass validation still must not.
        if name.is_empty() || name.contains(['/', '.']) {
            return Err(CredentialError::Unusable {
                name: name.to_string(),
                reason: "not a credential set's name".into(),
            });
        }
        let files = Files::read(name, &dir.join(name)).await?;
        if let Some(set) = self.lock().get(name)
            && set.files == files
        {
            return Ok(set.clone());
        }
        let set = Arc::new(CredentialSet::build(name, files)?);
        self.lock().insert(name.to_string(), set.clone());
        Ok(set)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<CredentialSet>>> {
        self.sets.lock().unwrap_or_else(|p| p.into_inner())
    }
}
