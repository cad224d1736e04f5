//! The webhook's serving certificate, read from PEM files and read again when they change:
//! cert-manager (or whoever owns the Secret) rotates them, the kubelet swaps the mounted files, and
//! the next connection is served with the new pair, without a restart.

use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

/// Why a certificate and key pair cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} holds no PEM certificate")]
    NoCertificate { path: PathBuf },
    #[error("{path} is not a PEM certificate chain: {source}")]
    Certificate {
        path: PathBuf,
        source: rustls::pki_types::pem::Error,
    },
    #[error("{path} is not a PEM private key: {source}")]
    Key {
        path: PathBuf,
        source: rustls::pki_types::pem::Error,
    },
    #[error("the certificate in {cert} and the key in {key} cannot be served together: {source}")]
    Pair {
        cert: PathBuf,
        key: PathBuf,
        source: rustls::Error,
    },
}

/// What identifies one version of a file: a kubelet update swaps a symlink to a new file, an
/// in-place write changes the size or the modification time.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Stamp {
    inode: u64,
    len: u64,
    modified: Option<SystemTime>,
}

fn stamp(path: &Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt;
    // `metadata` follows symlinks: the file the mounted name points at now.
    let m = std::fs::metadata(path).ok()?;
    Some(Stamp {
        inode: m.ino(),
        len: m.len(),
        modified: m.modified().ok(),
    })
}

/// The served certificate: checked against the files at each new connection (two `stat`s), loaded
/// again only when they changed. A pair that does not load (a rotation caught half-written, a key
/// that does not match) keeps the previous one serving and is tried again once the files change.
pub struct CertReloader {
    cert: PathBuf,
    key: PathBuf,
    current: Mutex<Current>,
}

struct Current {
    stamps: (Option<Stamp>, Option<Stamp>),
    config: Arc<ServerConfig>,
}

impl CertReloader {
    /// Loads the pair once; an error here stops the operator from starting with a webhook it
    /// cannot serve.
    pub fn load(cert: &Path, key: &Path) -> Result<Self, TlsError> {
        let stamps = (stamp(cert), stamp(key));
        let config = server_config(cert, key)?;
        Ok(Self {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            current: Mutex::new(Current { stamps, config }),
        })
    }

    /// The configuration to serve the next connection with.
    pub fn current(&self) -> Arc<ServerConfig> {
        let stamps = (stamp(&self.cert), stamp(&self.key));
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if current.stamps != stamps {
            // Remember what was seen either way, so a broken pair is reported once, not per connection.
            current.stamps = stamps;
            match server_config(&self.cert, &self.key) {
                Ok(config) => {
                    tracing::info!(cert = %self.cert.display(), "webhook certificate reloaded");
                    current.config = config;
                }
                Err(e) => tracing::warn!(error = %e,
                    "webhook certificate files changed but cannot be served; the previous pair keeps serving"),
            }
        }
        current.config.clone()
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, TlsError> {
    let chain = CertificateDer::pem_slice_iter(&read(cert)?)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::Certificate {
            path: cert.to_path_buf(),
            source,
        })?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate {
            path: cert.to_path_buf(),
        });
    }
    let private = PrivateKeyDer::from_pem_slice(&read(key)?).map_err(|source| TlsError::Key {
        path: key.to_path_buf(),
        source,
    })?;
    let pair = |source| TlsError::Pair {
        cert: cert.to_path_buf(),
        key: key.to_path_buf(),
        source,
    };
    let mut config =
        ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(pair)?
            .with_no_client_auth()
            .with_single_cert(chain, private)
            .map_err(pair)?;
    // The server speaks HTTP/1.1 only; the API server's webhook client negotiates it.
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}
